"""The bench's own logic: prompt formats, selection, aggregation, greedy checks (no timing asserts)."""

import json

import pytest

from services.bench.prompts import BenchPrompt, load_prompts, select_prompts
from services.bench.report import build_report, to_markdown
from services.bench.runner import PromptRun, check_against_ar, score_rouge_l
from services.engine.generate import GenerationResult
from services.speculative.stats import SpecDecodingStats


def test_reads_ours_spec_bench_and_sharegpt(tmp_path):
    ours = tmp_path / "dev.jsonl"
    ours.write_text(json.dumps({"id": "a", "category": "qa", "prompt": "P", "context_chars": 3}) + "\n")
    spec_bench = tmp_path / "question.jsonl"
    spec_bench.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["T1", "T2"]}) + "\n")
    sharegpt = tmp_path / "sg.json"
    sharegpt.write_text(json.dumps([{"id": "x", "conversations": [
        {"from": "human", "value": "H"}, {"from": "gpt", "value": "G"}, {"from": "human", "value": "H2"}]}]))
    assert load_prompts(ours) == [BenchPrompt("a", "qa", "P", 3)]
    assert load_prompts(spec_bench) == [BenchPrompt("81", "writing", "T1", 0, ("T2",))]  # every turn, in order
    assert load_prompts(sharegpt) == [BenchPrompt("x", "sharegpt", "H", 0, ("H2",))]  # the user's turns only
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": 1}\n')
    with pytest.raises(ValueError, match="line 1"):
        load_prompts(bad)
    for turns in ([], ["T1", ""], "T1"):
        bad.write_text(json.dumps({"id": "a", "turns": turns}) + "\n")
        with pytest.raises(ValueError, match="line 1: 'turns' must hold at least one user turn"):
            load_prompts(bad)


def test_a_conversation_names_and_groups_its_turns():
    prompt = BenchPrompt("81", "writing", "T1", 5, ("T2", "T3"))
    assert prompt.turns == ("T1", "T2", "T3")
    assert [prompt.turn_id(turn) for turn in (1, 2, 3)] == ["81", "81/turn2", "81/turn3"]
    assert [prompt.turn_group(turn) for turn in (1, 2, 3)] == ["grounded", "turn2+", "turn2+"]
    prompts = [prompt, BenchPrompt("1", "qa", "P")]
    assert [p.turns for p in select_prompts(prompts, max_turns=2)] == [("T1", "T2"), ("P",)]
    assert [p.turns for p in select_prompts(prompts, max_turns=1)] == [("T1",), ("P",)]
    with pytest.raises(ValueError, match="--max-turns must be at least 1"):
        select_prompts(prompts, max_turns=0)


def test_select_per_group_and_category():
    prompts = [BenchPrompt(str(i), "chat" if i % 2 else "qa", "p", context_chars=i % 3) for i in range(12)]
    picked = select_prompts(prompts, per_group=2)
    assert [p.group for p in picked] == ["grounded", "grounded", "open", "open"]
    assert all(p.category == "qa" for p in select_prompts(prompts, categories=["qa"]))
    assert len(select_prompts(prompts, limit=3)) == 3


def fake_run(mode, prompt_id, group_chars, tokens, seconds, drafted=0, accepted=0, ttft=0.01, turn=1):
    stats = SpecDecodingStats()
    if drafted:
        stats.observe(drafted, accepted)
    result = GenerationResult("", tokens, 5, "length", stats, mode, ttft, seconds)
    later = ("p2",) if turn > 1 else ()
    return PromptRun(mode, BenchPrompt(prompt_id, "chat", "p", group_chars, later), result, turn=turn)


def test_report_speedup_and_mismatch():
    ar = [fake_run("ar", "1", 0, [1, 2, 3, 4], 2.0), fake_run("ar", "2", 5, [5, 6], 1.0)]
    sd = [fake_run("sd:x", "1", 0, [1, 2, 3, 4], 1.0, 4, 3), fake_run("sd:x", "2", 5, [5, 7], 0.5, 2, 0)]
    assert check_against_ar(sd, ar) == ["2"]
    rows = {(row.mode, row.scope): row for row in build_report({"ar": ar, "sd:x": sd})}
    assert rows[("ar", "all")].tokens_per_s == pytest.approx(6 / 3.0)
    assert rows[("sd:x", "all")].speedup_vs_ar == pytest.approx((6 / 1.5) / (6 / 3.0))
    assert rows[("sd:x", "group:open")].speedup_vs_ar == pytest.approx(2.0)
    assert rows[("sd:x", "all")].acceptance_rate == pytest.approx(3 / 6)
    assert rows[("sd:x", "all")].acceptance_rate_per_pos == pytest.approx([0.5, 0.5, 1.0, 0.0])
    assert rows[("ar", "all")].acceptance_rate is None  # nothing drafted: no rate, not 0
    assert rows[("sd:x", "all")].num_mismatches == 1
    assert "| sd:x | all | 2 | 6 |" in to_markdown(list(rows.values()))


