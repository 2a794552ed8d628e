"""The gateway client's reader: SSE lines to one answer (text, token ids, usage, timings, errors), exactly.
Its HTTP half runs against real stacks: the bench (test_stack.py, test_bench_tiny.py) and the drills
(test_failover.py, test_up.py)."""

from __future__ import annotations

import json

import pytest

from services.gateway_client import DONE, StreamedAnswer, chat_body, sse_payload


def data(chunk: dict | str) -> str:
    return f"data: {chunk if isinstance(chunk, str) else json.dumps(chunk)}"


def content(text: str, finish: str | None = None, **choice) -> dict:
    return {"id": "r1", "choices": [{"delta": {"content": text}, "finish_reason": finish, **choice}]}


STREAM = [data(content("Hel")), "", ": ping", data(content("lo")),
          data(content("!", "stop", token_ids=[5, 6, 7])),
          data({"id": "r1", "choices": [], "usage": {"completion_tokens": 3}, "mirror_sd": {"num_drafts": 2}}),
          data(DONE)]


def test_sse_lines_are_parsed_and_the_rest_ignored():
    assert sse_payload("data: [DONE]") == DONE and sse_payload(": ping") is None and sse_payload("") is None
    assert sse_payload('data: {"a": 1}') == {"a": 1} and sse_payload('data:{"a": 1}') == {"a": 1}


def test_an_answer_gathers_text_ids_usage_and_timings():
    answer = StreamedAnswer(started=10.0)
    for now, line in zip([10.2, 10.2, 10.2, 10.5, 10.6, 10.6, 10.7], STREAM):
        answer.feed(sse_payload(line), now=now)
    assert (answer.id, answer.text, answer.token_ids, answer.finish_reason) == ("r1", "Hello!", [5, 6, 7], "stop")
    assert answer.done and answer.chunks == 3 and answer.error is None
    assert answer.ttft_s == pytest.approx(0.2) and answer.gaps_s == pytest.approx([0.3, 0.1])
    assert answer.total_s == pytest.approx(0.7)
    assert answer.completion_tokens == 3 and answer.stats == {"num_drafts": 2}


def test_an_error_chunk_is_kept_and_raised_on_demand():
    answer = StreamedAnswer()
    for line in [data(content("a")), data({"error": {"message": "request lost", "code": "request_lost"}}), data(DONE)]:
        answer.feed(sse_payload(line))
    assert answer.error["code"] == "request_lost" and answer.done and answer.text == "a"
    with pytest.raises(RuntimeError, match="p1: request lost"):
        answer.raise_for_error("p1")


def test_text_completions_read_the_same():
    answer = StreamedAnswer()
    answer.feed({"id": "c", "choices": [{"text": "abc", "finish_reason": "length", "token_ids": [1]}]})
    assert answer.text == "abc" and answer.token_ids == [1] and answer.finish_reason == "length"


def test_a_chat_body_asks_for_a_stream_with_ids_and_usage():
    body = chat_body("m", "hi", 8, temperature=0)
    assert body["stream"] and body["return_token_ids"] and body["stream_options"] == {"include_usage": True}
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["temperature"] == 0
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "and?"}]
    assert chat_body("m", chat, 8)["messages"] == chat  # a whole chat, as given
