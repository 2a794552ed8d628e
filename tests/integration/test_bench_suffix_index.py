"""`mirror-sd bench --suffix-index` end to end at a tiny size, on the repository's prompt sets and the built-in
tokenizer: every figure of every implementation that imports here, the report well formed, our index's memory
the same after each step of the flood. No timing is asserted (the figures depend on the machine)."""

from __future__ import annotations

import json

import psutil
from typer.testing import CliRunner

from services.bench.suffix_index import ARCTIC, OURS, arctic_available
from services.cli import app


def test_the_suffix_index_bench_reports_every_figure_and_a_flood_that_leaves_our_memory_fixed(tmp_path):
    children_before = {child.pid for child in psutil.Process().children(recursive=True)}
    out = tmp_path / "suffix"
    result = CliRunner().invoke(app, ["bench", "--suffix-index", "--index-tokens", "2000", "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads((out / "suffix_index.json").read_text())
    names = [OURS, *([ARCTIC] if arctic_available() else [])]
    assert [(row["implementation"], row["index_tokens"]) for row in data["rows"]] == [(name, 2000) for name in names]
    assert data["meta"]["corpus"]["documents"] > 100 and data["meta"]["corpus"]["held_out_documents"] > 0
    for row in data["rows"]:
        assert 1999 <= row["num_tokens"] + row["num_documents"] <= 2000  # each document and its separator
        assert row["build_s"] > 0 and row["build_us_per_token"] > 0 and row["memory_bytes"] > 0
        for kind in ("seen", "unseen"):
            lookups = row[kind]
            assert lookups["calls"] == data["meta"]["lookups"]
            assert 0 < lookups["p50_us"] <= lookups["p99_us"] and 0 < lookups["cpu_p50_us"] <= lookups["cpu_p99_us"]
            assert 0 <= lookups["mean_draft_tokens"] <= data["meta"]["settings"]["max_draft_tokens"]
        assert row["seen"]["drafted_share"] > 0.5  # contexts from the indexed text find their continuation
        assert row["seen"]["mean_match_length"] > row["unseen"]["mean_match_length"]
        assert [step["times_size"] for step in row["flood"]] == [1, 2, 3, 4, 5]
    ours = data["rows"][0]
    assert {step["memory_bytes"] for step in ours["flood"]} == {ours["memory_bytes"]}
    assert data["goal"]["index_tokens"] == 2000 and data["goal"]["memory_fixed"] is True
    assert data["goal"]["at_goal_size"] is False
    report = (out / "suffix_index.md").read_text()
    table = [line for line in report.splitlines() if line.startswith("|")]
    assert len(table) == 2 * (2 + len(names))  # two tables: header, rule, a line per row
    assert len({line.count("|") for line in table[:2 + len(names)]}) == 1
    assert len({line.count("|") for line in table[2 + len(names):]}) == 1
    assert "| ours | 2,000 |" in report and "memory under the flood: fixed" in report
    assert ("not importable here" in report) != arctic_available()
    left = {child.pid for child in psutil.Process().children(recursive=True)} - children_before
    assert not [pid for pid in left if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
