"""`mirror-sd distill` on a tiny target: trains, is reproducible and resumable, and the draft is lossless."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file
from typer.testing import CliRunner

from services.cli import app
from services.engine import GenerationOptions, generate
from services.models.drafters import load_draft_source
from services.models.loading import load_model
from tests.conftest import WORDS, save_tiny_model

ARGS = ["--num-prompts", "12", "--samples-per-prompt", "2", "-n", "12", "--generate-batch-size", "4",
        "--steps", "30", "--batch-size", "4", "--keep-tokens", "40", "--layers", "1", "--init-layers", "-1",
        "--no-chat", "--no-progress", "--threads", "1"]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("distill") / "target", seed=0, words=WORDS)


def distill(target_dir, out, *extra):
    result = CliRunner().invoke(app, ["distill", "--target", str(target_dir), "--out", str(out), *ARGS, *extra])
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def straight(target_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    distill(target_dir, out)
    return out


def test_distill_trains_and_records_its_recipe(straight):
    report = json.loads((straight / "recipe.json").read_text())
    assert report["recipe"]["seed"] == 0 and report["recipe"]["steps"] == 30
    assert report["corpus"]["records"] == 24 and report["corpus"]["heldout_records"] == 2 * 1  # prompt 0 (of 12)
    assert report["keep"]["tokens"] <= 40 and 0 < report["keep"]["top1_coverage"] <= 1
    curve = report["curve"]
    assert curve[-1]["step"] == 30 and curve[-1]["loss"] < curve[0]["loss"]  # it learned something
    stored = load_file(str(straight / "draft.safetensors"))
    assert stored and not any("embed_tokens" in name for name in stored)  # the target's embeddings stay out


def test_paused_and_resumed_run_equals_an_unbroken_one(target_dir, straight, tmp_path):
    out = tmp_path / "resumed"
    paused = distill(target_dir, out, "--pause-after", "12")
    assert "paused at step 12 of 30" in paused.output
    (out / "corpus" / "shard-00001.jsonl").unlink()  # the corpus resumes too: one shard regenerated
    distill(target_dir, out)
    assert (out / "corpus" / "shard-00001.jsonl").read_bytes() == (straight / "corpus" / "shard-00001.jsonl").read_bytes()
    ours, theirs = load_file(str(out / "draft.safetensors")), load_file(str(straight / "draft.safetensors"))
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert ours[name].equal(theirs[name]), name


def test_the_distilled_draft_is_lossless(target_dir, straight):
    target = load_model(str(target_dir))
    source = load_draft_source(str(straight), target)
    plain = load_draft_source("none", target)
    options = GenerationOptions(max_new_tokens=24, ignore_eos=True)
    for prompt in ([3, 4, 5, 6], [9, 9, 20, 31, 7]):
        drafted = generate(target, source, prompt, options)
        assert drafted.token_ids == generate(target, plain, prompt, options).token_ids
        assert drafted.stats.num_draft_tokens > 0


def test_bad_values_are_named(target_dir, tmp_path):
    result = CliRunner().invoke(app, ["distill", "--target", str(target_dir), "--out", str(tmp_path),
                                      "--init-layers", "first"])
    assert result.exit_code != 0 and "--init-layers 'first'" in result.output
    result = CliRunner().invoke(app, ["distill", "--target", str(target_dir), "--out", str(tmp_path),
                                      "--precision", "fp8"])
    assert result.exit_code != 0 and "'fp8'" in result.output
