"""A llama.cpp draft that is a copy of the target takes the target's KV of the prompt (drafters/target_kv.py):
the built-in pair on the real GGUF and the real target."""

from __future__ import annotations

import copy

import pytest
import torch

from services.config import LlamaCppSettings
from services.engine import GenerationOptions, generate
from services.models.decoder import ForwardRow
from services.models.drafters import load_draft_source
from services.models.drafters.gguf import load_gguf_engine
from services.models.drafters.target_kv import bridge_for, link_target, measure_bridge, probe_ids
from services.models.engine import TorchEngine
from services.models.loading import LoadedModel, load_target_vocab
from services.models.tokenization import encode_prompt
from services.speculative.params import SamplingParams

pytestmark = pytest.mark.slow

SPEC = "gguf:smollm2-135m"
LONG_TEXT = ("Summarize the following report in two sentences.\n\n" + " ".join(
    f"In quarter {q}, the northern plant shipped {q * 1700 + 250} units while the southern plant, hit by a "
    f"supplier strike in week {q + 3}, shipped {q * 900 + 120} units and rebuilt its stock of parts." for q in range(1, 13)))


class Target:
    """What a drafter's link reads of a session's target: its committed tokens and its sequence."""

    def __init__(self, engine: TorchEngine, token_ids: list[int]) -> None:
        self.engine, self.token_ids = engine, token_ids
        self.sequence = engine.new_sequence()
        self.logits = engine.forward([ForwardRow(self.sequence, token_ids[:-1], 0)])


@pytest.fixture(scope="module")
def draft_engine():
    return load_gguf_engine(SPEC, load_target_vocab("smollm2-135m"), LlamaCppSettings(num_sequences=4), num_threads=2)


def test_the_built_in_draft_is_found_a_copy_of_the_target(builtin_target, draft_engine):
    engine = TorchEngine(builtin_target)
    bridge = measure_bridge(draft_engine.engine, engine)
    assert bridge is not None and bridge.interleave  # GGUF interleaves each head's key halves
    assert bridge_for(draft_engine, engine) is bridge_for(draft_engine, TorchEngine(builtin_target))  # once per model


def test_another_model_of_the_same_shape_is_not(builtin_target, draft_engine):
    model = copy.deepcopy(builtin_target.model)
    layer = model.model.layers[5].self_attn
    with torch.no_grad():
        layer.k_proj.weight.copy_(torch.randn_like(layer.k_proj.weight) * layer.k_proj.weight.std())
    other = LoadedModel("other", model, builtin_target.tokenizer, "fp32", builtin_target.device, builtin_target.layout)
    assert measure_bridge(draft_engine.engine, TorchEngine(other)) is None


def test_a_linked_draft_copies_the_prompt_and_drafts_what_the_target_would(builtin_target, draft_engine):
    ids = encode_prompt(builtin_target.tokenizer, LONG_TEXT, chat=True)
    assert len(ids) > 300
    target = Target(TorchEngine(builtin_target), ids)
    drafter = draft_engine.new_drafter()
    assert link_target(drafter, target)
    assert drafter.missing(ids) == 0  # what the target read costs a copy, not a prefill
    llama = draft_engine.engine
    before = llama.num_decoded_tokens
    block = drafter.propose(ids, 6, SamplingParams(), None)
    assert llama.num_decoded_tokens - before == 1 + 5  # the prompt's last token, then one per draft step
    assert drafter.sequence.length == len(ids) + 5
    # the target's own greedy continuation
    sequence, expected = target.sequence, []
    logits = target.engine.forward([ForwardRow(sequence, ids[-1:], 1)])[0][0]
    for _ in range(6):
        expected.append(int(logits.argmax()))
        logits = target.engine.forward([ForwardRow(sequence, expected[-1:], 1)])[0][0]
    assert block.token_ids[:3] == expected[:3]


def test_a_draft_of_unrelated_tokens_is_not_given_the_targets_kv(builtin_target, draft_engine):
    ids = encode_prompt(builtin_target.tokenizer, LONG_TEXT, chat=True)
    target = Target(TorchEngine(builtin_target), ids)
    drafter = draft_engine.new_drafter()
    assert link_target(drafter, target)
    other = [*ids[:10], *probe_ids(1000, 200), ids[-1]]
    assert drafter.adoptable(other) == 0  # the target's tokens differ from position 10 on
    assert drafter.missing(other) == len(other) - 1


def test_greedy_output_stays_the_targets_on_a_long_prompt(builtin_target):
    ids = encode_prompt(builtin_target.tokenizer, LONG_TEXT, chat=True)
    none = load_draft_source("none", builtin_target)
    expected = generate(builtin_target, none, ids, GenerationOptions(max_new_tokens=40))
    for spec in (SPEC, f"suffix:{SPEC}"):
        source = load_draft_source(spec, builtin_target, num_threads=2)
        result = generate(builtin_target, source, ids, GenerationOptions(max_new_tokens=40))
        assert result.token_ids == expected.token_ids, spec
        assert result.stats.num_accepted_tokens > 20, spec
        if spec == SPEC:  # (the choice drafts this repetitive text from its suffix index, the model never asked)
            copies = [entry[1].num_copies for entry in source.engine.kv_bridges.values()]
            assert copies and copies[0] >= 1  # the prompt came from the target
