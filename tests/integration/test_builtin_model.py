"""The real built-in target (SmolLM2-135M-Instruct): greedy SD is token-for-token target-only."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from services.engine import GenerationOptions, generate
from services.models.drafters import load_draft_source
from services.models.tokenization import encode_prompt

pytestmark = pytest.mark.slow

OPTIONS = GenerationOptions(max_new_tokens=32)


def pick_prompts(dev_prompts: list[dict]) -> list[dict]:
    """Three open prompts and three grounded ones, short enough to keep the suite fast."""
    open_prompts = [p for p in dev_prompts if p["context_chars"] == 0][:3]
    grounded = sorted((p for p in dev_prompts if p["context_chars"] > 0), key=lambda p: len(p["prompt"]))[:3]
    return open_prompts + grounded


@pytest.fixture(scope="module")
def draft_sources(builtin_target):
    return {spec: load_draft_source(spec, builtin_target) for spec in ("none", "ngram", "int8", "default")}


def test_greedy_sd_matches_target_only_on_dev_prompts(builtin_target, draft_sources, dev_prompts):
    accepted = {"ngram": 0, "int8": 0, "default": 0}
    for record in pick_prompts(dev_prompts):
        prompt_ids = encode_prompt(builtin_target.tokenizer, record["prompt"], chat=True)
        expected = generate(builtin_target, draft_sources["none"], prompt_ids, OPTIONS)
        assert expected.num_tokens > 0
        for spec in accepted:
            result = generate(builtin_target, draft_sources[spec], prompt_ids, OPTIONS)
            assert result.token_ids == expected.token_ids, f"{spec} differs on {record['id']}"
            assert result.text == expected.text
            accepted[spec] += result.stats.num_accepted_tokens
    # The drafts did real work: tokens were accepted, not only recovered.
    assert accepted["int8"] > 0 and accepted["ngram"] > 0 and accepted["default"] > 0


def test_stop_string_cuts_text(builtin_target, draft_sources):
    prompt_ids = encode_prompt(builtin_target.tokenizer, "Count from 1 to 20, separated by commas.", chat=True)
    free = generate(builtin_target, draft_sources["ngram"], prompt_ids, GenerationOptions(max_new_tokens=40))
    assert "7" in free.text
    stopped = generate(
        builtin_target, draft_sources["ngram"], prompt_ids, GenerationOptions(max_new_tokens=40, stop=["7"])
    )
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index("7")]
    assert stopped.num_tokens < free.num_tokens


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MIRROR_SD_NUM_THREADS": "2"}
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_cli_sd_and_ar_give_the_same_greedy_text(builtin_target):
    prompt = "Explain in two sentences why the sky is blue."
    outputs = {}
    for mode in ("sd", "ar"):
        completed = run_cli("generate", "--prompt", prompt, "--chat", "-n", "24", "--mode", mode, "--json")
        assert completed.returncode == 0, completed.stderr
        outputs[mode] = json.loads(completed.stdout)
    assert outputs["sd"]["text"] == outputs["ar"]["text"]
    assert outputs["sd"]["token_ids"] == outputs["ar"]["token_ids"]
    assert outputs["ar"]["stats"]["num_drafts"] == 0
    assert set(outputs["sd"]["stats"]) >= {"acceptance_rate", "mean_acceptance_length", "num_target_calls"}
    assert outputs["sd"]["tokens_per_s"] > 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--temperature", "-1"], "temperature must be >= 0, got -1.0"),
        (["--temperature", "1", "--top-p", "0"], "top_p must be in (0, 1], got 0.0"),
        (["--temperature", "1", "--top-p", "1.5"], "top_p must be in (0, 1], got 1.5"),
        (["--gamma", "0"], "--gamma input should be greater than or equal to 1, got 0"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be in 1..4096, got 0"),
        (["--target", "nobody/nothing"], "model 'nobody/nothing' not found"),
    ],
)
def test_cli_bad_parameters(args, message):
    completed = run_cli("generate", "--prompt", "hi", *args)
    assert completed.returncode == 2
    assert message in completed.stderr


def test_cli_prompt_over_context_is_refused():
    completed = run_cli("generate", "--prompt", "word " * 9000, "-n", "4")
    assert completed.returncode == 2
    assert "does not fit" in completed.stderr and "8192" in completed.stderr
