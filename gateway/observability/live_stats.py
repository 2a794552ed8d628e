"""The gateway's recent figures for the dashboard: tokens/s, TTFT and finished requests per second, and
acceptance per draft position since start.

Prometheus histograms and counters answer "since start" and need a scraper to turn into
rates; the dashboard wants the last two minutes, per second, from one JSON call. So the
same observations are also kept here, in one-second buckets (a dict of at most
`window_s` entries: constant memory, O(1) per observation). Figures are this gateway
process's own; behind several gateways each dashboard shows its gateway.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from services.speculative.stats import SpecDecodingStats, percentile

logger = logging.getLogger(__name__)


@dataclass
class SecondBucket:
    tokens: int = 0  # generated tokens that reached the gateway in this second
    finished: int = 0  # requests finished in this second
    ttft_sum_s: float = 0.0  # over requests finished in this second that produced a token
    ttft_count: int = 0


@dataclass
class LiveStats:
    window_s: int = 120
    buckets: dict[int, SecondBucket] = field(default_factory=dict)  # unix second -> bucket
    spec: SpecDecodingStats = field(default_factory=SpecDecodingStats)  # finished requests, merged
    recent_ttft_s: list[float] = field(default_factory=list)  # last 200 TTFTs, for percentiles

    def _bucket(self, now: float | None) -> SecondBucket:
        second = int(now if now is not None else time.time())
        bucket = self.buckets.get(second)
        if bucket is None:
            for old in [s for s in self.buckets if s <= second - self.window_s]:
                del self.buckets[old]
            bucket = self.buckets[second] = SecondBucket()
        return bucket

    def add_tokens(self, num_tokens: int, now: float | None = None) -> None:
        if num_tokens:
            self._bucket(now).tokens += num_tokens

    def observe_finished(self, *, ttft_s: float | None, stats: SpecDecodingStats | None,
                         now: float | None = None) -> None:
        bucket = self._bucket(now)
        bucket.finished += 1
        if ttft_s is not None:
            bucket.ttft_sum_s += ttft_s
            bucket.ttft_count += 1
            self.recent_ttft_s = [*self.recent_ttft_s[-199:], ttft_s]
        if stats is not None:
            self.spec.merge(stats)

    def series(self, seconds: int = 60, now: float | None = None) -> list[dict]:
        """The last `seconds` whole seconds, oldest first, zero-filled (the current second is still filling)."""
        last = int(now if now is not None else time.time()) - 1
        rows = []
        for second in range(last - seconds + 1, last + 1):
            bucket = self.buckets.get(second, SecondBucket())
            rows.append({"t": second, "tokens_per_s": bucket.tokens, "finished": bucket.finished,
                         "ttft_ms": 1000 * bucket.ttft_sum_s / bucket.ttft_count if bucket.ttft_count else None})
        return rows

    def acceptance_per_position(self) -> list[dict]:
        """Per draft position k: accepted at k / drafted at k (a position counts only in rounds whose block
        reached it), so the bars read as P(token k accepted | drafted)."""
        spec = self.spec
        return [{"position": pos, "drafted": drafted, "accepted": accepted, "rate": rate}
                for pos, (drafted, accepted, rate) in enumerate(zip(
                    spec.num_draft_tokens_per_pos, spec.num_accepted_tokens_per_pos, spec.acceptance_rate_per_pos))]

    def summary(self, seconds: int = 10, now: float | None = None) -> dict:
        """Tokens/s over the last `seconds` whole seconds; TTFT percentiles over the last 200 requests."""
        rows = self.series(seconds, now)

        def pct(q: float) -> float | None:
            value = percentile(self.recent_ttft_s, q)
            return None if value is None else 1000 * value

        return {"tokens_per_s": sum(r["tokens_per_s"] for r in rows) / seconds,
                "ttft_ms_p50": pct(0.5), "ttft_ms_p99": pct(0.99),
                "acceptance_rate": self.spec.acceptance_rate if self.spec.num_draft_tokens else None,
                "mean_acceptance_length": self.spec.mean_acceptance_length if self.spec.num_drafts else None,
                "num_drafts": self.spec.num_drafts,
                # who drafted: the share of drafted rounds a suffix draft made, and of those the tenant's history's
                "suffix_share": self.spec.num_suffix_drafts / self.spec.num_drafts if self.spec.num_drafts else None,
                "history_share": (self.spec.num_history_drafts / self.spec.num_suffix_drafts
                                  if self.spec.num_suffix_drafts else None)}
