"""Stacks shared by more than one test module (each stack start loads models in several processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.config import default_cache_dir
from tests.conftest import REPO_ROOT
from tests.integration.stack import Stack

# A llama-cpp-python stand-in that dies with SIGSEGV on its first decode (its README): first on PYTHONPATH.
FAULTY_LLAMA_CPP = REPO_ROOT / "tests" / "fixtures" / "faulty_llama_cpp"


def private_cache(root: Path) -> Path:
    """A cache dir of its own (engine checks, wheels) that shares the user cache's converted models and
    measured profiles, so a test's verdicts stay its own without converting or profiling again."""
    cache = root / "cache"
    cache.mkdir(exist_ok=True)
    for shared in ("models", "profiles"):
        (default_cache_dir() / shared).mkdir(parents=True, exist_ok=True)
        if not (cache / shared).exists():
            (cache / shared).symlink_to(default_cache_dir() / shared)
    return cache


@pytest.fixture(scope="session")
def front_door_stack(tmp_path_factory):
    """One verify worker (built-in model), n-gram drafts, auth off; 6 requests in flight and 6 waiting at most
    (a queued one waits 1 s), generations capped at 4 tokens: for the tests that hit the gateway hard
    (bursts over the admission limit, fuzzing of every operation)."""
    running = Stack(tmp_path_factory.mktemp("front-door"), verify_workers=1, auth=False,
                    env={"MIRROR_SD_GATEWAY__MAX_INFLIGHT": "6", "MIRROR_SD_GATEWAY__QUEUE_LIMIT": "6",
                         "MIRROR_SD_GATEWAY__QUEUE_TIMEOUT_S": "1", "MIRROR_SD_DRAFT": "ngram",
                         "MIRROR_SD_MAX_NEW_TOKENS_LIMIT": "4"}).start()
    yield running
    running.stop()
