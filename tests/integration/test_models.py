"""Loading by directory, refusing mismatched tokenizers and unknown models, precisions."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

from services.errors import ModelNotFoundError, PrecisionError, TokenizerMismatchError
from services.models.drafters import load_draft_source
from services.models.loading import check_same_tokenizer, load_model
from services.models.linear_layout import TransposedLinear, restore_linears, transpose_linears
from services.models.int8_linear import Int8Linear
from services.models.precision import Fp32Norm, apply_precision, lossless_warning
from tests.conftest import WORDS, build_tiny_llama, save_tiny_model


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "target": save_tiny_model(root / "target", seed=0, words=WORDS),
        "draft": save_tiny_model(root / "draft", seed=1, words=WORDS),
        "other": save_tiny_model(root / "other", seed=2, words=[*WORDS[:-1], "different"]),
        "bigger": save_tiny_model(root / "bigger", seed=3, words=[*WORDS, "extra"]),
    }


def test_load_local_directory_with_tokenizer(tiny_dirs):
    loaded = load_model(str(tiny_dirs["target"]))
    assert loaded.name == "target"
    assert loaded.tokenizer.encode("w1 w2 w3") == [3, 4, 5]
    assert loaded.vocab_size == len(WORDS)


def test_same_tokenizer_draft_is_accepted(tiny_dirs):
    target = load_model(str(tiny_dirs["target"]))
    source = load_draft_source(str(tiny_dirs["draft"]), target)
    assert source.model is not None and source.new_drafter() is not None


@pytest.mark.parametrize("which, sizes", [("other", "vocab size 64"), ("bigger", "vocab size 65")])
def test_tokenizer_mismatch_names_both_models_and_sizes(tiny_dirs, which, sizes):
    target = load_model(str(tiny_dirs["target"]))
    with pytest.raises(TokenizerMismatchError) as excinfo:
        load_draft_source(str(tiny_dirs[which]), target)
    message = str(excinfo.value)
    assert f"draft '{which}' ({sizes})" in message
    assert "target 'target' (vocab size 64)" in message


def test_id_only_models_compare_vocab_sizes():
    check_same_tokenizer(build_tiny_llama(0), build_tiny_llama(1))
    with pytest.raises(TokenizerMismatchError, match="vocab size 50"):
        check_same_tokenizer(build_tiny_llama(0), build_tiny_llama(1, vocab_size=50))


@pytest.mark.parametrize("spec", ["no-such-org/no-such-model", "./missing-dir", "/tmp/definitely/not/here.gguf"])
def test_unknown_model_is_a_clear_error_without_network(spec, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(ModelNotFoundError, match="not found|neither"):
        load_model(spec)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        load_model(str(tmp_path))


def test_int8_quantises_linears_and_keeps_norms_float(tiny_target):
    quantised = tiny_target.with_precision("int8").model
    assert not any(isinstance(m, nn.Linear) for m in quantised.modules())
    layers = [m for m in quantised.modules() if isinstance(m, Int8Linear)]
    assert layers and all(m.weight.dtype == torch.int8 and m.weight_scale.dtype == torch.float32 for m in layers)
    norms = [m for m in quantised.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and all(norm.weight.dtype == torch.float32 for norm in norms)


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_low_precision_keeps_norms_fp32(tiny_target, precision, dtype):
    model = tiny_target.with_precision(precision).model
    assert model.model.layers[0].mlp.up_proj.weight.dtype == dtype
    wrapped = [m for m in model.modules() if isinstance(m, Fp32Norm)]
    assert len(wrapped) == 2 * 2 + 1  # two per layer, plus the final norm
    assert all(norm.inner.weight.dtype == torch.float32 for norm in wrapped)
    with torch.inference_mode():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.dtype == dtype and torch.isfinite(logits).all()


def test_unknown_or_unsupported_precision(tiny_target):
    with pytest.raises(PrecisionError, match="unknown precision 'int4'"):
        apply_precision(tiny_target.model, "int4", torch.device("cpu"))
    with pytest.raises(PrecisionError, match="runs on CPU only"):
        apply_precision(build_tiny_llama(0).model, "int8", torch.device("meta"))


def test_transposed_layout_computes_what_native_does_and_keeps_the_linear_face(tiny_dirs):
    native = load_model(str(tiny_dirs["target"]), layout="native")
    transposed = load_model(str(tiny_dirs["target"]), layout="transposed")
    assert not any(isinstance(m, TransposedLinear) for m in native.model.modules())
    layers = [m for m in transposed.model.modules() if isinstance(m, TransposedLinear)]
    assert len(layers) == 2 * 7 + 1  # q k v o gate up down per layer, plus the head
    assert not any(type(m) is nn.Linear for m in transposed.model.modules())
    tokens = torch.tensor([[3, 9, 4, 20, 11, 7, 5, 30, 6]])
    with torch.inference_mode():  # one block of 9 rows: where the layouts take different kernels
        expected, got = native.model(tokens).logits, transposed.model(tokens).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    native_state, transposed_state = native.model.state_dict(), transposed.model.state_dict()
    assert native_state.keys() == transposed_state.keys()  # readers (distillation, copies) see nn.Linear's names
    for key, tensor in native_state.items():
        torch.testing.assert_close(transposed_state[key], tensor, rtol=0, atol=0)
    head = transposed.model.get_output_embeddings()
    assert head.weight.shape == (head.out_features, head.in_features)
    copied = transposed.with_precision("fp32")  # a copy keeps the layout; int8 and bf16 get plain layers
    assert any(isinstance(m, TransposedLinear) for m in copied.model.modules())
    other = load_model(str(tiny_dirs["draft"]), layout="native")
    transposed.model.load_state_dict(other.model.state_dict())  # loading goes through the [out, in] names too
    with torch.inference_mode():
        torch.testing.assert_close(transposed.model(tokens).logits, other.model(tokens).logits, rtol=1e-5, atol=1e-5)


def test_unknown_layout_is_a_clear_error(tiny_target):
    with pytest.raises(PrecisionError, match="unknown weight layout 'blocked'"):
        apply_precision(build_tiny_llama(0).model, "fp32", torch.device("cpu"), layout="blocked")


def test_a_tied_head_is_transposed_apart_and_can_be_tied_again():
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    native = LlamaForCausalLM(config).eval()
    assert native.lm_head.weight is native.model.embed_tokens.weight
    transposed = apply_precision(copy.deepcopy(native), "fp32", torch.device("cpu"))
    tokens = torch.tensor([[3, 9, 4, 20, 11, 7]])
    with torch.inference_mode():
        torch.testing.assert_close(transposed(tokens).logits, native(tokens).logits, rtol=1e-5, atol=1e-5)
    transposed.tie_weights()  # transformers re-ties (resize_token_embeddings does): the head follows, transposed
    assert isinstance(transposed.lm_head, TransposedLinear)
    with torch.inference_mode():
        torch.testing.assert_close(transposed(tokens).logits, native(tokens).logits, rtol=1e-5, atol=1e-5)


def test_transposed_layers_check_what_they_load():
    layer = TransposedLinear(nn.Linear(4, 3))
    with pytest.raises(RuntimeError, match=r"size mismatch for weight.*\(4, 3\).*\(3, 4\)"):
        layer.load_state_dict({"weight": torch.zeros(4, 3), "bias": torch.zeros(3)})
    with pytest.raises(RuntimeError, match="Unexpected key.*extra"):
        layer.load_state_dict({"weight": torch.zeros(3, 4), "bias": torch.zeros(3), "extra": torch.zeros(1)})
    with pytest.raises(RuntimeError, match="Missing key.*bias"):
        layer.load_state_dict({"weight": torch.ones(3, 4)})
    layer.load_state_dict({"weight": torch.arange(12.0).reshape(3, 4), "bias": torch.ones(3)})
    torch.testing.assert_close(layer(torch.eye(4)), torch.arange(12.0).reshape(3, 4).t() + 1)


@pytest.mark.parametrize("direction", ["transpose", "restore"])
def test_each_layer_is_freed_as_soon_as_its_replacement_is_in(direction, monkeypatch):
    """Switching the layout never holds the model's weights twice: a 1B fp32 model would need 12 GB."""
    from services.models import linear_layout

    model = build_tiny_llama(0).model  # transposed, as loaded
    if direction == "transpose":
        restore_linears(model)
    wanted = nn.Linear if direction == "transpose" else TransposedLinear
    originals = [weakref.ref(module) for module in model.modules() if type(module) is wanted]
    alive_at_each_conversion = []
    convert = TransposedLinear if direction == "transpose" else TransposedLinear.to_linear

    def counting(layer):
        alive_at_each_conversion.append(sum(ref() is not None for ref in originals))
        return convert(layer)

    if direction == "transpose":
        monkeypatch.setattr(linear_layout, "TransposedLinear", counting)
        assert transpose_linears(model) == len(originals)
    else:
        monkeypatch.setattr(TransposedLinear, "to_linear", staticmethod(counting))
        assert restore_linears(model) == len(originals)
    assert alive_at_each_conversion == list(range(len(originals), 0, -1))
    assert all(ref() is None for ref in originals)


def test_a_layer_registered_twice_is_converted_once_and_stays_shared():
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    assert transpose_linears(model) == 1
    assert isinstance(model[0], TransposedLinear) and model[0] is model[2]
    assert restore_linears(model) == 1
    assert type(model[0]) is nn.Linear and model[0] is model[2]


def test_a_float_target_below_fp32_is_said_not_to_be_lossless_and_fp32_and_int8_are_not():
    assert lossless_warning("fp32") is None and lossless_warning("int8") is None
    for precision in ("bf16", "fp16"):
        assert f"target at {precision}" in lossless_warning(precision)
        assert "may differ from target-only decoding" in lossless_warning(precision)
