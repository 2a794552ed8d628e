"""The request-field decisions (gateway/fields.py) as pure functions, OpenAI's way of naming a field's place,
and docs/api.md's field table kept in step with the schemas."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from gateway import fields
from gateway.errors import _split, param_path
from gateway.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, StreamOptions
from tests.conftest import REPO_ROOT


def test_a_value_that_asks_for_nothing_is_accepted_and_any_other_is_refused_with_why():
    defaults = {"functions": [], "function_call": "auto",
                "store": False, "service_tier": "default", "modalities": ["text"], "verbosity": "medium"}
    assert fields.first_refused(defaults, fields.CHAT) is None
    assert fields.first_refused({}, fields.CHAT) is None  # absent is the default
    param, detail = fields.first_refused({**defaults, "functions": [{"name": "f"}], "store": True},
                                         fields.CHAT)
    assert param == "functions"  # the first in the table's order
    assert detail == ('must be empty or absent: the deprecated function calling is not served (use tools) '
                      '(got [{"name": "f"}])')
    assert fields.first_refused({"function_call": {"name": "f"}}, fields.CHAT)[0] == "function_call"


def test_a_default_matches_in_type_too_where_json_tells_them_apart():
    assert fields.first_refused({"store": 0}, fields.CHAT)[0] == "store"  # 0 is not false
    assert fields.first_refused({"best_of": True}, fields.COMPLETIONS)[0] == "best_of"  # true is not 1
    assert fields.first_refused({"echo": 0}, fields.COMPLETIONS) is None  # echo asks for nothing at 0


def test_served_sampling_fields_reach_the_workers_and_bad_ones_name_themselves():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    request = ChatCompletionRequest.model_validate({**body, "presence_penalty": 0.5, "frequency_penalty": -1,
                                                    "repetition_penalty": 1.3, "logit_bias": {"42": -100},
                                                    "logprobs": True, "top_logprobs": 3})
    sampling = request.sampling()
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (0.5, -1, 1.3)
    assert sampling.logit_bias == ((42, -100.0),) and sampling.logprobs == 3
    assert ChatCompletionRequest.model_validate({**body, "logprobs": True}).sampling().logprobs == 0
    assert ChatCompletionRequest.model_validate(body).sampling().logprobs is None
    assert CompletionRequest.model_validate({"model": "m", "prompt": "a", "logprobs": 0}).sampling().logprobs == 0
    for bad, field in [({"presence_penalty": 2.5}, "presence_penalty"), ({"logit_bias": {"x": 1}}, "logit_bias"),
                       ({"logit_bias": {"3": 101}}, "logit_bias"), ({"top_logprobs": 21, "logprobs": True},
                                                                     "top_logprobs"),
                       ({"repetition_penalty": 0}, "repetition_penalty")]:
        with pytest.raises(ValidationError) as refused:
            ChatCompletionRequest.model_validate({**body, **bad})
        assert refused.value.errors()[0]["loc"][0] == field, bad
    with pytest.raises(ValidationError, match="top_logprobs needs logprobs"):
        ChatCompletionRequest.model_validate({**body, "top_logprobs": 2})


def test_a_content_part_other_than_text_is_refused_by_its_type():
    with pytest.raises(ValidationError) as refused:
        ChatMessage.model_validate({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]})
    error = refused.value.errors()[0]
    assert error["type"] == fields.UNSUPPORTED and error["ctx"]["param"] == "content[0].type"
    assert ChatMessage.model_validate({"role": "user", "content": [{"type": "text", "text": "a"},
                                                                   {"type": "text", "text": "b"}]}).text() == "ab"


def test_param_paths_are_written_as_openai_writes_them():
    assert param_path(("body", "messages", 0, "content", 1, "type")) == "messages[0].content[1].type"
    assert param_path(("body", "stream_options", "include_usage")) == "stream_options.include_usage"
    assert param_path(("body",)) is None
    assert _split("content[1].type") == ["content", 1, "type"]
    assert _split("tool_calls") == ["tool_calls"]


def schema_fields() -> set[str]:
    names = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    names |= {f"stream_options.{name}" for name in StreamOptions.model_fields}
    names |= {f"messages[].{name}" for name in ChatMessage.model_fields}
    return names | {"messages[].content[].type"}  # refused by value, in the message's own check


def documented_fields() -> set[str]:
    text = (REPO_ROOT / "docs" / "api.md").read_text()
    section = text.split("## Request fields", 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    for row in re.findall(r"^\| (`[^|]*) \|", section, flags=re.MULTILINE):
        names |= set(re.findall(r"`([^`]+)`", row))
    return names


def test_the_docs_table_names_every_field_the_schemas_accept_and_no_other():
    assert documented_fields() == schema_fields()


def test_every_refusal_rule_is_a_field_of_its_schema():
    """A rule for a field the schema does not declare would never see a value (and the field would be refused
    as unknown instead)."""
    assert set(fields.CHAT) <= set(ChatCompletionRequest.model_fields)
    assert set(fields.COMPLETIONS) <= set(CompletionRequest.model_fields)
    assert set(fields.MESSAGE) <= set(ChatMessage.model_fields)
    assert set(fields.STREAM_OPTIONS) <= set(StreamOptions.model_fields)


def test_formats_become_grammar_text_and_bad_ones_name_their_field():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = ChatCompletionRequest.model_validate(
        {**body, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert '"a"' in chat.sampling().grammar
    assert ChatCompletionRequest.model_validate({**body, "response_format": {"type": "json_object"}}).sampling().grammar
    text = ChatCompletionRequest.model_validate({**body, "response_format": {"type": "text"}})
    assert text.sampling().grammar is None
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "a",
                                                   "structured_outputs": {"choice": ["yes", "no"]}})
    assert "yes" in completion.sampling().grammar
    for bad, field in [({"response_format": {"type": "xml"}}, "response_format"),
                       ({"response_format": {"type": "json_schema"}}, "response_format"),
                       ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs"),
                       ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
                       ({"structured_outputs": {"json": "{not json"}}, "structured_outputs")]:
        with pytest.raises(ValidationError) as refused:
            ChatCompletionRequest.model_validate({**body, **bad})
        assert refused.value.errors()[0]["loc"][0] == field, bad


def test_a_tool_call_is_planned_and_auto_or_a_call_without_tools_names_the_field():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    tool = {"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    named = ChatCompletionRequest.model_validate({**body, "tools": [tool], "tool_choice": {
        "type": "function", "function": {"name": "weather"}}})
    assert named.tool_plan.named == "weather" and '"city"' in named.sampling().grammar
    required = ChatCompletionRequest.model_validate({**body, "tools": [tool], "tool_choice": "required"})
    assert required.tool_plan.named is None and '"weather"' in required.sampling().grammar
    assert ChatCompletionRequest.model_validate({**body, "tools": [tool], "tool_choice": "none"}).tool_plan is None
    for bad in [{"tools": [tool]}, {"tools": [tool], "tool_choice": "auto"}, {"tool_choice": "required"},
                {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "time"}}},
                {"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "required"}]:
        with pytest.raises(ValidationError) as refused:
            ChatCompletionRequest.model_validate({**body, **bad})
        assert refused.value.errors()[0]["loc"][0] == "tool_choice", bad
