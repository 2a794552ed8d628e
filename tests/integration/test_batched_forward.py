"""The packed forward over ragged rows equals each session's own forward (transformers, no batching), for
prefill chunks, verify blocks and single tokens mixed in one step, across the supported architectures."""

from __future__ import annotations

import pytest
import torch

from services.models.engine import TorchEngine
from services.models.decoder import ForwardRow, UnsupportedModelError, decoder_parts
from services.models.kv_store import PAGE_TOKENS
from services.models.loading import LoadedModel
from services.models.precision import apply_precision
from tests.conftest import TINY_VOCAB, build_tiny_llama


def tiny(model_type: str, seed: int = 0) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"qwen2": {"use_sliding_window": False}, "qwen3": {"use_sliding_window": False, "head_dim": 8},
             "mistral": {"sliding_window": None}}.get(model_type, {})
    config = AutoConfig.for_model(model_type, vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False,
                                  **extra)
    torch.manual_seed(seed)
    model = apply_precision(AutoModelForCausalLM.from_config(config), "fp32", torch.device("cpu"))
    return LoadedModel(f"tiny-{model_type}", model, None)


def reference_logits(target: LoadedModel, token_ids: list[int], last: int) -> torch.Tensor:
    """transformers' own forward over the whole sequence at once: logits of the last `last` positions."""
    with torch.inference_mode():
        return target.model(torch.tensor([token_ids])).logits[0, -last:].float()


def random_ids(generator: torch.Generator, length: int) -> list[int]:
    return torch.randint(0, TINY_VOCAB, (length,), generator=generator).tolist()


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral"])
def test_mixed_ragged_steps_match_per_session_forwards(model_type):
    target = build_tiny_llama(0) if model_type == "llama" else tiny(model_type)
    engine = TorchEngine(target)
    generator = torch.Generator().manual_seed(7)
    prompts = [random_ids(generator, n) for n in (3, 40, 17, 1, 90)]
    sequences = [engine.new_sequence() for _ in prompts]
    contexts = [[] for _ in prompts]
    # step 1: whole prompts (one wants no logits: a chunk), step 2: a mix of blocks, single tokens and a
    # chunk of more prompt, step 3 after rejections (crops) in some rows
    plans = [
        [(prompts[i], 1 if i != 1 else 0) for i in range(5)],
        [(random_ids(generator, 5), 5), (random_ids(generator, 30), 2), (random_ids(generator, 1), 1),
         (random_ids(generator, 9), 9), (random_ids(generator, 2), 2)],
    ]
    for step in plans:
        rows = [ForwardRow(sequence, ids, logits) for sequence, (ids, logits) in zip(sequences, step)]
        outputs = engine.forward(rows)
        for index, ((ids, logits), output) in enumerate(zip(step, outputs)):
            contexts[index] += ids
            assert sequences[index].length == len(contexts[index])
            if logits == 0:
                assert output is None
                continue
            torch.testing.assert_close(output, reference_logits(target, contexts[index], logits), atol=1e-4,
                                       rtol=1e-4)
    for index, keep in ((0, 4), (3, 2)):  # rejected draft tokens: the KV is cropped, not recomputed
        sequences[index].crop(keep)
        contexts[index] = contexts[index][:keep]
    step = [(random_ids(generator, 3), 3) for _ in prompts]
    outputs = engine.forward([ForwardRow(s, ids, n) for s, (ids, n) in zip(sequences, step)])
    for index, ((ids, logits), output) in enumerate(zip(step, outputs)):
        contexts[index] += ids
        torch.testing.assert_close(output, reference_logits(target, contexts[index], logits), atol=1e-4, rtol=1e-4)


def test_a_batch_gives_each_row_what_it_gets_alone():
    target = build_tiny_llama(3)
    generator = torch.Generator().manual_seed(1)
    prompts = [random_ids(generator, n) for n in (12, 5, 33, 8)]
    alone = []
    for prompt in prompts:
        engine = TorchEngine(target)
        alone.append(engine.forward([ForwardRow(engine.new_sequence(), prompt, 4)])[0])
    engine = TorchEngine(target)
    together = engine.forward([ForwardRow(engine.new_sequence(), prompt, 4) for prompt in prompts])
    for single, batched in zip(alone, together):
        torch.testing.assert_close(batched, single, atol=1e-5, rtol=1e-5)
        assert torch.equal(batched.argmax(-1), single.argmax(-1))


def test_kv_store_grows_by_pages_and_counts_reserved_bytes():
    target = build_tiny_llama(0)
    engine = TorchEngine(target, budget_bytes=4 * PAGE_TOKENS * 2 * 2 * 2 * 8 * 4)
    store = engine.store
    sequence = engine.new_sequence()
    engine.forward([ForwardRow(sequence, list(range(10)), 1)])
    assert sequence.capacity == PAGE_TOKENS and store.used_bytes == PAGE_TOKENS * store.shape.bytes_per_token
    kv_before = sequence.kv[:, :, :, :10].clone()
    engine.forward([ForwardRow(sequence, [1] * PAGE_TOKENS, 1)])  # outgrows one page: copied once, grown by >= 1.5x
    assert sequence.capacity == 2 * PAGE_TOKENS and torch.equal(sequence.kv[:, :, :, :10], kv_before)
    assert store.growth_bytes(sequence, 2 * PAGE_TOKENS) == 0
    assert store.growth_bytes(sequence, 2 * PAGE_TOKENS + 1) == PAGE_TOKENS * store.shape.bytes_per_token
    assert not store.over_budget() and store.over_budget(3 * PAGE_TOKENS * store.shape.bytes_per_token)
    sequence.crop(3)
    assert sequence.length == 3 and sequence.capacity == 2 * PAGE_TOKENS  # a crop moves no data
    sequence.release()
    assert store.used_bytes == 0 and store.num_sequences == 0
    with pytest.raises(ValueError, match="less than one page"):
        TorchEngine(target, budget_bytes=100)


