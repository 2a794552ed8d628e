"""A client of the gateway's streamed completions, for the bench, the drills and the tests: the SSE framing
read in one place (`sse_payload`), an answer gathered in one place (`StreamedAnswer`), sync and asyncio.

A streamed answer is `data: {json}` chunks, then `data: [DONE]`: content deltas; with
`return_token_ids` the last content chunk (the one with a finish_reason) carries every token id; with
`stream_options.include_usage` a chunk without choices carries `usage` and `mirror_sd` stats; a failure
mid-stream is a chunk with `error` (OpenAI's shape), then `[DONE]`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterable, Iterable
from dataclasses import dataclass, field

import httpx

DONE = "[DONE]"
CHAT_PATH = "/v1/chat/completions"


class GatewayHTTPError(RuntimeError):
    """The gateway answered with another status than 200."""

    def __init__(self, status_code: int, text: str, retry_after: str | None = None) -> None:
        super().__init__(f"HTTP {status_code}: {text[:300]}")
        self.status_code, self.text, self.retry_after = status_code, text, retry_after


def sse_payload(line: str) -> dict | str | None:
    """One line of an SSE stream: its `data:` JSON chunk, DONE, or None (blank lines, comments, other fields)."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    return data if data == DONE else json.loads(data)


def chat_body(model: str, prompt: str | list[dict], max_tokens: int, **extra) -> dict:
    """A streamed chat completion of one user message (or of a whole chat's messages), with its token ids and
    its usage chunk."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    return {"model": model, "messages": messages, "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True, **extra}


@dataclass
class StreamedAnswer:
    """What a streamed completion said, and when (perf_counter seconds from `started`)."""

    started: float = field(default_factory=time.perf_counter)
    id: str | None = None
    text: str = ""
    token_ids: list[int] | None = None  # the finishing chunk's (return_token_ids)
    finish_reason: str | None = None
    usage: dict = field(default_factory=dict)  # the include_usage chunk: "usage", "mirror_sd"
    error: dict | None = None  # an error chunk's "error"
    done: bool = False  # [DONE] seen
    chunks: int = 0  # content chunks
    ttft_s: float | None = None  # to the first content
    gaps_s: list[float] = field(default_factory=list)  # between content chunks
    total_s: float = 0.0
    _last: float | None = None

    def feed(self, payload: dict | str | None, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        self.total_s = now - self.started
        if payload is None:
            return
        if payload == DONE:
            self.done = True
            return
        self.id = payload.get("id", self.id)
        if "error" in payload:
            self.error = payload["error"]
            return
        if not payload.get("choices"):
            self.usage = payload
            return
        choice = payload["choices"][0]
        content = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
        if content:
            self.chunks += 1
            if self.ttft_s is None:
                self.ttft_s = now - self.started
            else:
                self.gaps_s.append(now - self._last)
            self._last = now
            self.text += content
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
            self.token_ids = choice.get("token_ids", self.token_ids)

    @property
    def completion_tokens(self) -> int:
        usage = self.usage.get("usage") or {}
        return usage.get("completion_tokens", len(self.token_ids or []))

    @property
    def stats(self) -> dict:
        """The answer's mirror_sd stats (include_usage), {} without."""
        return self.usage.get("mirror_sd") or {}

    def raise_for_error(self, what: str = "") -> "StreamedAnswer":
        if self.error is not None:
            raise RuntimeError(f"{what + ': ' if what else ''}{self.error.get('message', self.error)}")
        return self


def _check(response: httpx.Response) -> None:
    if response.status_code != 200:
        raise GatewayHTTPError(response.status_code, response.text, response.headers.get("Retry-After"))


def read_lines(lines: Iterable[str], answer: StreamedAnswer | None = None) -> StreamedAnswer:
    answer = answer or StreamedAnswer()
    for line in lines:
        answer.feed(sse_payload(line))
        if answer.done:
            break
    return answer


async def aread_lines(lines: AsyncIterable[str], answer: StreamedAnswer | None = None) -> StreamedAnswer:
    answer = answer or StreamedAnswer()
    async for line in lines:
        answer.feed(sse_payload(line))
        if answer.done:
            break
    return answer


def stream_chat(client: httpx.Client, body: dict, path: str = CHAT_PATH, **kwargs) -> StreamedAnswer:
    """POST a streamed completion and read it whole; GatewayHTTPError for another status than 200."""
    answer = StreamedAnswer()
    with client.stream("POST", path, json=body, **kwargs) as response:
        if response.status_code != 200:
            response.read()
        _check(response)
        return read_lines(response.iter_lines(), answer)


async def astream_chat(client: httpx.AsyncClient, body: dict, path: str = CHAT_PATH, **kwargs) -> StreamedAnswer:
    """stream_chat's asyncio twin."""
    answer = StreamedAnswer()
    async with client.stream("POST", path, json=body, **kwargs) as response:
        if response.status_code != 200:
            await response.aread()
        _check(response)
        return await aread_lines(response.aiter_lines(), answer)
