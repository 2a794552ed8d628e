"""`mirror-sd bench --overhead`'s figures (services/bench/overhead_figures.py) and its report, from known inputs;
the verify worker's stage timer (verify_worker/figures.py StageTimes)."""

from __future__ import annotations

import json
import time
from dataclasses import fields
from types import SimpleNamespace

import pytest

from services.bench.concurrency import LevelRow
from services.bench.overhead import OverheadConfig, OverheadRow, Profiles
from services.bench.overhead_figures import (
    STAGES,
    cpu_us_per_token,
    deltas,
    in_process,
    step_split,
    top_functions,
    top_text,
    x_in_process,
)
from services.bench.overhead_report import STEP_COLUMNS, _cell, meta, write_json, write_markdown
from services.bench.prompts import BenchPrompt
from verify_worker.figures import StageTimes, WorkerFigures


def test_the_bench_reads_every_stage_the_worker_times():
    timed = {f.name.removesuffix("_s") for f in fields(StageTimes)} - {"turns", "turn"}
    assert set(STAGES) == timed
    assert set(STEP_COLUMNS) == {*STAGES, "turn", "other"}
    assert "stage_times" in WorkerFigures().heartbeat_fields()


def test_a_stage_timer_adds_the_time_since_its_start_and_returns_now():
    stages = StageTimes()
    started = time.perf_counter() - 0.25
    now = stages.since("commit", started)
    assert now >= started + 0.25
    assert stages.commit_s == pytest.approx(now - started)
    stages.since("commit", now - 0.5)
    assert stages.commit_s >= 0.75 and stages.intake_s == 0.0


def test_in_process_figures_are_medians_over_prompts():
    results = [SimpleNamespace(token_ids=[1] * 11, ttft_s=0.01, total_s=0.01 + 10 * 0.002),  # 2 ms a token
               SimpleNamespace(token_ids=[1] * 5, ttft_s=0.02, total_s=0.02 + 4 * 0.004),  # 4 ms
               SimpleNamespace(token_ids=[1] * 3, ttft_s=0.03, total_s=0.03 + 2 * 0.003)]  # 3 ms
    floor = in_process(results)
    assert floor.tokens == 19 and floor.num_prompts == 3
    assert floor.tpot_p50_ms == pytest.approx(3.0)
    assert floor.ttft_p50_ms == pytest.approx(20.0)
    assert floor.tokens_per_s == pytest.approx(19 / (0.03 + 0.036 + 0.036), abs=0.1)
    assert x_in_process(6.0, floor) == 2.0 and x_in_process(None, floor) is None


def test_a_level_splits_into_ms_per_step_and_us_per_row():
    before = {"turns": 5, "turn_s": 1.0, **{f"{stage}_s": 0.1 for stage in STAGES}}
    after = {"turns": 15, "turn_s": 1.2, **{f"{stage}_s": 0.1 for stage in STAGES},
             "wait_s": 0.15, "forward_s": 0.12, "commit_s": 0.11, "intake_s": 0.104}
    split = step_split(deltas(before, after), deltas({"steps": 2, "rows": 4}, {"steps": 12, "rows": 44}))
    assert (split.steps, split.rows, split.turns, split.rows_per_step) == (10, 40, 10, 4.0)
    assert split.ms_per_step["turn"] == pytest.approx(20.0)
    assert split.ms_per_step["wait"] == pytest.approx(5.0) and split.ms_per_step["forward"] == pytest.approx(2.0)
    assert split.ms_per_step["commit"] == pytest.approx(1.0) and split.ms_per_step["intake"] == pytest.approx(0.4)
    assert split.ms_per_step["other"] == pytest.approx(20 - 5 - 2 - 1 - 0.4)  # turn less every stage
    assert split.machinery_ms == pytest.approx(20 - 2 - 5)
    assert split.us_per_row["commit"] == pytest.approx(250.0)  # 10 ms over 40 rows


def test_a_level_without_steps_has_no_split():
    split = step_split({"turns": 3, "turn_s": 1.0, "wait_s": 1.0}, {"steps": 0, "rows": 0})
    assert split.ms_per_step == {} and split.rows_per_step is None and split.machinery_ms is None


def test_cpu_per_token_in_microseconds():
    assert cpu_us_per_token(0.5, 1000) == 500.0
    assert cpu_us_per_token(0.5, 0) is None


