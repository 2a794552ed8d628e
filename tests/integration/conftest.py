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


@pytest.fixture(scope="session")
def warm_up_profile(builtin_target):
    """warm_up(threads): the device profile `mirror-sd up`'s one verify worker reads at start with `threads`
    torch threads, measured now (a no-op when it is kept already) and kept in the user cache the worker reads
    (tests that give `up` a cache of their own link its profiles there: private_cache). Measured by the worker
    itself, it competes with its starting siblings for the cores, and a profile measured on shared cores is not
    kept (services/engine/profile.py): every such start measures it again, a minute on 2 cores. Here it runs
    alone, in this process, with the model the worker loads. What the tests assert about serving is unchanged."""
    import torch

    from services.config import Settings
    from services.engine.profile import cached_verify_profile
    from services.models.engine import TorchEngine

    def warm_up(threads: int) -> None:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)  # the worker's (`verify-worker --threads N`): part of the profile's key
        try:
            cached_verify_profile(TorchEngine(builtin_target), default_cache_dir(),
                                  max_rows=Settings().scheduler.max_batch_size)
        finally:
            torch.set_num_threads(before)

    return warm_up


def up_verify_threads(*, model_draft: bool, local: bool) -> int:
    """The torch threads `mirror-sd up` gives its one verify worker on this box (services/stack.py)."""
    import os

    from services.stack import verify_worker_threads

    return verify_worker_threads(len(os.sched_getaffinity(0)), model_draft=model_draft, local=local, pin=False,
                                 pools=False, device="cpu")[0]
