"""The burst drill: N requests at once; every answer must be 200, 503 or 429 (with Retry-After), and a
refusal must come fast."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx


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
    ordered = sorted(values)
    pick = (lambda q: round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)) if ordered else (lambda q: None)
    return {"p50": pick(0.5), "p99": pick(0.99), "max": round(ordered[-1], 1) if ordered else None}


async def _burst(url: str, body: dict, count: int, timeout_s: float, headers: dict) -> tuple[list, float]:
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits, headers=headers) as client:
        async def one() -> tuple[int | None, float, str | None, str]:
            started = time.perf_counter()
            try:
                answer = await client.post("/v1/chat/completions", json=body)
                return answer.status_code, 1000 * (time.perf_counter() - started), \
                    answer.headers.get("Retry-After"), ""
            except httpx.HTTPError as exc:
                return None, 1000 * (time.perf_counter() - started), None, f"{type(exc).__name__}: {exc}"

        started = time.perf_counter()
        results = await asyncio.gather(*(one() for _ in range(count)))
        return results, time.perf_counter() - started


def run_burst(url: str, *, model: str, count: int, max_tokens: int = 8, timeout_s: float = 600.0,
              api_key: str | None = None) -> BurstReport:
    body = {"model": model, "messages": [{"role": "user", "content": "Say yes."}], "max_tokens": max_tokens,
            "temperature": 0}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    results, wall_s = asyncio.run(_burst(url, body, count, timeout_s, headers))
    statuses = Counter(str(status) for status, _, _, error in results if not error)
    rejected = [ms for status, ms, _, _ in results if status in (503, 429)]
    return BurstReport(
        requests=count, statuses=dict(statuses), reject_ms=quantiles(rejected),
        ok_ms=quantiles([ms for status, ms, _, _ in results if status == 200]),
        missing_retry_after=sum(1 for status, _, retry, _ in results if status in (503, 429) and not retry),
        errors=sorted({error for *_, error in results if error})[:10], wall_s=wall_s)
