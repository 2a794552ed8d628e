"""Verifier capacity from a concurrency bench's levels: the streams each still getting the target."""

from __future__ import annotations

import json

import pytest

from services.bench.capacity import (
    CapacityTarget,
    capacities,
    capacity,
    parse_capacity_target,
    plot_capacity_vs_link,
    write_capacity,
)
from services.bench.concurrency import LevelRow


def row(mode: str, concurrency: int, tpot_ms: float | None, itl_ms: float | None = None) -> LevelRow:
    return LevelRow(mode=mode, concurrency=concurrency, requests=8, tokens=512, wall_s=1.0, tokens_per_s=1.0,
                    ttft_p50_ms=None, ttft_p99_ms=None, itl_p50_ms=itl_ms, itl_p99_ms=None, tpot_p50_ms=tpot_ms,
                    e2e_p50_s=None, acceptance_rate=None, mismatches=0)


def test_targets_parse_and_bad_ones_are_named():
    assert parse_capacity_target("10") == CapacityTarget("rate", 10.0)
    assert parse_capacity_target("12.5tok/s") == CapacityTarget("rate", 12.5)
    assert parse_capacity_target("itl:100") == CapacityTarget("itl", 100.0)
    assert parse_capacity_target("ITL:80ms") == CapacityTarget("itl", 80.0)
    for bad in ("fast", "itl:", "-3", "0"):
        with pytest.raises(ValueError, match=repr(bad)):
            parse_capacity_target(bad)


def test_capacity_is_interpolated_where_the_per_stream_rate_crosses_the_target():
    rate = CapacityTarget("rate", 10.0)
    # 1000 / TPOT: 25, 20, 12.5, 7.5 tok/s per stream at 1, 2, 4, 8 streams
    found = capacity([(1, 25.0), (2, 20.0), (4, 12.5), (8, 7.5)], rate, "stack")
    assert found.met_levels == [1, 2, 4] and found.streams == 6.0 and not found.at_least  # halfway from 4 to 8
    assert capacity([(1, 25.0), (2, 20.0)], rate, "stack").at_least
    assert capacity([(1, 5.0), (2, 4.0)], rate, "stack").streams == 0.0
    # a later level that meets the target again does not count: the first miss ends it
    assert capacity([(1, 25.0), (2, 9.0), (4, 11.0)], rate, "stack").met_levels == [1]


def test_latency_targets_count_down_and_rows_are_read_per_mode(tmp_path):
    rows = [row("stack", 1, 40.0, 40.0), row("stack", 4, 60.0, 90.0), row("stack", 8, 100.0, 130.0),
            row("stack-ar", 1, 70.0, 70.0), row("stack-ar", 4, 80.0, 110.0), row("stack-ar", 8, None, None)]
    by_mode = {found.mode: found for found in capacities(rows, CapacityTarget("itl", 100.0))}
    assert by_mode["stack"].streams == 5.0 and by_mode["stack"].met_levels == [1, 4]
    assert by_mode["stack-ar"].met_levels == [1] and 1 < by_mode["stack-ar"].streams < 4
    by_rate = {found.mode: found for found in capacities(rows, CapacityTarget("rate", 12.0))}
    assert by_rate["stack"].met_levels == [1, 4] and by_rate["stack-ar"].met_levels == [1, 4]
    md, raw = write_capacity(tmp_path, list(by_mode.values()), CapacityTarget("itl", 100.0))
    assert "| stack | 5 | 1, 4 |" in md.read_text() and json.loads(raw.read_text())["target"]["kind"] == "itl"
    plot = plot_capacity_vs_link([("0", {"capacity stack": "5.3", "capacity stack-ar": "2"}),
                                  ("20", {"capacity stack": ">= 8", "capacity stack-ar": "2"})],
                                 CapacityTarget("itl", 100.0), tmp_path / "capacity.png")
    assert plot is not None and plot.stat().st_size > 1000
