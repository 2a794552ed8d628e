"""`mirror-sd bench` end to end on tiny models: every in-process mode, greedy checks, files (no timing asserts)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from services.cli import app
from tests.conftest import WORDS, save_tiny_model


@pytest.fixture(scope="module")
def bench_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    target = save_tiny_model(root / "target", seed=0, words=WORDS)
    draft = save_tiny_model(root / "draft", seed=1, words=WORDS)
    prompts = root / "question.jsonl"  # Spec-Bench's format
    lines = [{"question_id": 1, "category": "repeat", "turns": [" ".join(f"w{i % 7 + 2}" for i in range(30))]},
             {"question_id": 2, "category": "words", "turns": ["w3 w9 w4 w20 w11"]},
             {"question_id": 3, "category": "words", "turns": ["w5 w5 w6 w30"]}]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return root, target, draft, prompts


def test_bench_runs_every_mode_and_checks_greedy_equality(bench_setup):
    root, target, draft, prompts = bench_setup
    out = root / "out"
    modes = f"ar,sd:ngram,sd:synthetic:0.8,sd:{draft},hf-lookup:3,hf-assisted:{draft}"
    result = CliRunner().invoke(app, ["bench", "--target", str(target), "--prompts", str(prompts), "--modes", modes,
                                      "-n", "16", "--no-chat", "--no-progress", "--threads", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "MISMATCH" not in result.output
    data = json.loads((out / "results.json").read_text())
    runs = data["runs"]
    reference = {run["id"]: run["token_ids"] for run in runs if run["mode"] == "ar"}
    assert len(reference) == 3 and all(len(ids) > 0 for ids in reference.values())
    for run in runs:  # every mode, ours and the peers, reproduces target-only greedy decoding
        assert run["token_ids"] == reference[run["id"]], (run["mode"], run["id"])
        if run["mode"] != "ar":
            assert run["matches_ar"] is True and run["rouge_l"] == pytest.approx(1.0)
    rows = {(row["mode"], row["scope"]): row for row in data["aggregates"]}
    assert {scope for mode, scope in rows if mode == "ar"} == {"all", "group:open", "category:repeat",
                                                                "category:words"}
    synthetic = rows[("sd:synthetic:0.8", "all")]
    assert synthetic["synthetic"] and synthetic["acceptance_rate"] > 0.3 and synthetic["leviathan_bound"] > 1
    assert rows[("sd:ngram", "category:repeat")]["acceptance_rate"] > 0
    assert rows[(f"sd:{draft}", "all")]["cost_ratio"] > 0
    assert len(rows[(f"sd:{draft}", "all")]["acceptance_rate_per_pos"]) >= 1
    assert "(synthetic)" in (out / "results.md").read_text()
    for plot in ("speedup_per_category.png", "acceptance_per_position.png"):
        assert (out / plot).read_bytes()[:4] == b"\x89PNG"


def test_bench_refuses_bad_modes_by_name(bench_setup):
    _, target, _, prompts = bench_setup
    result = CliRunner().invoke(app, ["bench", "--target", str(target), "--prompts", str(prompts),
                                      "--modes", "ar,turbo"])
    assert result.exit_code != 0 and "unknown mode 'turbo'" in result.output
    result = CliRunner().invoke(app, ["bench", "--target", str(target), "--prompts", str(prompts),
                                      "--modes", "ar,hf-assisted:ngram", "--no-progress", "--no-chat", "-n", "4"])
    assert result.exit_code != 0 and "needs a model draft" in result.output


def test_sampled_bench_scores_rouge_instead_of_failing(bench_setup):
    root, target, _, prompts = bench_setup
    out = root / "sampled"
    result = CliRunner().invoke(app, ["bench", "--target", str(target), "--prompts", str(prompts), "--modes",
                                      "ar,sd:ngram,hf-lookup", "-n", "12", "--temperature", "1.0", "--seed", "3",
                                      "--no-chat", "--no-progress", "--out", str(out)])
    assert result.exit_code == 0, result.output
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert all(run["matches_ar"] is None for run in runs)  # no greedy check when sampling
    assert all(0.0 <= run["rouge_l"] <= 1.0 for run in runs if run["mode"] != "ar")


def test_cost_policy_bench_stays_lossless(bench_setup):
    root, target, draft, prompts = bench_setup
    out = root / "cost"
    result = CliRunner().invoke(app, ["bench", "--target", str(target), "--prompts", str(prompts), "--modes",
                                      f"ar,sd:ngram,sd:{draft}", "-n", "16", "--block-policy", "cost", "--no-chat",
                                      "--no-progress", "--threads", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["block_policy"] == "cost"
    assert all(run["matches_ar"] for run in data["runs"] if run["mode"] != "ar")
    bad = CliRunner().invoke(app, ["bench", "--target", str(target), "--prompts", str(prompts),
                                   "--block-policy", "fastest"])
    assert bad.exit_code != 0 and "'fastest'" in bad.output
