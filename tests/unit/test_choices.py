"""Several choices merged into one answer (gateway/api/choices.py): seeds per choice, bodies, stream events."""

from __future__ import annotations

import asyncio
import json

from gateway.api.choices import choice_params, choices_room, merge_bodies, merge_streams
from gateway.schemas import ChatCompletionRequest

HELLO = [{"role": "user", "content": "Hello"}]


def test_a_seeded_requests_choices_take_seed_plus_index_wrapping_within_64_bits():
    params = ChatCompletionRequest(model="m", messages=HELLO, n=3, seed=2**63 - 2, temperature=1.0)
    assert [choice_params(params, index).seed for index in range(3)] == [2**63 - 2, 2**63 - 1, -(2**63)]
    assert {choice_params(params, index).n for index in range(3)} == {1}
    unseeded = ChatCompletionRequest(model="m", messages=HELLO, n=2)
    assert choice_params(unseeded, 1).seed is None


def body(request_id: str, text: str, tokens: int) -> dict:
    return {"id": request_id, "choices": [{"index": 0, "message": {"content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 7, "completion_tokens": tokens, "total_tokens": 7 + tokens},
            "mirror_sd": {"request_id": request_id}}


def test_bodies_merge_into_indexed_choices_with_summed_usage():
    merged = merge_bodies([body("a", "x", 3), body("b", "y", 5)])
    assert merged["id"] == "a" and [c["index"] for c in merged["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in merged["choices"]] == ["x", "y"]
    assert merged["usage"]["completion_tokens"] == 8 and merged["usage"]["total_tokens"] == 15
    assert [stats["request_id"] for stats in merged["mirror_sd"]["choices"]] == ["a", "b"]


def test_streams_merge_with_each_choices_index_one_usage_and_one_done():
    async def choice(text: str, tokens: int, request_id: str):
        for part in text:
            await asyncio.sleep(0)
            yield {"data": json.dumps({"choices": [{"index": 0, "delta": {"content": part}}]})}
        yield {"data": json.dumps({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": tokens,
                                                           "total_tokens": 7 + tokens},
                                   "mirror_sd": {"request_id": request_id}})}
        yield {"data": "[DONE]"}

    async def collect():
        return [event async for event in merge_streams([choice("abc", 3, "a"), choice("de", 2, "b")])]

    events = asyncio.run(collect())
    assert events[-1] == {"data": "[DONE]"} and sum(e["data"] == "[DONE]" for e in events) == 1
    payloads = [json.loads(e["data"]) for e in events[:-1]]
    texts = {0: "", 1: ""}
    for payload in payloads[:-1]:
        texts[payload["choices"][0]["index"]] += payload["choices"][0]["delta"]["content"]
    assert texts == {0: "abc", 1: "de"}
    usage = payloads[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert [stats["request_id"] for stats in usage["mirror_sd"]["choices"]] == ["a", "b"]


def test_a_closed_merged_stream_closes_every_choices_stream():
    closed = []

    async def endless(name: str):
        try:
            while True:
                await asyncio.sleep(0.001)
                yield {"data": json.dumps({"choices": [{"index": 0, "delta": {"content": name}}]})}
        finally:
            closed.append(name)

    async def scenario():
        merged = merge_streams([endless("a"), endless("b")])
        await merged.__anext__()
        await merged.aclose()  # the client left

    asyncio.run(scenario())
    assert sorted(closed) == ["a", "b"]


def test_a_request_never_asks_for_more_choices_than_it_could_be_admitted_with():
    assert choices_room(tier_limit=5, per_key_limit=0) == 5
    assert choices_room(tier_limit=230, per_key_limit=4) == 4
    assert choices_room(tier_limit=3, per_key_limit=8) == 3