def test_folded_stacks_rank_functions_by_their_own_samples():
    folded = ["main (a.py:1);loop (a.py:5);forward (m.py:9) 60",
              "main (a.py:1);loop (a.py:5);commit (r.py:3) 30",
              "main (a.py:1);loop (a.py:5) 10",
              "a malformed line",
              "main (a.py:1);loop (a.py:5);forward (m.py:9);forward (m.py:9) 0"]
    samples, rows = top_functions(folded)
    assert samples == 100
    assert rows[0] == ("forward (m.py:9)", 0.6, 0.6)
    assert rows[1] == ("commit (r.py:3)", 0.3, 0.3)
    assert rows[2] == ("loop (a.py:5)", 0.1, 1.0)  # 10 of its own, all 100 under it
    assert "forward (m.py:9)" in top_text("verify", folded) and top_functions([]) == (0, [])


def test_cells_never_use_exponents():
    assert (_cell(4375.0), _cell(337.4), _cell(36.61), _cell(0.06141), _cell(None), _cell(3)) == \
        ("4375", "337", "36.6", "0.0614", "–", "3")


def _row(route: str, concurrency: int) -> OverheadRow:
    level = LevelRow(mode=route, concurrency=concurrency, requests=2, tokens=32, wall_s=0.1, tokens_per_s=320.0,
                     ttft_p50_ms=20.0, ttft_p99_ms=30.0, itl_p50_ms=2.0, itl_p99_ms=4.0, tpot_p50_ms=2.5,
                     e2e_p50_s=0.05, acceptance_rate=None, mismatches=0)
    split = step_split({"turns": 10, "turn_s": 0.1, **{f"{stage}_s": 0.001 for stage in STAGES}},
                       {"steps": 10, "rows": 20})
    return OverheadRow(route, concurrency, level, split, {"gateway": 900.0, "verify-worker": 3000.0,
                                                          "bench client": 800.0}, 4.0)


def test_the_report_has_one_line_per_level_and_route_and_every_stage(tmp_path):
    floor = in_process([SimpleNamespace(token_ids=[1] * 9, ttft_s=0.01, total_s=0.015)])
    rows = [_row("stack-ar", 1), _row("stack", 1)]
    config = OverheadConfig(levels=[1], prompts=[BenchPrompt(id="p", category="c", prompt="x")], max_tokens=16)
    info = meta(config, threads=2)
    profiles = Profiles(tool="py-spy", level=1, files={"stack verify-worker": ["profiles/a.folded"]},
                        tops={"stack verify-worker": "stack: 10 samples\n"})
    data = json.loads(write_json(tmp_path / "o.json", info, floor, rows, profiles).read_text())
    assert [(row["route"], row["concurrency"]) for row in data["rows"]] == [("stack-ar", 1), ("stack", 1)]
    assert set(data["rows"][0]["ms_per_step"]) == {*STAGES, "turn", "other"}
    assert data["in_process"]["tpot_p50_ms"] == pytest.approx(0.625) and data["meta"]["target"] == "random:tiny"
    text = write_markdown(tmp_path / "o.md", info, floor, rows, profiles).read_text()
    tables = [line for line in text.splitlines() if line.startswith("|")]
    assert len(tables) == 3 * (2 + len(rows))  # three tables: header, rule, one line per row
    for start in range(0, len(tables), 2 + len(rows)):  # every line of a table as wide as its header
        assert len({line.count("|") for line in tables[start:start + 2 + len(rows)]}) == 1
    assert "[a.folded](profiles/a.folded)" in text and "SYNTHETIC" in text
    assert "No profile: py-spy is not installed" in write_markdown(
        tmp_path / "n.md", info, floor, rows, Profiles(tool="none", level=None,
                                                       note="py-spy is not installed")).read_text()


@pytest.mark.parametrize(("args", "message"), [
    (["--levels", "1,8"], "--levels is for --overhead"),
    (["--overhead", "--levels", "0,8"], "--levels '0,8': every level must be >= 1"),
    (["--overhead", "--levels", "one"], "--levels 'one': use a comma list of integers"),
    (["--overhead", "--concurrency", "1,8"], "--overhead starts a stack of its own"),
])
def test_bad_overhead_options_are_refused_naming_the_option(args, message):
    from typer.testing import CliRunner

    from services.cli import app

    result = CliRunner().invoke(app, ["bench", *args, "--out", "/nonexistent/never-written"])
    assert result.exit_code == 2, result.output
    assert message in result.output