def test_later_turns_are_checked_and_reported_as_their_own_group():
    ar = [fake_run("ar", "1", 0, [1, 2], 1.0), fake_run("ar", "1", 0, [3, 4], 1.0, turn=2)]
    sd = [fake_run("sd:x", "1", 0, [1, 2], 0.5), fake_run("sd:x", "1", 0, [3, 5], 0.5, turn=2)]
    assert check_against_ar(sd, ar) == ["1/turn2"]  # turn by turn, not the conversation's first answer only
    rows = {(row.mode, row.scope): row for row in build_report({"ar": ar, "sd:x": sd})}
    assert rows[("sd:x", "group:open")].num_prompts == 1 and rows[("sd:x", "group:turn2+")].num_prompts == 1
    assert rows[("sd:x", "group:turn2+")].num_mismatches == 1
    assert rows[("sd:x", "category:chat")].num_prompts == 2  # a category holds all its turns
    from services.bench.report import to_json

    runs = to_json([], {"sd:x": sd}, {})["runs"]
    assert [(run["id"], run["prompt_id"], run["turn"], run["group"]) for run in runs] == [
        ("1", "1", 1, "open"), ("1/turn2", "1", 2, "turn2+")]


def _echo_mode(name):
    """A mode that answers every turn with its name and the number of messages it was given."""
    seen = []

    def run(turn, options):
        seen.append(turn)
        text = f"{name}{len(turn.messages)}"
        return GenerationResult(text, [len(turn.messages)], len(turn.prompt_ids), "length", SpecDecodingStats(),
                                name, 0.0, 0.0)

    return run, seen


def test_each_mode_answers_a_conversation_with_its_own_earlier_answers(tmp_path):
    from services.bench.journal import Journal
    from services.bench.runner import run_interleaved
    from services.engine import GenerationOptions
    from services.speculative.params import SamplingParams

    (ar, ar_seen), (sd, sd_seen) = _echo_mode("a"), _echo_mode("s")
    prompts = [BenchPrompt("c", "chat", "T1", 0, ("T2", "T3")), BenchPrompt("p", "qa", "P")]
    encode = lambda messages: [ord(message["content"][0]) for message in messages]  # noqa: E731
    options = GenerationOptions(sampling=SamplingParams(temperature=0.0), max_new_tokens=4)
    journal = Journal(tmp_path / "runs.jsonl", {"f": 1}, resume=None)
    runs = run_interleaved({"ar": ar, "sd": sd}, prompts, encode, options, warmup=0, progress=False, journal=journal)
    assert [(run.id, run.turn, run.group) for run in runs["sd"]] == [
        ("c", 1, "open"), ("c/turn2", 2, "turn2+"), ("c/turn3", 3, "turn2+"), ("p", 1, "open")]
    third = sd_seen[2]
    assert third.id == "c/turn3" and third.messages == [
        {"role": "user", "content": "T1"}, {"role": "assistant", "content": "s1"},
        {"role": "user", "content": "T2"}, {"role": "assistant", "content": "s3"},
        {"role": "user", "content": "T3"}]
    assert ar_seen[2].messages[1]["content"] == "a1"  # ar's chat holds ar's answers, not sd's
    assert runs["sd"][2].prompt_ids == encode(third.messages)
    # resumed, nothing runs again: turn 2's input is rebuilt from the journalled answer and found by its hash
    (ar2, ar2_seen), (sd2, sd2_seen) = _echo_mode("a"), _echo_mode("s")
    again = run_interleaved({"ar": ar2, "sd": sd2}, prompts, encode, options, warmup=0, progress=False,
                            journal=Journal(tmp_path / "runs.jsonl", {"f": 1}, resume=True))
    assert not ar2_seen and not sd2_seen and [run.id for run in again["ar"]] == [run.id for run in runs["ar"]]
    # a report of the journal alone keeps a conversation up to the first turn some mode lacks
    lines = (tmp_path / "runs.jsonl").read_text().splitlines()
    (tmp_path / "cut.jsonl").write_text("\n".join(line for line in lines if '"c/turn3"' not in line) + "\n")
    never = lambda turn, options: pytest.fail(f"ran {turn.id}")  # noqa: E731
    partial = run_interleaved({"ar": never, "sd": never}, prompts, encode, options, progress=False,
                              journal=Journal(tmp_path / "cut.jsonl", {"f": 1}, resume=None, read_only=True),
                              journalled_only=True)
    assert [run.id for run in partial["sd"]] == ["c", "c/turn2", "p"]


