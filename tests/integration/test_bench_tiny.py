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
    root, target, _, prompts = bench_setup
    out = root / "bad"
    result = CliRunner().invoke(app, ["bench", "--target", str(target), "--prompts", str(prompts),
                                      "--modes", "ar,turbo", "--out", str(out)])
    assert result.exit_code != 0 and "unknown mode 'turbo'" in result.output
    result = CliRunner().invoke(app, ["bench", "--target", str(target), "--prompts", str(prompts), "--out", str(out),
                                      "--modes", "ar,hf-assisted:ngram", "--no-progress", "--no-chat", "-n", "4"])
    assert result.exit_code != 0 and "needs a model draft" in result.output
    assert not out.exists()  # refused before anything was written


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


def _journal(out) -> list[dict]:
    return [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()[1:]]


def test_an_interrupted_bench_resumes_from_its_journal(bench_setup):
    root, target, _, prompts = bench_setup
    out = root / "resumed"
    common = ["bench", "--target", str(target), "--prompts", str(prompts), "-n", "10", "--no-chat", "--no-progress",
              "--threads", "1", "--out", str(out)]
    first = CliRunner().invoke(app, [*common, "--modes", "ar", "--limit", "2"])
    assert first.exit_code == 0, first.output
    ar_runs = {run["prompt_id"]: run["result"] for run in _journal(out)}
    assert sorted(ar_runs) == ["1", "2"]
    with (out / "runs.jsonl").open("a") as handle:  # the interruption cut the last line short
        handle.write('{"mode": "ar", "prompt_id": "3", "resu')
    second = CliRunner().invoke(app, [*common, "--modes", "ar,sd:ngram", "--resume"])
    assert second.exit_code == 0, second.output
    journal = _journal(out)
    assert [(run["mode"], run["prompt_id"]) for run in journal] == [  # only what was missing, prompt by prompt
        ("ar", "1"), ("ar", "2"), ("sd:ngram", "1"), ("sd:ngram", "2"), ("ar", "3"), ("sd:ngram", "3")]
    runs = json.loads((out / "results.json").read_text())["runs"]
    for run in runs:  # journalled runs come back as they were: same tokens, same timings
        if run["mode"] == "ar" and run["id"] in ar_runs:
            assert run["token_ids"] == ar_runs[run["id"]]["token_ids"]
            assert run["total_s"] == ar_runs[run["id"]]["total_s"]
        assert run["matches_ar"] in (None, True)
    partial = CliRunner().invoke(app, [*common, "--modes", "ar,hf-lookup:3", "--report-only"])
    assert partial.exit_code != 0 and "holds no prompt in every mode" in partial.output  # and it ran nothing
    assert len(_journal(out)) == 6
    report = CliRunner().invoke(app, [*common, "--modes", "sd:ngram,ar", "--report-only", "--limit", "2"])
    assert report.exit_code == 0, report.output
    assert sorted(run["id"] for run in json.loads((out / "results.json").read_text())["runs"]) == ["1", "1", "2", "2"]
    assert len(_journal(out)) == 6
    other = root / "other.jsonl"  # another prompt under an id the journal holds: run, not reused
    other.write_text(json.dumps({"question_id": 1, "category": "words", "turns": ["w9 w8 w7"]}) + "\n")
    changed = CliRunner().invoke(app, [*common[:4], str(other), *common[5:], "--modes", "ar", "--resume"])
    assert changed.exit_code == 0, changed.output
    assert [(run["mode"], run["prompt_id"]) for run in _journal(out)][6:] == [("ar", "1")]
    bad_mode = CliRunner().invoke(app, [*common, "--modes", "ar,hf-assisted:ngram", "--fresh"])
    assert bad_mode.exit_code != 0 and len(_journal(out)) == 7  # a refused run replaces nothing
    kept = CliRunner().invoke(app, [*common, "--modes", "ar", "--limit", "1"])  # neither flag: refuses to replace
    assert kept.exit_code != 0 and "holds 7 journalled runs" in kept.output and "--fresh" in kept.output
    fresh = CliRunner().invoke(app, [*common, "--modes", "ar", "--limit", "1", "--fresh"])
    assert fresh.exit_code == 0 and [run["prompt_id"] for run in _journal(out)] == ["1"]


def test_resuming_under_other_settings_is_refused(bench_setup):
    root, target, _, prompts = bench_setup
    out = root / "refused"
    common = ["bench", "--target", str(target), "--prompts", str(prompts), "--no-chat", "--no-progress",
              "--limit", "1", "--modes", "ar", "--out", str(out)]
    assert CliRunner().invoke(app, [*common, "-n", "6"]).exit_code == 0
    result = CliRunner().invoke(app, [*common, "-n", "7", "--resume"])
    assert result.exit_code != 0 and "max_new_tokens: 6 then, 7 now" in " ".join(result.output.split())
    assert len(_journal(out)) == 1  # nothing lost


def test_models_profile_prints_the_verify_curve_per_layout(bench_setup):
    _, target, draft, _ = bench_setup
    result = CliRunner().invoke(app, ["models", "profile", "--target", str(target), "--layout", "native,transposed",
                                      "--draft", str(draft), "--repeats", "2", "--threads", "1", "--json"])
    assert result.exit_code == 0, result.output
    curves = json.loads(result.output)
    for layout in ("native", "transposed"):
        assert sorted(curves[layout]) == sorted([f"verify_ms_{n}" for n in range(1, 10)] + [
            "draft_ms_per_token", "draft_step_ms_4", "draft_step_ms_16"])  # a model draft: batched steps too
        assert all(value > 0 for value in curves[layout].values())
    bad = CliRunner().invoke(app, ["models", "profile", "--target", str(target), "--layout", "blocked"])
    assert bad.exit_code != 0 and "--layout 'blocked'" in bad.output


