"""The burst drill: N requests at once; every answer must be 200, 503 or 429 (with Retry-After), and a
refusal must come fast."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from services.speculative.stats import percentile


@dataclass
class BurstReport:
    requests: int
    statuses: dict[str, int]
    reject_ms: dict[str, float | None]  # p50 / p99 / max of the 503 and 429 answers, from send to answer
    ok_ms: dict[str, float | None]
    missing_retry_after: int = 0
    errors: list[str] = field(default_factory=list)  # transport errors (connection refused, reset)
    wall_s: float = 0.0

    @property
    def only_expected(self) -> bool:
        return set(self.statuses) <= {"200", "503", "429"} and not self.errors and not self.missing_retry_after


def quantiles(values: list[float]) -> dict[str, float | None]:
    def pick(q: float) -> float | None:
        value = percentile(values, q)
        return None if value is None else round(value, 1)

    return {"p50": pick(0.5), "p99": pick(0.99), "max": round(max(values), 1) if values else None}


@dataclass
class _Start:
    """The burst's starting gun: fired once every connection is open (or failed)."""

    go: asyncio.Event = field(default_factory=asyncio.Event)
    connected: int = 0


async def _exchange(host: str, port: int, payload: bytes, timeout_s: float,
                    start: _Start) -> tuple[int | None, float, str | None, str]:
    """One request on its own connection: connect, wait for the burst's start, send, read the answer.
    Timed from the send (a client's own queueing is not the server's answer time)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, asyncio.TimeoutError) as exc:
        return None, 0.0, None, f"connect: {type(exc).__name__}: {exc}"
    start.connected += 1
    await start.go.wait()
    started = time.perf_counter()
    try:
        writer.write(payload)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout_s)
        elapsed = 1000 * (time.perf_counter() - started)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {name.strip().lower(): value.strip() for name, _, value in
                   (line.partition(":") for line in lines[1:] if line)}
        return status, elapsed, headers.get("retry-after"), ""
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, IndexError) as exc:
        return None, 1000 * (time.perf_counter() - started), None, f"{type(exc).__name__}: {exc}"
    finally:
        writer.close()


async def _burst(url: str, body: dict, count: int, timeout_s: float, headers: dict,
                 settle_s: float = 0.0) -> tuple[list, float]:
    """count connections opened first, then every request sent at once (raw HTTP/1.1: the client's own work
    per request is a write and a read, so the figures are the server's). settle_s: a pause between the last
    connection and the sends, so the server has accepted them all (its accept work is then not in the figures)."""
    parsed = httpx.URL(url)
    host, port = parsed.host, parsed.port or (443 if parsed.scheme == "https" else 80)
    def payload(index: int) -> bytes:
        # each request its own cache salt: a burst of distinct requests (identical ones would share one generation)
        content = json.dumps({**body, "cache_salt": f"burst-{index}"}).encode()
        head = ["POST /v1/chat/completions HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
                f"Content-Length: {len(content)}", "Connection: close",
                *(f"{name}: {value}" for name, value in headers.items())]
        return ("\r\n".join(head) + "\r\n\r\n").encode() + content

    start = _Start()
    tasks = [asyncio.create_task(_exchange(host, port, payload(index), timeout_s, start)) for index in range(count)]
    for _ in range(200):  # until every connection is open (or failed), at most ~10 s
        await asyncio.sleep(0.05)
        if start.connected + sum(task.done() for task in tasks) >= count:
            break
    await asyncio.sleep(settle_s)
    started = time.perf_counter()
    start.go.set()
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - started


def _run(coroutine):
    """On uvloop when it is there (as the gateway is): the client's own turn per request is then smaller."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def run_burst(url: str, *, model: str, count: int, max_tokens: int = 8, timeout_s: float = 600.0,
              api_key: str | None = None, settle_s: float = 0.0) -> BurstReport:
    body = {"model": model, "messages": [{"role": "user", "content": "Say yes."}], "max_tokens": max_tokens,
            "temperature": 0}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    results, wall_s = _run(_burst(url, body, count, timeout_s, headers, settle_s))
    statuses = Counter(str(status) for status, _, _, error in results if not error)
    rejected = [ms for status, ms, _, _ in results if status in (503, 429)]
    return BurstReport(
        requests=count, statuses=dict(statuses), reject_ms=quantiles(rejected),
        ok_ms=quantiles([ms for status, ms, _, _ in results if status == 200]),
        missing_retry_after=sum(1 for status, _, retry, _ in results if status in (503, 429) and not retry),
        errors=sorted({error for *_, error in results if error})[:10], wall_s=wall_s)