def test_unsupported_architectures_are_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    with pytest.raises(UnsupportedModelError, match="model type 'gpt2' is not supported"):
        decoder_parts(model)


def test_an_int8_target_gives_each_row_what_it_gets_alone_in_one_packed_forward():
    """int8 scales each token's activations on their own and sums in int32 (services/models/int8_linear.py):
    rows packed into one forward get the very bits they get alone."""
    target = build_tiny_llama(4).with_precision("int8")
    generator = torch.Generator().manual_seed(2)
    prompts = [random_ids(generator, n) for n in (3, 40, 9)]
    alone = []
    for prompt in prompts:
        engine = TorchEngine(target)
        alone.append(engine.forward([ForwardRow(engine.new_sequence(), prompt, 2)])[0])
    engine = TorchEngine(target)
    together = engine.forward([ForwardRow(engine.new_sequence(), prompt, 2) for prompt in prompts])
    for single, batched in zip(alone, together):
        assert torch.equal(batched, single)


def _mixed_step(engine: TorchEngine, generator: torch.Generator, before_step=lambda: None) -> tuple[list, list]:
    """Seven sequences: five of like lengths (one shelf), one released between them (a free slot in the
    run), one longer (another shelf); then a step of single tokens, blocks and a prefill chunk."""
    sequences = [engine.new_sequence() for _ in range(7)]
    lengths = (20, 31, 9, 25, 40, 14, 150)
    rows = [ForwardRow(sequence, random_ids(generator, n), 1) for sequence, n in zip(sequences, lengths)]
    engine.forward(rows)
    sequences[2].release()
    live = [sequence for index, sequence in enumerate(sequences) if index != 2]
    step = [ForwardRow(sequence, random_ids(generator, n), n) for sequence, n in zip(live, (1, 5, 1, 3, 40, 9))]
    before_step()
    return live, engine.forward(step)


def test_attention_in_one_call_per_shelf_equals_attention_row_by_row(monkeypatch):
    from services.models import decoder

    target = build_tiny_llama(5)
    calls = []
    one_call = decoder._attend_group
    monkeypatch.setattr(decoder, "_attend_group", lambda group, *args: calls.append(group) or one_call(group,
                                                                                                          *args))
    grouped_engine = TorchEngine(target)
    grouped, grouped_logits = _mixed_step(grouped_engine, torch.Generator().manual_seed(3), calls.clear)
    layers = len(grouped_engine.parts.layers)
    # one call per layer for the four short rows on the small shelf (across the free slot); the 40-token
    # chunk and the long sequence's block, alone on its shelf, attend one by one
    assert len(calls) == layers
    assert calls[0].slots == 5 and calls[0].width == 5  # slots 0-4 of the small shelf (2 free), a 5-token block
    monkeypatch.setattr(decoder, "GROUP_MAX_TOKENS", 0)  # every row alone: the per-row attention
    calls.clear()
    alone_engine = TorchEngine(target)
    alone, alone_logits = _mixed_step(alone_engine, torch.Generator().manual_seed(3))
    assert not calls
    for together, single in zip(grouped_logits, alone_logits):
        torch.testing.assert_close(together, single, atol=1e-5, rtol=1e-5)
        assert torch.equal(together.argmax(-1), single.argmax(-1))
    for a, b in zip(grouped, alone):  # the same keys and values written, at the same positions
        assert a.length == b.length
        torch.testing.assert_close(a.kv[:, :, :, : a.length], b.kv[:, :, :, : b.length], atol=1e-6, rtol=1e-6)


def test_a_bf16_target_attends_in_one_call_like_row_by_row(monkeypatch):
    from services.models import decoder

    target = build_tiny_llama(6)
    target = LoadedModel(target.name, apply_precision(target.model, "bf16", torch.device("cpu")), None)
    _, grouped_logits = _mixed_step(TorchEngine(target), torch.Generator().manual_seed(4))
    monkeypatch.setattr(decoder, "GROUP_MAX_TOKENS", 0)
    _, alone_logits = _mixed_step(TorchEngine(target), torch.Generator().manual_seed(4))
    for together, single in zip(grouped_logits, alone_logits):
        torch.testing.assert_close(together, single, atol=2e-2, rtol=2e-2)


def test_an_int8_target_gives_a_token_in_a_block_the_bits_it_gets_decoded_alone():
    """A block of eight tokens in one row, then the same eight one forward each: every position's logits are
    equal, bit for bit (int8 sums exact per token, attention in double)."""
    target = build_tiny_llama(5).with_precision("int8")
    generator = torch.Generator().manual_seed(3)
    prompt, block = random_ids(generator, 30), random_ids(generator, 8)
    engine = TorchEngine(target)
    together, alone = engine.new_sequence(), engine.new_sequence()
    engine.forward([ForwardRow(together, prompt, 1), ForwardRow(alone, prompt, 1)])
    in_block = engine.forward([ForwardRow(together, block, len(block))])[0]
    one_by_one = torch.cat([engine.forward([ForwardRow(alone, [token], 1)])[0] for token in block])
    assert torch.equal(in_block, one_by_one)
