"""Stacks shared by more than one test module (each stack start loads models in several processes)."""

from __future__ import annotations

import pytest

from tests.integration.stack import Stack


@pytest.fixture(scope="session")
def front_door_stack(tmp_path_factory):
    """One verify worker (built-in model), n-gram drafts, auth off; 6 requests in flight and 6 waiting at most
    (a queued one waits 1 s), generations capped at 4 tokens: for the tests that hit the gateway hard
    (bursts over the admission limit, fuzzing of every operation)."""
    running = Stack(tmp_path_factory.mktemp("front-door"), redis_db=14, verify_workers=1, auth=False,
                    env={"MIRROR_SD_GATEWAY__MAX_INFLIGHT": "6", "MIRROR_SD_GATEWAY__QUEUE_LIMIT": "6",
                         "MIRROR_SD_GATEWAY__QUEUE_TIMEOUT_S": "1", "MIRROR_SD_DRAFT": "ngram",
                         "MIRROR_SD_MAX_NEW_TOKENS_LIMIT": "4"}).start()
    yield running
    running.stop()