def test_a_conversation_needs_the_chat_template():
    from services.bench.run import BenchConfig
    from services.speculative.params import SamplingParams

    conversation = [BenchPrompt("c", "chat", "T1", 0, ("T2",))]
    with pytest.raises(ValueError, match="prompt 'c' has 2 turns: a conversation needs the chat template"):
        BenchConfig(modes=["ar"], prompts=conversation, sampling=SamplingParams(), max_new_tokens=4, chat=False)
    assert BenchConfig(modes=["ar"], prompts=conversation, sampling=SamplingParams(), max_new_tokens=4).chat


def test_parse_modes():
    from services.bench.run import parse_modes

    assert parse_modes("ar, sd:ngram,stack") == ["ar", "sd:ngram", "stack"]
    assert parse_modes("hf-lookup:5,sd:synthetic:0.7,ar") == ["ar", "hf-lookup:5", "sd:synthetic:0.7"]
    assert parse_modes("hf-assisted,hf-lookup") == ["hf-assisted", "hf-lookup"]
    with pytest.raises(ValueError, match="add the ar mode"):
        parse_modes("sd:synthetic:0.5")
    with pytest.raises(ValueError, match="'x' is not a token count"):
        parse_modes("ar,hf-lookup:x")
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        parse_modes("ar,fast")
    with pytest.raises(ValueError, match="no modes"):
        parse_modes(" , ")


def test_peer_modes_default_to_the_documented_settings():
    from services.bench.peers import parse_peer_mode

    assert parse_peer_mode("hf-assisted").draft == "bf16"
    assert parse_peer_mode("hf-assisted:int8").draft == "int8"
    assert parse_peer_mode("hf-lookup").lookup_tokens == 10
    with pytest.raises(ValueError, match=">= 1"):
        parse_peer_mode("hf-lookup:0")


def test_bound_and_cost_ratio_in_the_report():
    from services.speculative.bound import leviathan_speedup

    # 9 tokens, the first after 1 s: ar decodes 8 more in 8 s (TPOT 1000 ms), sd in 4 s (TPOT 500 ms)
    ar = [fake_run("ar", "1", 0, list(range(9)), 9.0, ttft=1.0)]
    sd = [fake_run("sd:x", "1", 0, list(range(9)), 5.0, 4, 2, ttft=1.0)]
    sd[0].result.draft_s = 0.4  # 4 draft tokens: 100 ms each; ar's TPOT 1000 ms -> c = 0.1
    row = {(r.mode, r.scope): r for r in build_report({"ar": ar, "sd:x": sd})}[("sd:x", "all")]
    assert row.tpot_ms == pytest.approx(500.0) and row.decode_speedup_vs_ar == pytest.approx(2.0)
    assert row.speedup_vs_ar == pytest.approx(9.0 / 5.0)  # the request end to end, prefill included
    assert row.cost_ratio == pytest.approx(0.1)
    assert row.mean_block_length == 4
    # alpha solves alpha + ... + alpha^4 = 2 accepted per round; the bound then yields 3 tokens per round
    assert row.leviathan_bound == pytest.approx(3 / (4 * 0.1 + 1))
    assert row.leviathan_bound == pytest.approx(leviathan_speedup(row.alpha, 4, 0.1))
    assert row.measured_over_bound == pytest.approx(2.0 / row.leviathan_bound)
    # with the measured verify curve (1 token 10 ms, 5 tokens 15 ms): 3 tokens per (4 x 1 ms + 15 ms) vs 1 per 10 ms
    from services.speculative.cost_model import CostModel

    curved = {(r.mode, r.scope): r for r in build_report({"ar": ar, "sd:x": sd}, None, CostModel({1: 10.0, 5: 15.0}))}
    assert curved[("sd:x", "all")].curve_bound == pytest.approx(3 * 10 / (4 * 1.0 + 15))
    assert curved[("sd:x", "all")].measured_over_curve_bound == pytest.approx(2.0 / (30 / 19))
    overridden = {(r.mode, r.scope): r for r in build_report({"ar": ar, "sd:x": sd}, {"sd:x": 0.0})}
    assert overridden[("sd:x", "all")].cost_ratio == 0.0


