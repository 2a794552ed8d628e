"""`mirror-sd bench --overhead` end to end on the tiny random target, one short level: it starts its own stack,
reports every figure for both routes, well formed, and stops what it started. No timing is asserted (the
figures depend on the machine)."""

from __future__ import annotations

import json

import psutil
from typer.testing import CliRunner

from services.bench.overhead_figures import STAGES
from services.cli import app
from tests.integration.conftest import private_cache


def test_the_overhead_bench_reports_both_routes_per_stage_and_profiles(tmp_path, monkeypatch):
    monkeypatch.setenv("MIRROR_SD_CACHE_DIR", str(private_cache(tmp_path)))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{index}", "category": "c", "prompt": text}) + "\n"
                               for index, text in enumerate(["What is the capital of France?", "Name a colour."])))
    children_before = {child.pid for child in psutil.Process().children(recursive=True)}
    out = tmp_path / "overhead"
    result = CliRunner().invoke(app, ["bench", "--overhead", "--levels", "2", "--prompts", str(prompts), "-n", "12",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads((out / "overhead.json").read_text())
    assert data["in_process"]["tokens"] > 0 and data["in_process"]["tpot_p50_ms"] > 0
    assert [(row["route"], row["concurrency"]) for row in data["rows"]] == [("stack-ar", 2), ("stack", 2)]
    for row in data["rows"]:
        assert row["requests"] == 2 and row["tokens"] > 0 and row["mismatches"] == 0
        assert row["tokens_per_s"] > 0 and row["ttft_p50_ms"] > 0 and row["x_in_process"] > 0
        assert row["steps"] > 0 and 1 <= row["rows_per_step"] <= 2
        assert set(row["ms_per_step"]) == {*STAGES, "turn", "other"}
        assert all(value >= 0 for value in row["ms_per_step"].values())
        assert row["ms_per_step"]["forward"] > 0 and row["ms_per_step"]["commit"] > 0  # the stages were timed
        assert row["ms_per_step"]["turn"] >= row["ms_per_step"]["forward"] + row["ms_per_step"]["commit"]
        assert set(row["cpu_us_per_token"]) == {"gateway", "verify-worker", "bench client"}
        assert all(value is not None and value >= 0 for value in row["cpu_us_per_token"].values())
    routes = {row["route"]: row for row in data["rows"]}
    assert routes["stack"]["acceptance_rate"] == 1.0 and routes["stack-ar"]["acceptance_rate"] is None
    profiles = data["profiles"]
    assert profiles["tool"] == "py-spy", profiles["note"]  # root here, and CI: py-spy can read the stack
    assert set(profiles["files"]) == {f"{route} {name}" for route in ("stack-ar", "stack")
                                      for name in ("gateway", "verify-worker")}
    verify = (out / "profiles" / "stack-c2-verify-worker.folded").read_text()
    assert "VerifyWorker.turn" in verify  # the worker's own loop, sampled
    report = (out / "overhead.md").read_text()
    assert "| stack-ar | 2 |" in report and "| stack | 2 |" in report and "SYNTHETIC" in report
    assert (out / "logs" / "verify-worker.log").is_file()
    left = {child.pid for child in psutil.Process().children(recursive=True)} - children_before
    assert not [pid for pid in left if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
