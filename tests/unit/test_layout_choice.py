"""cpu_weight_layout "auto": the faster layout by the sum of 1-9 token forwards, measured once and cached."""

from __future__ import annotations

import json

import torch

from services.engine import layout_choice
from services.engine.layout_choice import LAYOUT_SIZES, faster_layout, resolve_layout
from tests.conftest import build_tiny_llama


def test_the_smaller_sum_wins_and_a_tie_keeps_transposed():
    amx = {"native": {1: 66, 3: 73, 5: 109, 9: 144}, "transposed": {1: 53, 3: 127, 5: 125, 9: 136}}
    assert faster_layout(amx) == "native"  # as measured on a 2-core AMX Xeon
    older = {"native": {1: 55, 3: 70, 5: 110, 9: 134}, "transposed": {1: 54, 3: 78, 5: 79, 9: 98}}
    assert faster_layout(older) == "transposed"
    assert faster_layout({"native": {1: 1.0}, "transposed": {1: 1.0}}) == "transposed"


def test_only_fp32_on_the_cpu_has_a_layout_to_choose_and_tiny_models_are_not_measured(tmp_path):
    model = build_tiny_llama(0).model
    cpu = torch.device("cpu")
    assert resolve_layout(model, "t", None, precision="bf16", device=cpu, layout="auto", cache_dir=tmp_path) == "native"
    assert resolve_layout(model, "t", None, precision="fp32", device=cpu, layout="native", cache_dir=tmp_path) == \
        "native"
    assert resolve_layout(model, "t", None, precision="fp32", device=cpu, layout="auto", cache_dir=tmp_path) == \
        "transposed"
    assert not (tmp_path / "profiles").exists()  # nothing measured


def test_a_measured_choice_is_cached_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setattr(layout_choice, "MIN_PARAMS", 0)
    loaded = build_tiny_llama(0)
    chosen = resolve_layout(loaded.model, loaded.name, None, precision="fp32", device=torch.device("cpu"),
                            layout="auto", cache_dir=tmp_path)
    assert chosen in ("native", "transposed")
    [cached] = list((tmp_path / "profiles").glob("layout-*.json"))
    figures = json.loads(cached.read_text())
    assert set(figures) == {f"{layout}_ms_{n}" for layout in ("native", "transposed") for n in LAYOUT_SIZES}
    assert all(value > 0 for value in figures.values())
    # the cached figures decide from now on: make native look free and it is chosen without measuring
    cached.write_text(json.dumps({key: (0.0 if key.startswith("native") else 1.0) for key in figures}))
    monkeypatch.setattr(layout_choice, "measure_layouts", lambda native: (_ for _ in ()).throw(AssertionError))
    assert resolve_layout(build_tiny_llama(0).model, loaded.name, None, precision="fp32", device=torch.device("cpu"),
                          layout="auto", cache_dir=tmp_path) == "native"


def test_both_layouts_are_timed_on_the_one_model_which_is_left_native_and_still_tied(monkeypatch):
    """No copy of the weights: a transposed copy beside the model would hold a 1B fp32 model's 6 GB twice."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from services.engine import profile
    from services.models.linear_layout import TransposedLinear
    from services.models.loading import LoadedModel

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    timed = []  # (the embeddings' object, the head's type) per timing, as the engine timing it holds them
    time_step_once = profile._time_step_once

    def noting(engine, sequences, num_tokens):
        timed.append((id(engine.parts.embed), type(engine.parts.head).__name__))
        return time_step_once(engine, sequences, num_tokens)

    monkeypatch.setattr(profile, "_time_step_once", noting)
    timings = layout_choice.measure_layouts(LoadedModel("t", model, None), repeats=2)

    assert {embed for embed, _ in timed} == {id(model.model.embed_tokens)}  # a copy would hold other modules
    assert sorted(head for _, head in timed) == ["Linear"] * 12 + ["TransposedLinear"] * 12  # 3 passes x 4 sizes
    assert set(timings) == {"native", "transposed"} and all(set(t) == set(LAYOUT_SIZES) for t in timings.values())
    assert not any(isinstance(module, TransposedLinear) for module in model.modules())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    after = model.state_dict()
    assert all(torch.equal(after[name], value) for name, value in before.items())
