"""Structured output on the built-in model, in-process (services/speculative/grammar.py through
services/engine/target.py): greedy answers under a grammar identical to constrained target-only decoding and valid
against their schema; a forbidden draft token never verified; forced tokens drafted for free; a session rebuilt
from its committed tokens in the same grammar state."""

from __future__ import annotations

import json

import jsonschema
import pytest

from services.config import SpeculativeSettings
from services.engine import GenerationOptions, GenerationSession
from services.engine.stopping import OutputState
from services.engine.target import TargetSession, run_step
from services.models.drafters import SelfDrafter
from services.models.engine import TorchEngine
from services.models.tokenization import encode_prompt
from services.speculative.grammar import GrammarError, check_grammar, json_schema_grammar, regex_grammar
from services.speculative.params import SamplingParams

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                   "city": {"type": "string", "maxLength": 20}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PROMPT = "Describe a made-up person as JSON with their name, age and city."


def run(target, drafter, prompt_ids, sampling, max_new_tokens=64):
    speculative = SpeculativeSettings(num_draft_tokens=4, min_draft_tokens=4, max_draft_tokens=4, fallback_below=0.0)
    options = GenerationOptions(max_new_tokens=max_new_tokens, speculative=speculative, sampling=sampling)
    session = GenerationSession(target, drafter, prompt_ids, options)
    while not session.finished:
        session.step()
    return session


@pytest.fixture(scope="module")
def person_prompt(builtin_target):
    return encode_prompt(builtin_target.tokenizer, PROMPT, chat=True)


def test_greedy_json_through_speculation_equals_constrained_target_only_and_is_valid(builtin_target, person_prompt):
    sampling = SamplingParams(grammar=json_schema_grammar(PERSON))
    plain = run(builtin_target, None, person_prompt, sampling)
    assert plain.finish_reason == "stop"  # the grammar ended it: an object closes, then only the end is allowed
    answer = json.loads(plain.text())
    jsonschema.validate(answer, PERSON)
    speculative = run(builtin_target, SelfDrafter(builtin_target, "int8"), person_prompt, sampling)
    assert speculative.output_ids == plain.output_ids
    stats = speculative.stats
    assert stats.num_forced_draft_tokens > 0 and stats.num_forced_accepted_tokens > 0  # keys drafted for free
    free = run(builtin_target, None, person_prompt, SamplingParams())
    assert free.output_ids != plain.output_ids  # the grammar changed the answer


def test_a_draft_token_the_grammar_forbids_is_cut_before_the_target_sees_it(builtin_target, person_prompt):
    tokenizer = builtin_target.tokenizer
    output = OutputState.for_request(builtin_target, max_new_tokens=32)
    session = TargetSession(TorchEngine(builtin_target), person_prompt, output=output,
                            sampling=SamplingParams(grammar=json_schema_grammar(PERSON)))
    valid = tokenizer.encode('{"name', add_special_tokens=False)
    bad = tokenizer.encode(" hello", add_special_tokens=False)
    session.set_draft(valid + bad)
    assert session.draft_ids == valid  # the forbidden tail never reaches the forward
    result = run_step(session.engine, [session])[0]
    assert result.verification.num_draft_tokens == len(valid)
    session.set_draft(tokenizer.encode(" nonsense", add_special_tokens=False))  # forbidden from its first token
    assert session.draft_ids in ([], session.grammar.forced()[:len(session.draft_ids)])


def test_a_session_rebuilt_from_its_committed_tokens_continues_in_the_same_grammar_state(builtin_target,
                                                                                         person_prompt):
    sampling = SamplingParams(grammar=json_schema_grammar(PERSON))
    whole = run(builtin_target, None, person_prompt, sampling).output_ids
    first = whole[:7]  # part way into the object
    output = OutputState.for_request(builtin_target, max_new_tokens=64)
    output.accept(first)
    rebuilt = TargetSession(TorchEngine(builtin_target), person_prompt, output=output, sampling=sampling)
    while not rebuilt.finished:
        rebuilt.set_draft([])
        run_step(rebuilt.engine, [rebuilt])
    assert rebuilt.output.output_ids == whole


def test_a_regex_and_bad_grammars(builtin_target, person_prompt):
    sampling = SamplingParams(grammar=regex_grammar(r"(yes|no), because [a-z ]{5,20}\."))
    session = run(builtin_target, None, person_prompt, sampling, max_new_tokens=40)
    import re

    assert re.fullmatch(r"(yes|no), because [a-z ]{5,20}\.", session.text()), session.text()
    tokenizer = builtin_target.tokenizer
    with pytest.raises(GrammarError, match="regex"):
        check_grammar(regex_grammar("[a-"), tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    with pytest.raises(GrammarError):
        check_grammar(json_schema_grammar({"type": "frobnicate"}), tokenizer, len(tokenizer), [2])


def test_a_model_draft_linked_to_its_session_proposes_only_what_the_grammar_allows(builtin_target, person_prompt):
    from services.models.drafters.batched import DraftEngine
    from services.models.drafters.target_kv import link_target

    sampling = SamplingParams(grammar=json_schema_grammar(PERSON))
    output = OutputState.for_request(builtin_target, max_new_tokens=64)
    session = TargetSession(TorchEngine(builtin_target), person_prompt, output=output, sampling=sampling)
    drafter = DraftEngine.on_torch(builtin_target.with_precision("fp32")).new_drafter()
    link_target(drafter, session)
    for _ in range(3):  # part way into the object
        session.set_draft([])
        run_step(session.engine, [session])
    for ahead in ([], session.grammar.forced()):  # from the committed tokens, and (pipelined) past them
        proposal = drafter.propose([*session.token_ids, *ahead], 8, sampling, None)
        assert len(proposal.token_ids) == 8
        assert session.grammar.valid_prefix([*ahead, *proposal.token_ids]) == len(ahead) + 8
    session.set_draft(drafter.propose(session.token_ids, 8, sampling, None).token_ids)
    assert len(session.draft_ids) >= 8  # nothing cut (the forced tail may add more)
    assert run_step(session.engine, [session])[0].verification.num_accepted >= 8  # a copy of the target, masked