def test_the_bound_is_held_to_decoding_not_to_a_long_prefill():
    """A long prompt: 50 s of prefill, the same for both, then decoding twice as fast. The draft sped up what it
    could (2x), though the request as a whole is only 1.07x faster."""
    ar = [fake_run("ar", "1", 0, list(range(9)), 58.0, ttft=50.0)]
    sd = [fake_run("sd:x", "1", 0, list(range(9)), 54.0, 4, 2, ttft=50.0)]
    sd[0].result.draft_s = 0.4
    row = {(r.mode, r.scope): r for r in build_report({"ar": ar, "sd:x": sd})}[("sd:x", "all")]
    assert row.speedup_vs_ar == pytest.approx(58.0 / 54.0)
    assert row.decode_speedup_vs_ar == pytest.approx(2.0)
    assert row.cost_ratio == pytest.approx(0.1)  # 100 ms against ar's TPOT, not against 58 s / 9 tokens
    assert row.measured_over_bound == pytest.approx(2.0 / (3 / 1.4))
    table = to_markdown([row])
    assert "| 1.07x | 500.0 | 2.00x |" in table


def test_rouge_l_against_ar():
    ar = [fake_run("ar", "1", 0, [1], 1.0)]
    ar[0].result.text = "the cat sat on the mat"
    same, other = fake_run("sd:x", "1", 0, [1], 1.0), fake_run("sd:y", "1", 0, [1], 1.0)
    same.result.text, other.result.text = "the cat sat on the mat", "a dog ran"
    score_rouge_l([same, other], ar)
    assert same.rouge_l == pytest.approx(1.0)
    assert other.rouge_l == pytest.approx(0.0)


def test_plots_are_png_files(tmp_path):
    from services.bench.plots import plot_acceptance_per_position, plot_speedup

    ar = [fake_run("ar", "1", 0, [1, 2], 2.0), fake_run("ar", "2", 5, [1, 2], 2.0)]
    sd = [fake_run("sd:x", "1", 0, [1, 2], 1.0, 2, 1), fake_run("sd:x", "2", 5, [1, 2], 1.0, 3, 3)]
    rows = build_report({"ar": ar, "sd:x": sd})
    for path in (plot_speedup(rows, tmp_path / "s.png"), plot_acceptance_per_position(rows, tmp_path / "a.png")):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_speedup(build_report({"ar": ar}), tmp_path / "none.png") is None


def test_stratified_order_round_robins_categories_keeping_their_order():
    from services.bench.prompts import BenchPrompt
    from services.bench.prompts import stratified

    prompts = [BenchPrompt(f"{category}{index}", category, "p") for category, count in (("chat", 3), ("qa", 1), ("code", 2))
               for index in range(count)]
    assert [p.id for p in stratified(prompts)] == ["chat0", "qa0", "code0", "chat1", "code1", "chat2"]


def test_merging_bench_documents_and_table():
    import pytest

    from services.bench.merging import documents, render
    from services.bench.prompts import BenchPrompt

    grounded = [BenchPrompt(f"g{i}", "qa", f"text {i} " * 300, context_chars=2000) for i in range(6)]
    docs = documents([BenchPrompt("o", "chat", "hi"), *grounded], 3)
    assert len(docs) == 3 and len(set(docs)) == 3 and all(len(doc) > 3000 for doc in docs)
    with pytest.raises(ValueError, match="needs 8 grounded prompts"):
        documents(grounded, 4)
    report = {
        "prefix": {"pairs": [{"prompt_tokens": 970, "warm_cached_tokens": 950}], "cold_ttft_s": 3.3,
                   "warm_ttft_s": 0.18, "warm_over_cold": 0.0545},
        "single_flight": {"requests": 8, "max_tokens": 64, "alone_s": 1.0, "together_s": 1.4,
                          "together_over_alone": 1.4, "identical_answers": 8, "merged": 7,
                          "verify_tokens_stepped": {"alone": 96, "together": 94}, "baseline_together_s": 5.0},
        "unrelated": {"prompts": [{}] * 8, "ttft_s": 0.1, "total_s": 1.0},
    }
    table = render(report)
    assert "| | warm / cold | 5.5% |" in table and "8 / 7" in table and "baseline (merging off) | 5.00 s" in table


