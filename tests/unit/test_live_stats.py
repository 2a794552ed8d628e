"""The gateway's per-second figures for the dashboard: windows, zero-filling, acceptance per position."""

from __future__ import annotations

from gateway.observability.live_stats import LiveStats
from services.speculative.stats import SpecDecodingStats


def test_series_is_per_second_zero_filled_and_forgets_old_seconds():
    live = LiveStats(window_s=5)
    live.add_tokens(4, now=100.2)
    live.add_tokens(6, now=100.9)
    live.observe_finished(ttft_s=0.1, stats=None, now=100.5)
    live.observe_finished(ttft_s=0.3, stats=None, now=100.6)
    live.add_tokens(5, now=102.0)
    rows = live.series(3, now=103.4)  # seconds 100, 101, 102 (103 is still filling)
    assert [r["t"] for r in rows] == [100, 101, 102]
    assert [r["tokens_per_s"] for r in rows] == [10, 0, 5]
    assert rows[0]["finished"] == 2 and abs(rows[0]["ttft_ms"] - 200.0) < 1e-9 and rows[1]["ttft_ms"] is None
    live.add_tokens(1, now=106.0)  # second 100 and 101 are now outside the 5 s window
    assert 100 not in live.buckets and 101 not in live.buckets and 102 in live.buckets
    assert live.summary(seconds=5, now=107.0)["tokens_per_s"] == (5 + 1) / 5


def test_acceptance_per_position_counts_only_rounds_that_reached_the_position():
    live = LiveStats()
    first, second = SpecDecodingStats(), SpecDecodingStats()
    first.observe(4, 4)  # all four accepted
    second.observe(2, 1)  # a shorter block: positions 3 and 4 not drafted
    second.observe(0, 0)  # a target-only round drafts nothing
    live.observe_finished(ttft_s=None, stats=first)
    live.observe_finished(ttft_s=None, stats=second)
    rates = [(p["position"], p["drafted"], p["accepted"], p["rate"]) for p in live.acceptance_per_position()]
    assert rates == [(0, 2, 2, 1.0), (1, 2, 1, 0.5), (2, 1, 1, 1.0), (3, 1, 1, 1.0)]
    summary = live.summary()
    assert summary["acceptance_rate"] == 5 / 6 and summary["num_drafts"] == 2 and summary["ttft_ms_p50"] is None
