"""Start-up profiles kept on disk: a worker restarted with the same model, draft and threads reads them back
instead of measuring for seconds; a change to any of those facts measures again."""

from __future__ import annotations

import pytest
import torch

from services.config import LlamaCppSettings
from services.engine import profile as profiles
from services.models.drafters import DraftSource, load_draft_source
from services.models.engine import TorchEngine
from tests.conftest import build_tiny_llama


def refuse_to_measure(*args, **kwargs):
    raise AssertionError("measured again: the cached profile should have been read")


@pytest.fixture(autouse=True)
def kept_however_measured(monkeypatch):
    """Every profile here is cached: a tiny model's measurement is too short to tell a busy core from a
    starved one (the starved-profile rule has its own tests: tests/unit/test_profile_share.py)."""
    monkeypatch.setattr(profiles, "KEEP_ABOVE_SHARE", 0.0)


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_model_draft_profile_is_measured_once_then_read_back(tmp_path, monkeypatch, threads):
    target = build_tiny_llama(0)
    source = DraftSource("self:fp32", target.with_precision("fp32"))
    measured = profiles.cached_draft_profile(source, target.vocab_size, tmp_path)
    assert measured["draft_ms_per_token"] > 0 and len(list((tmp_path / "profiles").glob("draft-*.json"))) == 1

    with monkeypatch.context() as patched:
        patched.setattr(profiles, "measure_draft_profile", refuse_to_measure)
        assert profiles.cached_draft_profile(source, target.vocab_size, tmp_path) == measured
        assert profiles.cached_draft_profile(DraftSource("self:fp32", target.with_precision("fp32")),
                                             target.vocab_size, tmp_path) == measured  # a restarted worker's
    torch.set_num_threads(1 if torch.get_num_threads() != 1 else 2)
    profiles.cached_draft_profile(source, target.vocab_size, tmp_path)  # other threads: measured again
    other = build_tiny_llama(1, vocab_size=40)  # another model
    profiles.cached_draft_profile(DraftSource("self:fp32", other), other.vocab_size, tmp_path)
    assert len(list((tmp_path / "profiles").glob("draft-*.json"))) == 3
    # no cache dir (worker.profile_cache off): measured every time
    with monkeypatch.context() as patched:
        patched.setattr(profiles, "measure_draft_profile", refuse_to_measure)
        with pytest.raises(AssertionError, match="measured again"):
            profiles.cached_draft_profile(source, target.vocab_size, None)


def test_the_verify_grid_is_read_back_and_an_unreadable_file_is_measured_again(tmp_path, monkeypatch):
    engine = TorchEngine(build_tiny_llama(0))
    measured = profiles.cached_verify_profile(engine, tmp_path, max_rows=2)
    assert {"verify_ms_1", "step_ms_2x9"} <= set(measured)
    (path,) = (tmp_path / "profiles").glob("*.json")
    with monkeypatch.context() as patched:
        patched.setattr(profiles, "measure_verify_profile", refuse_to_measure)
        assert profiles.cached_verify_profile(engine, tmp_path, max_rows=2) == measured
    path.write_text("{half a file")
    assert set(profiles.cached_verify_profile(engine, tmp_path, max_rows=2)) == set(measured)
    assert path.read_text().startswith("{\"verify_ms_1\"")  # replaced by the new measurement


@pytest.mark.slow
def test_a_llama_cpp_draft_is_keyed_by_its_gguf_threads_and_slots(builtin_target):
    key = lambda source: profiles.draft_profile_key(source, builtin_target.vocab_size)  # noqa: E731
    one = load_draft_source("gguf:smollm2-135m", builtin_target, num_threads=1,
                            llamacpp=LlamaCppSettings(num_sequences=4, context_tokens=256))
    again = load_draft_source("gguf:smollm2-135m", builtin_target, num_threads=1,
                              llamacpp=LlamaCppSettings(num_sequences=4, context_tokens=256))
    two = load_draft_source("gguf:smollm2-135m", builtin_target, num_threads=2,
                            llamacpp=LlamaCppSettings(num_sequences=4, context_tokens=256))
    slots = load_draft_source("gguf:smollm2-135m", builtin_target, num_threads=1,
                              llamacpp=LlamaCppSettings(num_sequences=8, context_tokens=256))
    assert key(one) == key(again)
    assert len({key(one), key(two), key(slots)}) == 3


def test_the_kv_share_times_its_steps_and_releases_its_rows(monkeypatch):
    """`models step-profile --breakdown`: one untimed step, then `repeats` timed ones, each reading the KV store;
    the rows it prefilled are given back."""
    engine = TorchEngine(build_tiny_llama(0))
    steps = []
    time_step_once = profiles._time_step_once

    def counting(engine, sequences, num_tokens):
        steps.append((len(sequences), num_tokens))
        return time_step_once(engine, sequences, num_tokens)

    monkeypatch.setattr(profiles, "_time_step_once", counting)
    share = profiles.measure_kv_share(engine, rows=3, num_tokens=2, context_tokens=12, repeats=4)
    assert steps == [(3, 2)] * 5
    assert share["step_ms"] > 0 and share["kv_ms"] > 0 and 0 < share["kv_share"] < 1, share
    assert share["kv_ms"] < share["step_ms"]
    assert engine.store.used_bytes == 0


def test_wide_step_timings_are_taken_at_both_thread_counts_and_kept_only_when_measured_alone(tmp_path,
                                                                                            monkeypatch):
    from services.engine import wide_steps

    engine = TorchEngine(build_tiny_llama(0))
    before = torch.get_num_threads()
    timings, share = wide_steps.measure_wide_steps(engine, threads=1, wide=2, repeats=1)
    assert torch.get_num_threads() == before
    assert set(timings) == {f"{label}_ms_{rows}" for label in ("narrow", "wide") for rows in wide_steps.WIDE_ROWS}
    assert all(ms > 0 for ms in timings.values()) and 0 < share <= 1.5

    measured = []
    monkeypatch.setattr(wide_steps, "measure_wide_steps",
                        lambda *args, **kwargs: (measured.append(1) or {"narrow_ms_1": 50.0, "wide_ms_1": 30.0},
                                                 0.5))
    # contended (half its threads' time on a core): neither used nor kept, measured again next time
    assert wide_steps.cached_wide_steps(engine, tmp_path, threads=1, wide=2, max_rows=8) == {}
    assert not list((tmp_path / "profiles").glob("wide-*.json")) and len(measured) == 1
    monkeypatch.setattr(wide_steps, "KEEP_ABOVE_SHARE", 0.4)
    kept = wide_steps.cached_wide_steps(engine, tmp_path, threads=1, wide=2, max_rows=8)
    assert kept == {"narrow_ms_1": 50.0, "wide_ms_1": 30.0} and len(measured) == 2
    assert wide_steps.cached_wide_steps(engine, tmp_path, threads=1, wide=2, max_rows=8) == kept
    assert len(measured) == 2  # read back, not measured
    assert wide_steps.cached_wide_steps(engine, tmp_path, threads=1, wide=4, max_rows=8) == kept
    assert len(measured) == 3 and len(list((tmp_path / "profiles").glob("wide-*.json"))) == 2  # another key
