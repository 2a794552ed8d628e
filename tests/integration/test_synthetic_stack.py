"""A stack serving a random-weight target with a synthetic draft (docs/synthetic.md): the same weights in
every process, greedy output through the stack equal to target-only decoding, and labelled synthetic
wherever it reports (bench files, /v1/models, request stats)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import httpx
import torch
from typer.testing import CliRunner

from services.cli import app
from services.models.loading import load_model
from tests.conftest import REPO_ROOT
from tests.integration.stack import Stack

WEIGHTS_DIGEST = """
import hashlib, sys, torch
from services.models.loading import load_model
model = load_model(sys.argv[1]).model
digest = hashlib.sha256()
for name, tensor in sorted(model.state_dict().items()):
    digest.update(name.encode()); digest.update(tensor.contiguous().numpy().tobytes())
print(digest.hexdigest())
"""


def _digest(spec: str) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(load_model(spec).model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()


def test_random_weights_depend_on_the_shape_and_seed_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    here = _digest("random:tiny")
    assert torch.rand(1) == before  # the caller's RNG is left as it was
    torch.manual_seed(999)  # whatever the caller's RNG state
    assert _digest("random:tiny") == here
    assert _digest("random:tiny:1") != here
    child = subprocess.run([sys.executable, "-c", WEIGHTS_DIGEST, "random:tiny"], cwd=REPO_ROOT, text=True,
                           capture_output=True, timeout=120, env={"MIRROR_SD_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == here  # another process builds the same weights


def test_a_synthetic_stack_is_lossless_and_labelled(tmp_path):
    stack = Stack(tmp_path, verify_workers=1, auth=False, env={
        "MIRROR_SD_TARGET": "random:tiny", "MIRROR_SD_DRAFT": "synthetic:0.8@2ms",
        "MIRROR_SD_CACHE_DIR": str(tmp_path / "cache"), "MIRROR_SD_SCHEDULER__MAX_BATCH_SIZE": "4",
        # this test checks that the synthetic draft's blocks are accepted, so they must be drafted: a tiny random
        # target's step (about 2 ms) is as short as a local Redis round trip, so the cost policy learns (in the
        # bench's warm-up of a level, say) that the link makes drafting lose, and the verify worker's word on its
        # load may turn it plain at a load, at random; the acceptance rule drafts while blocks are accepted
        "MIRROR_SD_SPECULATIVE__BLOCK_POLICY": "acceptance", "MIRROR_SD_WORKER__LOAD_WORD": "false"}).start()
    try:
        models = httpx.get(f"{stack.base_url}/v1/models", timeout=5).json()["data"][0]
        assert models["id"] == "random:tiny" and models["mirror_sd_synthetic"]["synthetic"] is True
        assert "chosen, not earned" in models["mirror_sd_synthetic"]["draft"]
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"id": f"p{index}", "category": "c", "prompt": text}) + "\n"
                                   for index, text in enumerate(["What is the capital of France?",
                                                                 "Name three colours."]))
                           + json.dumps({"id": "chat", "category": "c",  # a conversation: its chat through HTTP
                                         "turns": ["Name a river.", "Now shorten your answer."]}) + "\n")
        out = tmp_path / "bench"
        result = CliRunner().invoke(app, [
            "bench", "--target", "random:tiny", "--prompts", str(prompts), "--modes", "ar,stack", "-n", "24",
            "--threads", "1", "--no-progress", "--url", stack.base_url, "--redis-url", stack.redis_url,
            "--out", str(out)])
        assert result.exit_code == 0, result.output
        assert "MISMATCH" not in result.output
        data = json.loads((out / "results.json").read_text())
        ar = {run["id"]: run["token_ids"] for run in data["runs"] if run["mode"] == "ar"}
        stacked = {run["id"]: run["token_ids"] for run in data["runs"] if run["mode"] == "stack"}
        assert stacked == ar and all(ar.values())  # greedy through the stack == target-only, token for token
        assert "chat/turn2" in ar  # the stack's turn 2 carried its own answer: the same chat ar built, so the
        turn2 = next(run for run in data["runs"] if run["mode"] == "stack" and run["id"] == "chat/turn2")
        assert turn2["stats"]["num_accepted_tokens"] > 0  # same prompt ids, and ar's published reference applied
        rows = {(row["mode"], row["scope"]): row for row in data["aggregates"]}
        assert rows[("stack", "all")]["synthetic"] and rows[("ar", "all")]["synthetic"]  # random weights
        assert rows[("stack", "all")]["acceptance_rate"] > 0  # the draft found the published references
        assert "chosen, not earned" in data["meta"]["synthetic"]["stack"]["draft"]
        assert "random weights" in data["meta"]["synthetic"]["ar"]["target"]
        report = (out / "results.md").read_text()
        assert "stack: SYNTHETIC" in report and "stack (synthetic)" in report
        # a prompt no bench published: labelled, lossless, decoded target-only (its draft proposes nothing)
        answer = httpx.post(f"{stack.base_url}/v1/completions", timeout=60, json={
            "model": "random:tiny", "prompt": "unpublished", "max_tokens": 8, "temperature": 0}).json()
        assert answer["mirror_sd"]["synthetic"]["synthetic"] is True
        assert answer["mirror_sd"]["num_draft_tokens"] == 0
        # a concurrency bench over prompts of its own publishes their references too: its drafts accept
        others = tmp_path / "others.jsonl"
        others.write_text("".join(json.dumps({"id": f"q{index}", "category": "c", "prompt": text}) + "\n"
                                  for index, text in enumerate(["Describe the sea.", "Count to five."])))
        result = CliRunner().invoke(app, [
            "bench", "--target", "random:tiny", "--prompts", str(others), "--concurrency", "2", "--modes", "stack",
            "-n", "16", "--threads", "1", "--url", stack.base_url, "--redis-url", stack.redis_url,
            "--out", str(tmp_path / "levels")])
        assert result.exit_code == 0, result.output
        levels = json.loads((tmp_path / "levels" / "concurrency.json").read_text())
        assert levels["rows"][0]["acceptance_rate"] > 0 and levels["rows"][0]["mismatches"] == 0
        assert "chosen, not earned" in levels["meta"]["synthetic"]["draft"]
        assert "stack: SYNTHETIC" in (tmp_path / "levels" / "concurrency.md").read_text()
    finally:
        stack.stop()