INVOICE = {"type": "object", "properties": {"total": {"type": "number"}, "paid": {"type": "boolean"}},
           "required": ["total", "paid"], "additionalProperties": False}


def test_a_record_with_a_schema_asks_for_it_over_http_and_in_the_sampling(tmp_path):
    from services.bench.formats import constrained
    from services.bench.prompts import Turn
    from services.bench.stack_client import request_body
    from services.engine import GenerationOptions
    from services.speculative.grammar import json_schema_grammar
    from services.speculative.params import SamplingParams

    path = tmp_path / "set.jsonl"
    path.write_text(json.dumps({"id": "i", "category": "extraction", "prompt": "P", "schema": INVOICE}) + "\n"
                    + json.dumps({"id": "f", "category": "qa", "prompt": "Q"}) + "\n")
    formatted, free = load_prompts(path)
    assert formatted.schema == INVOICE and free.schema is None
    options = GenerationOptions(sampling=SamplingParams(temperature=0.7, top_p=0.9, seed=5), max_new_tokens=8)
    assert constrained(options, None) is options
    held = constrained(options, INVOICE)  # the run's sampling, held to the schema's grammar
    assert held.sampling == SamplingParams(temperature=0.7, top_p=0.9, seed=5, grammar=json_schema_grammar(INVOICE))
    assert held.max_new_tokens == 8
    messages = [{"role": "user", "content": "P"}]
    body = request_body("m", Turn("i", messages, [1], INVOICE), options)
    assert body["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "answer", "schema": INVOICE, "strict": True}}
    assert (body["messages"], body["temperature"], body["top_p"], body["seed"]) == (messages, 0.7, 0.9, 5)
    assert "response_format" not in request_body("m", Turn("f", messages, [1]), options)
    path.write_text(json.dumps({"id": "i", "prompt": "P", "schema": "an invoice"}) + "\n")
    with pytest.raises(ValueError, match="line 1: 'schema' must be a JSON schema"):
        load_prompts(path)


def test_in_process_modes_decode_each_turn_under_its_prompts_schema(monkeypatch):
    from types import SimpleNamespace

    from services.bench import run as bench_run
    from services.bench.runner import run_interleaved
    from services.engine import GenerationOptions
    from services.speculative.grammar import json_schema_grammar
    from services.speculative.params import SamplingParams

    grammars = []

    def generate(target, source, prompt_ids, options):
        grammars.append(options.sampling.grammar)
        return GenerationResult("{}", [1], len(prompt_ids), "stop", SpecDecodingStats(), "none", 0.0, 0.0)

    monkeypatch.setattr(bench_run, "generate", generate)
    monkeypatch.setattr(bench_run, "load_draft_source", lambda *args, **kwargs: SimpleNamespace(is_none=True,
                                                                                                references=None))
    settings = SimpleNamespace(speculative=SimpleNamespace(block_policy="acceptance"), llamacpp=None, cache_dir=None,
                               suffix=None)
    run_prompt, _ = bench_run._in_process_mode("ar", None, settings)
    prompts = [BenchPrompt("i", "extraction", "P", schema=INVOICE), BenchPrompt("f", "qa", "Q")]
    options = GenerationOptions(sampling=SamplingParams(temperature=0.5), max_new_tokens=4)
    run_interleaved({"ar": run_prompt}, prompts, lambda messages: [7], options, warmup=0, progress=False)
    assert grammars == [json_schema_grammar(INVOICE), None]


def formatted_run(prompt_id, category, text, schema, forced=(0, 0)):
    stats = SpecDecodingStats()
    if forced[0]:  # a round whose block the grammar forced whole
        stats.observe(forced[0], forced[1])
        stats.num_forced_draft_tokens, stats.num_forced_accepted_tokens = forced
    result = GenerationResult(text, [1, 2], 5, "stop", stats, "sd:x", 0.01, 1.0)
    return PromptRun("sd:x", BenchPrompt(prompt_id, category, "p", 10, schema=schema), result)


def test_answers_are_checked_against_their_schema_and_the_valid_share_reported_per_category():
    from services.bench.formats import check_output
    from services.bench.report import to_json
    from services.bench.runner import check_formats

    assert check_output('{"total": 12.5, "paid": false}\n', INVOICE) == (True, True)
    assert check_output('{"total": "12.5", "paid": false}', INVOICE) == (True, False)  # a string for the number
    assert check_output('{"total": 1, "paid": true, "note": ""}', INVOICE) == (True, False)  # a key not allowed
    assert check_output('{"total": 12.5, "pa', INVOICE) == (False, False)  # cut at max_new_tokens
    runs = [formatted_run("a", "extraction", '{"total": 3, "paid": true}', INVOICE, forced=(4, 3)),
            formatted_run("b", "extraction", '{"total": 3}', INVOICE, forced=(2, 2)),
            formatted_run("c", "qa", "free text", None)]
    check_formats(runs)
    assert [(run.parses_as_json, run.matches_schema) for run in runs] == [(True, True), (True, False), (None, None)]
    rows = {row.scope: row for row in build_report({"sd:x": runs})}
    extraction = rows["category:extraction"]
    assert (extraction.num_formatted, extraction.num_valid, extraction.valid_share) == (2, 1, 0.5)
    assert rows["category:qa"].valid_share is None and rows["all"].valid_share == 0.5
    assert (rows["all"].num_forced_draft_tokens, rows["all"].num_forced_accepted_tokens) == (6, 5)
    table = to_markdown([rows["all"], extraction, rows["category:qa"]])
    assert table.splitlines()[0].endswith("| mismatches | valid JSON | forced draft tokens | forced accepted |")
    assert "| 50% (1/2) | 6 | 5 |" in table and "| - | 0 | 0 |" in table
    records = to_json([], {"sd:x": runs}, {})["runs"]
    assert [(run["parses_as_json"], run["matches_schema"]) for run in records] == [
        (True, True), (True, False), (None, None)]
    assert records[0]["stats"]["num_forced_draft_tokens"] == 4
    assert "valid JSON" not in to_markdown(build_report({"ar": [fake_run("ar", "1", 0, [1], 1.0)]}))


def test_the_stack_modes_stats_keep_the_forced_and_suffix_counts():
    from services.bench.stack_client import _stats

    payload = {"request_id": "r", "num_rounds": 3, "num_cached_tokens": 0, "verify_worker": None, "num_drafts": 2,
               "num_draft_tokens": 6, "num_accepted_tokens": 4, "acceptance_rate": 4 / 6,
               "mean_acceptance_length": 3.0, "num_draft_tokens_per_pos": [2, 2, 2],
               "num_accepted_tokens_per_pos": [2, 1, 1], "num_suffix_drafts": 1, "num_history_drafts": 0,
               "num_suffix_draft_tokens": 3, "num_suffix_accepted_tokens": 1, "num_forced_draft_tokens": 3,
               "num_forced_accepted_tokens": 3}
    stats = _stats(payload)
    assert (stats.num_target_calls, stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 2, 6, 4)
    assert stats.num_accepted_tokens_per_pos == [2, 1, 1] and stats.num_suffix_draft_tokens == 3
    assert (stats.num_forced_draft_tokens, stats.num_forced_accepted_tokens) == (3, 3)
    assert _stats({}) == SpecDecodingStats()  # a stack that sent no stats


def test_a_journalled_run_is_reused_only_under_the_same_schema(tmp_path):
    import hashlib

    from services.bench.journal import Journal, prompt_hash

    assert prompt_hash([1, 2]) == hashlib.blake2b(b"[1, 2]", digest_size=8).hexdigest()  # older journals resume
    assert prompt_hash([1, 2], INVOICE) != prompt_hash([1, 2])
    journal = Journal(tmp_path / "runs.jsonl", {"f": 1}, resume=None)
    result = GenerationResult("{}", [1], 2, "stop", SpecDecodingStats(), "none", 0.0, 0.0)
    journal.record("ar", "i", [1, 2], result, INVOICE)
    assert journal.done("ar", "i", [1, 2], INVOICE) and not journal.done("ar", "i", [1, 2])
    assert Journal(tmp_path / "runs.jsonl", {"f": 1}, resume=True).done("ar", "i", [1, 2], INVOICE)


def test_transformers_modes_are_refused_with_a_schema():
    from services.bench.run import BenchConfig
    from services.speculative.params import SamplingParams

    prompts = [BenchPrompt("i", "extraction", "P", schema=INVOICE)]
    with pytest.raises(ValueError, match="prompt 'i' asks for a JSON schema, which transformers' hf-lookup mode"):
        BenchConfig(modes=["ar", "hf-lookup"], prompts=prompts, sampling=SamplingParams(), max_new_tokens=4)
    assert BenchConfig(modes=["ar", "sd:ngram", "stack"], prompts=prompts, sampling=SamplingParams(),
                       max_new_tokens=4).modes
