"""What `auto` drafts with, and what a worker serves when its model draft cannot run: resolved without loading a
model (llama.cpp's presence and its engine's check stood in for)."""

from __future__ import annotations

import logging

import pytest

from services.config import Settings
from services.models.drafters.factory import FALLBACK_DRAFT, is_model_draft, needs_target_vocab, resolve_draft_spec
from services.models.drafters.serving import load_serving_draft
from services.models.drafters.suffix import SuffixDrafter
from services.models.llamacpp_check import EngineCheck, LlamaCppFaultError
from services.models.loading import TargetVocab

BUILTIN_NAMES = ("smollm2-135m", "SmolLM2-135M-Instruct")  # the alias and the model's own name


def llama_cpp(monkeypatch, installed: bool) -> None:
    monkeypatch.setattr("services.models.drafters.factory.llama_cpp_available", lambda: installed)


@pytest.mark.parametrize("target", BUILTIN_NAMES)
def test_auto_for_the_builtin_target_with_llama_cpp_is_the_per_round_choice(monkeypatch, target):
    llama_cpp(monkeypatch, installed=True)
    assert resolve_draft_spec("auto", target) == "suffix:gguf:smollm2-135m"
    assert is_model_draft(resolve_draft_spec("auto", target))  # `up` gives it a draft core where it splits them


@pytest.mark.parametrize("target", BUILTIN_NAMES)
def test_auto_for_the_builtin_target_without_llama_cpp_is_suffix_drafts_and_says_what_to_install(
        monkeypatch, caplog, target):
    llama_cpp(monkeypatch, installed=False)
    with caplog.at_level(logging.WARNING, logger="services.models.drafters.factory"):
        assert resolve_draft_spec("auto", target) == "suffix"
    assert "`mirror-sd llamacpp build` installs llama-cpp-python" in caplog.text


@pytest.mark.parametrize("installed", [True, False])
def test_auto_for_another_target_is_suffix_drafts_which_need_no_vocabulary(monkeypatch, installed):
    llama_cpp(monkeypatch, installed=installed)
    assert resolve_draft_spec("auto", "/some/other/model") == "suffix"
    assert resolve_draft_spec("auto", "HuggingFaceTB/SmolLM2-360M-Instruct") == "suffix"
    assert not needs_target_vocab("suffix") and not is_model_draft("suffix")


@pytest.mark.parametrize("spec", ["ngram", "none", "suffix", "gguf:smollm2-135m", "suffix:gguf:smollm2-135m",
                                  "hybrid", "int8", "synthetic:0.8@5ms", "/some/model/dir"])
def test_any_other_spec_is_taken_as_given(monkeypatch, spec):
    llama_cpp(monkeypatch, installed=True)
    assert resolve_draft_spec(spec, "smollm2-135m") == spec


def faulting_engine(spec, *_, **__):
    raise LlamaCppFaultError(EngineCheck(ok=False, fault="SIGSEGV", where="llama_decode"), spec)


@pytest.mark.parametrize("draft", ["auto", "suffix:gguf:smollm2-135m", "gguf:smollm2-135m"])
def test_a_model_draft_whose_engine_faults_falls_back_to_suffix_drafts_alone(monkeypatch, draft):
    llama_cpp(monkeypatch, installed=True)
    monkeypatch.setattr("services.models.drafters.factory.load_gguf_engine", faulting_engine)
    settings = Settings(draft=draft)
    vocab = TargetVocab("smollm2-135m", None, 49152)
    source, vocab_size, fallback = load_serving_draft(settings, target=vocab)
    assert FALLBACK_DRAFT == "suffix"
    # the choice's fallback is its suffix half alone, never its model half that faulted
    assert source.spec == "suffix" and source.engine is None and source.model is None and vocab_size == 49152
    assert source.suffix == settings.suffix and isinstance(source.new_drafter(), SuffixDrafter)
    assert fallback.draft == resolve_draft_spec(draft, "smollm2-135m") and fallback.serving == "suffix"
    assert fallback.fault == "SIGSEGV"
    assert fallback.describe() == (f"draft {fallback.draft} cannot run here: llama.cpp crashed with SIGSEGV in "
                                   "llama_decode; drafting with suffix instead")
    with pytest.raises(LlamaCppFaultError, match=r"draft 'gguf:smollm2-135m': llama.cpp crashed with SIGSEGV"):
        load_serving_draft(Settings(draft=draft, worker={"draft_fallback": False}), target=vocab)
