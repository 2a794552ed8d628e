"""Single-flight keys (which requests may share a generation) and the per-gateway stream tally."""

from __future__ import annotations

import pytest

from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.sessions.single_flight import Flight, flight_key
from gateway.streams.tally import StreamTally
from services.speculative.params import GREEDY_BELOW

PROMPT_IDS = [5, 6, 7, 8]


def key(prompt_ids=PROMPT_IDS, max_new_tokens=16, priority="normal", model="m", **fields) -> str | None:
    params = CompletionRequest(model=model, prompt=list(prompt_ids), **{"temperature": 0, **fields})
    return flight_key(model=model, prompt_ids=list(prompt_ids), max_new_tokens=max_new_tokens, params=params,
                      priority=priority)


def test_identical_greedy_requests_share_a_key_whatever_the_formatting():
    assert key() == key() and len(key()) == 32
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], temperature=0,
                                 stream=True, stream_options={"include_usage": True}, return_token_ids=True)
    # same prompt ids: a chat request and a completion get the same tokens; formatting is per client
    assert flight_key(model="m", prompt_ids=PROMPT_IDS, max_new_tokens=16, params=chat, priority="normal") == key()
    assert key(stream=True) == key(return_token_ids=True) == key(user="someone") == key()
    assert key(route="sd") == key()  # "sd" is the default route


def test_greedy_output_ignores_the_sampling_knobs_so_the_key_does():
    assert key(temperature=GREEDY_BELOW / 2) == key()
    assert key(top_p=0.5) == key(top_k=3) == key(seed=1) == key(seed=2) == key()


@pytest.mark.parametrize("change", [
    {"prompt_ids": [5, 6, 7, 9]}, {"prompt_ids": [5, 6, 7]}, {"max_new_tokens": 17}, {"priority": "high"},
    {"model": "other"}, {"stop": ["w1"]}, {"ignore_eos": True}, {"route": "ar"}, {"temperature": 0.5, "seed": 1},
    {"cache_salt": "tenant-a"},
])
def test_anything_that_changes_the_tokens_or_their_service_changes_the_key(change):
    assert key(**change) not in (None, key())


def test_seeded_samples_share_a_key_only_with_the_same_seed_and_knobs():
    sampled = {"temperature": 0.7, "top_p": 0.9, "top_k": 20}
    assert key(**sampled, seed=3) == key(**sampled, seed=3) != key()
    assert key(**sampled, seed=3) != key(**sampled, seed=4)
    assert key(**{**sampled, "top_p": 0.8}, seed=3) != key(**sampled, seed=3)
    assert key(**{**sampled, "top_k": 21}, seed=3) != key(**sampled, seed=3)
    assert key(**{**sampled, "temperature": 0.71}, seed=3) != key(**sampled, seed=3)
    assert key(**{**sampled, "temperature": GREEDY_BELOW}, seed=3) != key(**sampled, seed=3)


def test_sampled_without_a_seed_is_never_merged():
    assert key(temperature=0.7) is None
    assert key(temperature=GREEDY_BELOW) is None  # the first temperature that samples
    params = CompletionRequest(model="m", prompt=PROMPT_IDS)  # OpenAI's default temperature is 1
    assert flight_key(model="m", prompt_ids=PROMPT_IDS, max_new_tokens=16, params=params, priority="low") is None


def test_a_flight_knows_who_leads():
    assert Flight("k", "cmpl-a", "cmpl-a").leading and Flight("k", "cmpl-a", "cmpl-a").merged_into is None
    follower = Flight("k", "cmpl-a", "chatcmpl-b")
    assert not follower.leading and follower.merged_into == "cmpl-a"


def test_each_event_and_the_end_are_counted_once_by_whichever_reader_gets_there_first():
    tally = StreamTally()
    with tally.reading("s") as leader:
        assert [leader.first_sight(seq) for seq in (0, 1)] == [True, True]
        with tally.reading("s") as follower, tally.reading("other") as alone:
            # the follower reads from the stream's start: what the leader counted is not counted again
            assert [follower.first_sight(seq) for seq in (0, 1, 2)] == [False, False, True]
            assert leader.first_sight(2) is False and alone.first_sight(0) is True
            assert len(tally) == 2
        # the follower has gone: the leader counts on from where both had got to
        assert leader.first_sight(3) is True
        assert leader.claim_end() is True and leader.claim_end() is False
    assert len(tally) == 0  # nothing kept once nobody here reads the stream
    with tally.reading("s") as later:  # a later generation under the same name starts a fresh count
        assert later.first_sight(0) is True and later.claim_end() is True
