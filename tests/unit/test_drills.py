"""The pure parts of the operator drills: how the chaos drill classifies an answer, the burst's quantiles."""

from __future__ import annotations

from services.drills.burst import BurstReport, quantiles
from services.drills.chaos import Outcome, classify


def test_chaos_classification():
    reference = [5, 6, 7]
    assert classify(reference, Outcome("p", [5, 6, 7])) == "identical"
    assert classify(reference, Outcome("p", None, "stream ended without [DONE]")) == "lost"
    assert classify(reference, Outcome("p", [5, 6, 6, 7])) == "doubled"  # a round streamed twice
    assert classify(reference, Outcome("p", [5, 7])) == "mismatched"  # a gap
    assert classify(None, Outcome("p", [1])) == "mismatched"


def test_burst_quantiles_and_verdict():
    assert quantiles([]) == {"p50": None, "p99": None, "max": None}
    values = [float(v) for v in range(1, 101)]
    assert quantiles(values) == {"p50": 51.0, "p99": 100.0, "max": 100.0}
    fine = BurstReport(requests=3, statuses={"200": 1, "503": 2}, reject_ms={}, ok_ms={})
    assert fine.only_expected
    assert not BurstReport(requests=1, statuses={"500": 1}, reject_ms={}, ok_ms={}).only_expected
    assert not BurstReport(requests=1, statuses={"503": 1}, reject_ms={}, ok_ms={}, missing_retry_after=1).only_expected
