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
from services.bench.stack_client import read_chunk

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
    body = {"model": model, "messages": [{"role": "user", "content": prompt.prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
            # the load repeats prompts at once: each request its own salt, so what is measured is batching, not
            # single-flight or prefix reuse (`mirror-sd bench --merging` measures those)
            "cache_salt": uuid.uuid4().hex}
    if route is not None:
        body["route"] = route
    started = time.perf_counter()
    ttft, last_chunk = None, None
    gaps: list[float] = []
    token_ids: list[int] = []
    finish_reason, usage = None, {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"{prompt.id}: HTTP {response.status_code}: {response.text}")
        async for line in response.aiter_lines():
            chunk = read_chunk(line, prompt.id)
            if chunk is None:
                continue
            if not chunk["choices"]:
                usage = chunk
                continue
            choice = chunk["choices"][0]
            now = time.perf_counter()
            if choice["delta"].get("content"):
                if ttft is None:
                    ttft = now - started
                else:
                    gaps.append(now - last_chunk)
                last_chunk = now
            token_ids += choice.get("token_ids") or []
            if choice["finish_reason"] is not None:
                finish_reason = choice["finish_reason"]
    num_tokens = usage.get("usage", {}).get("completion_tokens", len(token_ids))
    return StreamRecord(prompt.id, token_ids, num_tokens, ttft, time.perf_counter() - started, gaps, finish_reason,
                        usage.get("mirror_sd", {}))


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
