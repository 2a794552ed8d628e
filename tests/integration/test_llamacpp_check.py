"""llama.cpp is run once in a child process before a process trusts it: a build that faults is named (signal,
function, instruction sets), its verdict kept per GGUF, build and CPU, and a draft worker then serves with suffix
drafts alone instead of dying. The faulting build is tests/fixtures/faulty_llama_cpp (these machines have no AMX)."""

from __future__ import annotations

import json

import pytest

from services.config import Settings
from services.models.drafters.gguf import gguf_path
from services.models.drafters.serving import load_serving_draft
from services.models.drafters.suffix import SuffixDrafter
from services.models.llamacpp_check import (
    EngineParams,
    LlamaCppFaultError,
    _innermost_function,
    cached_engine_check,
    check_engine,
)
from tests.integration.conftest import FAULTY_LLAMA_CPP, private_cache

pytestmark = pytest.mark.slow


@pytest.fixture
def params() -> EngineParams:
    return EngineParams(str(gguf_path("gguf:smollm2-135m")), threads=1, num_sequences=4, context_tokens=128)


def test_the_installed_build_decodes_and_uses_no_amx(params):
    check = check_engine(params)
    assert check.ok, check.describe() + check.detail
    assert check.features.get("AVX2") and not check.features.get("AMX_INT8"), check.system_info
    assert len(check.argmax) == 24 and len(set(check.argmax)) > 1  # a real model: not one token everywhere


def test_a_build_that_segfaults_is_named_not_fatal(params, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(FAULTY_LLAMA_CPP))
    check = check_engine(params)
    assert not check.ok and check.fault == "SIGSEGV" and check.where == "llama_decode"
    assert check.describe() == "llama.cpp crashed with SIGSEGV in llama_decode (build uses AMX_INT8, AVX512, AVX2, AVX)"
    assert "Fatal Python error: Segmentation fault" in check.detail


def test_a_build_that_hangs_is_named_after_the_timeout(params, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(FAULTY_LLAMA_CPP))
    monkeypatch.setenv("FAULTY_LLAMA_CPP", "hang")
    check = check_engine(params, timeout_s=5)
    assert not check.ok and check.fault == "hung" and check.describe().startswith("llama.cpp hung (no answer in 5s)")


def test_the_verdict_is_kept_per_build_and_settings(params, monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONPATH", str(FAULTY_LLAMA_CPP))
    first = cached_engine_check(params, tmp_path)
    kept = list((tmp_path / "checks").glob("llamacpp-*.json"))
    assert not first.ok and len(kept) == 1 and first.cache_file == str(kept[0])
    assert json.loads(kept[0].read_text())["fault"] == "SIGSEGV"

    def no_child(*_, **__):
        raise AssertionError("a kept verdict runs no child")

    monkeypatch.setattr("services.models.llamacpp_check.check_engine", no_child)
    again = cached_engine_check(params, tmp_path)
    assert again.fault == "SIGSEGV" and again.kept_note().startswith(f"the verdict is kept in {kept[0]}")
    monkeypatch.undo()  # the real bindings: another build, another key, checked again
    other = cached_engine_check(params, tmp_path)
    assert other.ok and len(list((tmp_path / "checks").glob("llamacpp-*.json"))) == 2


@pytest.mark.parametrize("draft", ["auto", "gguf:smollm2-135m"])  # auto: the choice, suffix:gguf:smollm2-135m
def test_a_draft_worker_whose_engine_faults_drafts_with_suffix_drafts_and_says_why(monkeypatch, tmp_path, draft):
    monkeypatch.setenv("PYTHONPATH", str(FAULTY_LLAMA_CPP))
    settings = Settings(draft=draft, cache_dir=private_cache(tmp_path), num_threads=1)
    source, vocab_size, fallback = load_serving_draft(settings)
    # suffix drafts alone, with the settings' suffix options: never the choice's model half that faulted
    assert source.spec == "suffix" and source.engine is None and source.model is None and vocab_size == 49152
    assert source.suffix == settings.suffix and isinstance(source.new_drafter(), SuffixDrafter)
    assert fallback.draft == ("suffix:gguf:smollm2-135m" if draft == "auto" else draft)
    assert fallback.serving == "suffix" and fallback.fault == "SIGSEGV"
    assert fallback.reason.startswith("llama.cpp crashed with SIGSEGV in llama_decode (build uses AMX_INT8")
    with pytest.raises(LlamaCppFaultError, match=r"draft 'gguf:smollm2-135m': llama.cpp crashed with SIGSEGV"):
        load_serving_draft(Settings(draft=draft, cache_dir=settings.cache_dir, num_threads=1,
                            worker={"draft_fallback": False}))


def test_faulthandler_and_traceback_frames_name_the_function():
    fault = ('Fatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call first):\n'
             '  File "/x/llama_cpp/llama_cpp.py", line 1702 in llama_decode\n'
             '  File "/x/services/models/llamacpp.py", line 250 in _decode\n')
    assert _innermost_function(fault) == "llama_decode"
    error = 'Traceback (most recent call last):\n  File "/x/a.py", line 3, in main\n  File "/x/b.py", line 9, in load\n'
    assert _innermost_function(error) == "load"
    assert _innermost_function("no frames") is None
