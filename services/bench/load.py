"""Closed-loop load on a running stack: N requests, C in flight, streamed; per-request timings.

Each request is an OpenAI chat completion with `stream: true`; the client
records when each content chunk arrives. TTFT is the first content chunk,
inter-token latency (ITL) the gap between consecutive content chunks (as
vLLM's serving benchmark counts it: with speculative decoding a chunk may
carry several tokens), TPOT (end - TTFT) / (tokens - 1).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

import httpx

from services.bench.prompts import BenchPrompt
from services.gateway_client import GatewayHTTPError, astream_chat, chat_body

logger = logging.getLogger(__name__)


@dataclass
class StreamRecord:
    prompt_id: str
    token_ids: list[int]
    num_tokens: int
    ttft_s: float | None
    e2e_s: float
    chunk_gaps_s: list[float]
    finish_reason: str | None
    stats: dict = field(default_factory=dict)  # the response's mirror_sd block

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.num_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_tokens - 1)


@dataclass
class LevelRun:
    """One mode at one concurrency: every request's record and the wall time of the whole level."""

    mode: str
    concurrency: int
    records: list[StreamRecord]
    wall_s: float
    extra: dict = field(default_factory=dict)


async def _one(client: httpx.AsyncClient, model: str, prompt: BenchPrompt, *, max_tokens: int,
               route: str | None) -> StreamRecord:
    # the load repeats prompts at once: each request its own salt, so what is measured is batching, not
    # single-flight or prefix reuse (`mirror-sd bench --merging` measures those)
    body = chat_body(model, prompt.prompt, max_tokens, temperature=0, cache_salt=uuid.uuid4().hex)
    if route is not None:
        body["route"] = route
    try:
        answer = await astream_chat(client, body)
    except GatewayHTTPError as exc:
        raise RuntimeError(f"{prompt.id}: {exc}") from None
    answer.raise_for_error(prompt.id)
    return StreamRecord(prompt.id, answer.token_ids or [], answer.completion_tokens, answer.ttft_s, answer.total_s,
                        answer.gaps_s, answer.finish_reason, answer.stats)


async def _level(url: str, model: str, prompts: list[BenchPrompt], concurrency: int, *, max_tokens: int,
                 route: str | None, api_key: str | None) -> tuple[list[StreamRecord], float]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    queue: asyncio.Queue[tuple[int, BenchPrompt]] = asyncio.Queue()
    for item in enumerate(prompts):
        queue.put_nowait(item)
    records: list[StreamRecord | None] = [None] * len(prompts)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=900, limits=limits) as client:
        async def user() -> None:  # closed loop: the next request as soon as this one ends
            while not queue.empty():
                index, prompt = queue.get_nowait()
                records[index] = await _one(client, model, prompt, max_tokens=max_tokens, route=route)

        started = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        wall_s = time.perf_counter() - started
    return [record for record in records if record is not None], wall_s


def run_level(url: str, model: str, prompts: list[BenchPrompt], concurrency: int, *, max_tokens: int,
              route: str | None = None, api_key: str | None = None, mode: str = "stack") -> LevelRun:
    records, wall_s = asyncio.run(_level(url, model, prompts, concurrency, max_tokens=max_tokens, route=route,
                                         api_key=api_key))
    return LevelRun(mode, concurrency, records, wall_s)
