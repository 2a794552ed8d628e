import pytest
from pydantic import ValidationError

from services.config import Settings


def test_yaml_then_env_then_kwargs(tmp_path, monkeypatch):
    config = tmp_path / "mirror-sd.yaml"
    config.write_text(
        "scheduler: {max_batch_size: 4, timeout_ms: 50}\n"
        "merging: {similarity_threshold: 0.9}\n"
        "speculative: {max_draft_tokens: 6}\n"
        "draft: int8\n"
    )
    monkeypatch.setenv("MIRROR_SD_CONFIG", str(config))
    monkeypatch.setenv("MIRROR_SD_SPECULATIVE__MIN_DRAFT_TOKENS", "2")
    monkeypatch.setenv("MIRROR_SD_DRAFT", "bf16")
    settings = Settings(target="somewhere")
    assert settings.scheduler.max_batch_size == 4
    assert settings.merging.similarity_threshold == 0.9
    assert settings.speculative.max_draft_tokens == 6  # from YAML
    assert settings.speculative.min_draft_tokens == 2  # from the environment, merged
    assert settings.draft == "bf16"  # environment beats YAML
    assert settings.target == "somewhere"  # keyword beats all


def test_bad_values_are_refused(monkeypatch):
    monkeypatch.setenv("MIRROR_SD_SPECULATIVE__NUM_DRAFT_TOKENS", "12")
    with pytest.raises(ValidationError, match="num_draft_tokens"):
        Settings()


def test_missing_config_file_is_named(monkeypatch):
    monkeypatch.setenv("MIRROR_SD_CONFIG", "/nonexistent/mirror.yaml")
    with pytest.raises(ValueError, match="/nonexistent/mirror.yaml"):
        Settings()


def test_the_supervisors_crashed_draft_note_reaches_the_restarted_worker_through_its_environment(monkeypatch):
    from services.stack import draft_fallback

    env, summary = draft_fallback("suffix:gguf:smollm2-135m")(
        "draft-worker crashed with SIGSEGV 2 times in a row at start", "SIGSEGV")
    # suffix drafts alone: never the choice's model half that crashed
    assert summary == "draft suffix instead of suffix:gguf:smollm2-135m" and env["MIRROR_SD_DRAFT"] == "suffix"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    assert settings.draft == "suffix"
    crashed = settings.worker.crashed_draft
    assert (crashed.draft, crashed.fault) == ("suffix:gguf:smollm2-135m", "SIGSEGV")
    assert crashed.reason == "draft-worker crashed with SIGSEGV 2 times in a row at start"