# the word-level tiny tokenizer's chat: each message's words in turn, so a chat's ids are its messages' words
TINY_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def chat_setup(bench_setup):
    """The tiny target with a chat template, and a 2-turn prompt file (Spec-Bench's MT-bench format)."""
    from transformers import AutoTokenizer

    root, target, draft, _ = bench_setup
    chat_target = root / "chat_target"
    save_tiny_model(chat_target, seed=0, words=WORDS)
    tokenizer = AutoTokenizer.from_pretrained(chat_target)
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    tokenizer.save_pretrained(chat_target)
    prompts = root / "two_turns.jsonl"
    lines = [{"question_id": 81, "category": "writing", "turns": ["w3 w9 w4 w20 w11", "w5 w5 w6"]},
             {"question_id": 82, "category": "words", "turns": [" ".join(f"w{i % 7 + 2}" for i in range(20)),
                                                                "w8 w2 w7"]},
             {"question_id": 83, "category": "words", "turns": ["w30 w31"]}]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return root, chat_target, draft, prompts, tokenizer


def _turn_inputs_are_each_modes_own_chat(out, prompts, tokenizer) -> None:
    """Every turn-2 run's input (its journalled prompt hash) is turn 1, that mode's own answer to it, turn 2."""
    from services.bench.journal import prompt_hash
    from services.models.tokenization import encode_messages

    lines = map(json.loads, prompts.read_text().splitlines())
    conversations = {str(line["question_id"]): line["turns"] for line in lines}
    journal = _journal(out)
    answers = {(run["mode"], run["prompt_id"]): run["result"]["text"] for run in journal}
    later = [run for run in journal if "/turn" in run["prompt_id"]]
    assert {run["prompt_id"] for run in later} == {"81/turn2", "82/turn2"}
    for run in later:
        first, second = conversations[run["prompt_id"].split("/")[0]]
        chat = [{"role": "user", "content": first},
                {"role": "assistant", "content": answers[(run["mode"], run["prompt_id"].split("/")[0])]},
                {"role": "user", "content": second}]
        assert run["prompt_hash"] == prompt_hash(encode_messages(tokenizer, chat)), (run["mode"], run["prompt_id"])


def test_bench_runs_every_turn_of_a_conversation_in_every_mode(chat_setup):
    root, target, draft, prompts, tokenizer = chat_setup
    out = root / "turns"
    modes = f"ar,sd:ngram,sd:synthetic:0.8,sd:{draft},hf-lookup:3"
    result = CliRunner().invoke(app, ["bench", "--target", str(target), "--prompts", str(prompts), "--modes", modes,
                                      "-n", "12", "--no-progress", "--threads", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "MISMATCH" not in result.output
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["num_prompts"] == 3 and data["meta"]["num_turns"] == 5
    runs = data["runs"]
    reference = {run["id"]: run["token_ids"] for run in runs if run["mode"] == "ar"}
    assert sorted(reference) == ["81", "81/turn2", "82", "82/turn2", "83"]
    for run in runs:  # turn by turn, every mode reproduces target-only greedy decoding
        assert run["token_ids"] == reference[run["id"]], (run["mode"], run["id"])
        assert run["group"] == ("turn2+" if run["turn"] == 2 else "open")
        if run["mode"] != "ar":
            assert run["matches_ar"] is True
    _turn_inputs_are_each_modes_own_chat(out, prompts, tokenizer)
    rows = {(row["mode"], row["scope"]): row for row in data["aggregates"]}
    assert rows[("sd:ngram", "group:turn2+")]["num_prompts"] == 2
    assert rows[("sd:ngram", "group:open")]["num_prompts"] == 3
    assert rows[("sd:ngram", "category:writing")]["num_prompts"] == 2  # a category holds all its turns
    # ar's turn-2 output, replayed: found, it is accepted (a small sample of a 0.8 draft: its figure varies with
    # the answers a weight layout decodes, so only "found" is asserted); not found, nothing would be
    assert rows[("sd:synthetic:0.8", "group:turn2+")]["acceptance_rate"] > 0.1
    assert "| sd:ngram | group:turn2+ | 2 |" in (out / "results.md").read_text()
    first_only = CliRunner().invoke(app, ["bench", "--target", str(target), "--prompts", str(prompts), "--modes", "ar",
                                          "-n", "4", "--max-turns", "1", "--no-progress", "--out", str(root / "first")])
    assert first_only.exit_code == 0, first_only.output
    assert sorted(run["id"] for run in json.loads((root / "first" / "results.json").read_text())["runs"]) == [
        "81", "82", "83"]
    plain = CliRunner().invoke(app, ["bench", "--target", str(target), "--prompts", str(prompts), "--modes", "ar",
                                     "--no-chat", "--out", str(root / "plain")])
    assert plain.exit_code != 0 and "prompt '81' has 2 turns" in plain.output


def test_sampled_turns_carry_each_modes_own_sampled_answer(chat_setup):
    root, target, _, prompts, tokenizer = chat_setup
    out = root / "turns_sampled"
    result = CliRunner().invoke(app, ["bench", "--target", str(target), "--prompts", str(prompts), "--modes",
                                      "ar,sd:ngram,hf-lookup", "-n", "10", "--temperature", "1.0", "--seed", "5",
                                      "--no-progress", "--threads", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert len(runs) == 15 and all(run["matches_ar"] is None for run in runs)
    first_answers = {}
    for run in _journal(out):
        first_answers.setdefault(run["prompt_id"], set()).add(run["result"]["text"])
    assert len(first_answers["81"] | first_answers["82"]) > 2  # the modes sampled answers of their own...
    _turn_inputs_are_each_modes_own_chat(out, prompts, tokenizer)  # ...and each went on with its own
