"""Profile cache keys name the model's architecture, threads and torch, not the folder it was loaded from."""

from __future__ import annotations

from services.engine.profile import profile_cache_key
from tests.conftest import build_tiny_llama


def test_the_same_model_from_another_folder_has_the_same_key_and_another_architecture_another():
    here, there = build_tiny_llama(0), build_tiny_llama(0)
    here.model.config._name_or_path = "/root/.cache/mirror-sd/models/tiny"
    there.model.config._name_or_path = "/tmp/test-cache/models/tiny"  # e.g. MIRROR_SD_CACHE_DIR elsewhere
    assert profile_cache_key(here, max_rows=8) == profile_cache_key(there, max_rows=8)
    wider = build_tiny_llama(0, vocab_size=128)
    wider.model.config._name_or_path = here.model.config._name_or_path
    assert profile_cache_key(wider, max_rows=8) != profile_cache_key(here, max_rows=8)
