"""Every request field of /v1/chat/completions and /v1/completions is served, accepted as a no-op, or refused
with a 400 naming it (gateway/fields.py, docs/api.md "Request fields"); an unknown field is refused too.

A real gateway app over real Redis and SQLite with the built-in model's tokenizer, and no worker: a request that
passes validation goes as far as starting its session and is answered 503 "no ... worker is serving", which is
how these tests tell an accepted request from a refused one. The official `openai` client sees the refusals as
`openai.BadRequestError` with the field in `param`."""

from __future__ import annotations

import openai
import pytest
from fastapi.testclient import TestClient

from gateway.app import create_app
from services.config import Settings
from services.storage.db import init_db

MODEL = "smollm2-135m"
HELLO = [{"role": "user", "content": "Hello"}]
TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    from tests.redis_dbs import DATABASES

    database_url = f"sqlite:///{tmp_path_factory.mktemp('fields') / 'fields.db'}"
    init_db(database_url)
    with DATABASES.lease() as redis_url:
        settings = Settings(redis_url=redis_url, database_url=database_url, gateway={"auth_disabled": True})
        with TestClient(create_app(settings)) as client:
            yield client


def chat(http: TestClient, **fields):
    return http.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, **fields})


def complete(http: TestClient, **fields):
    return http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", **fields})


def assert_accepted(response) -> None:
    """Past validation: the request reached the point of starting its session, where no worker serves."""
    assert response.status_code == 503, response.text
    assert "worker is serving" in response.json()["error"]["message"]


def assert_refused(response, param: str, code: str = "unsupported_parameter") -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error"), error
    assert param in error["message"]
    return error


CHAT_REFUSED = [
    ("functions", {"functions": [TOOL["function"]]}),
    ("function_call", {"function_call": {"name": "weather"}}),
    ("audio", {"audio": {"voice": "alloy", "format": "wav"}}),
    ("modalities", {"modalities": ["text", "audio"]}),
    ("prediction", {"prediction": {"type": "content", "content": "Hello there"}}),
    ("web_search_options", {"web_search_options": {}}),
    ("reasoning_effort", {"reasoning_effort": "low"}),
    ("verbosity", {"verbosity": "high"}),
    ("store", {"store": True}),
    ("service_tier", {"service_tier": "flex"}),
    ("stream_options.include_obfuscation", {"stream": True, "stream_options": {"include_obfuscation": True}}),
    ("messages[0].name", {"messages": [{"role": "user", "content": "Hello", "name": "ada"}]}),
    ("messages[0].content[1].type", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]}),
]


@pytest.mark.parametrize(("param", "fields"), CHAT_REFUSED, ids=[f"{p}-{i}" for i, (p, _) in enumerate(CHAT_REFUSED)])
def test_a_chat_field_not_served_is_refused_naming_it(http, param, fields):
    error = assert_refused(chat(http, **fields), param)
    assert "got" in error["message"]  # the value it was sent, and (before it) what it may be and why


COMPLETION_REFUSED = [
    ("best_of", {"best_of": 2}),
    ("echo", {"echo": True}),
    ("suffix", {"suffix": " and that is all."}),
]


@pytest.mark.parametrize(("param", "fields"), COMPLETION_REFUSED,
                         ids=[f"{p}-{i}" for i, (p, _) in enumerate(COMPLETION_REFUSED)])
def test_a_completions_field_not_served_is_refused_naming_it(http, param, fields):
    assert_refused(complete(http, **fields), param)


CHAT_DEFAULTS = {
    "n": 1, "logprobs": False, "top_logprobs": 0, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
    "response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "functions": [],
    "function_call": "auto", "audio": None, "modalities": ["text"], "prediction": None,
    "web_search_options": None, "reasoning_effort": "none", "verbosity": "medium", "store": False,
    "service_tier": "auto", "stream_options": {"include_usage": True, "include_obfuscation": False},
}
NO_OPS = {"user": "user-1", "safety_identifier": "hash-1", "metadata": {"team": "docs"},
          "prompt_cache_key": "docs", "prompt_cache_retention": "24h", "parallel_tool_calls": True}
EXTENSIONS = {"top_k": -1, "ignore_eos": False, "return_token_ids": True, "route": "sd", "cache_salt": "tenant-1",
              "repetition_penalty": 1.0}
SERVED = {"logprobs": True, "top_logprobs": 20, "presence_penalty": -2, "frequency_penalty": 2,
          "logit_bias": {"42": -100, "0": 100}, "repetition_penalty": 1.2,
          "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": {
              "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}}


def test_chat_fields_at_their_defaults_no_ops_and_extensions_are_accepted(http):
    assert_accepted(chat(http, **CHAT_DEFAULTS, **NO_OPS, **EXTENSIONS, seed=7, stop=["\n\n"], temperature=0.5,
                         top_p=0.9, max_completion_tokens=8))
    assert_accepted(chat(http, **{name: None for name in CHAT_DEFAULTS}))
    assert_accepted(chat(http, **SERVED))
    assert_accepted(chat(http, response_format={"type": "json_object"}))
    assert_accepted(chat(http, structured_outputs={"regex": "[0-9]{3}"}))
    assert_accepted(chat(http, tools=[TOOL], tool_choice="required"))
    assert_accepted(chat(http, tools=[TOOL], tool_choice={"type": "function", "function": {"name": "weather"}}))
    assert_accepted(chat(http, messages=[*HELLO, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]))
    message = {"role": "user", "content": [{"type": "text", "text": "Hello"}], "name": None, "tool_calls": None,
               "tool_call_id": None, "function_call": None, "audio": None, "refusal": None}
    assert_accepted(chat(http, messages=[{"role": "system", "content": "Be brief."}, message,
                                         {"role": "assistant", "content": "Hi.", "tool_calls": []}, HELLO[0]]))


def test_completions_fields_at_their_defaults_are_accepted(http):
    assert_accepted(complete(http, n=1, best_of=1, echo=False, logprobs=None, suffix="", presence_penalty=0,
                             frequency_penalty=0, logit_bias={}, user="user-1", max_tokens=4, top_k=5,
                             stream=True, stream_options={"include_usage": True}))
    assert_accepted(complete(http, logprobs=0))  # 0 still asks for the chosen tokens' log probabilities
    assert_accepted(complete(http, logprobs=5, presence_penalty=1, frequency_penalty=-2, logit_bias={"42": 5}))


@pytest.mark.parametrize(("param", "fields"), [
    ("min_p", {"min_p": 0.05}),  # vLLM's extensions that change the output are not served: refused, not ignored
    ("temprature", {"temprature": 0.2}),  # a typo
    ("stream_options.continuous_usage_stats", {"stream_options": {"continuous_usage_stats": True}}),
    ("messages[0].cache_control", {"messages": [{**HELLO[0], "cache_control": {"type": "ephemeral"}}]}),
    ("messages[0].content[0].cache_control", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hello", "cache_control": {"type": "ephemeral"}}]}]}),
])
def test_an_unknown_chat_field_is_refused_naming_it(http, param, fields):
    error = assert_refused(chat(http, **fields), param, code="unknown_parameter")
    assert "docs/api.md" in error["message"]


def test_a_chat_only_field_is_unknown_to_completions(http):
    assert_refused(complete(http, metadata={"team": "docs"}), "metadata", code="unknown_parameter")
    assert_refused(complete(http, messages=HELLO), "messages", code="unknown_parameter")


def test_bad_values_of_served_fields_name_the_field_where_it_is(http):
    assert_refused(chat(http, messages=[{"role": "user", "content": [{"type": "text"}]}]),
                   "messages[0].content[0].text", code="missing_required_parameter")
    refused = chat(http, messages=[*HELLO, {"role": "robot", "content": "beep"}])
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages[1].role"
    for fields, param in [({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                          ({"presence_penalty": 2.5}, "presence_penalty"), ({"logit_bias": {"x": 1}}, "logit_bias"),
                          ({"logit_bias": {"49152": 1}}, "logit_bias"), ({"repetition_penalty": -1},
                                                                          "repetition_penalty")]:
        refused = chat(http, **fields)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, (fields, refused.text)
    assert complete(http, logprobs=21).json()["error"]["param"] == "logprobs"
    # formats the served tokenizer's grammar engine refuses: named, never answered unconstrained
    for fields, param in [({"response_format": {"type": "json_schema", "json_schema": {
                               "name": "x", "schema": {"type": "frobnicate"}}}}, "response_format"),
                          ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
                          ({"structured_outputs": {"choice": []}}, "structured_outputs")]:
        refused = chat(http, **fields)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, (fields, refused.text)
    assert complete(http, structured_outputs={"regex": "(unclosed"}).json()["error"]["param"] == "structured_outputs"
    for fields in [{"tool_choice": "required"}, {"tools": [TOOL]}, {"tools": [TOOL], "tool_choice": "auto"},
                   {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "time"}}}]:
        refused = chat(http, **fields)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "tool_choice", (fields, refused.text)
    empty = http.post("/v1/chat/completions")
    assert empty.status_code == 400 and empty.json()["error"]["message"] == "missing request body (a JSON object)"


def test_the_openai_client_sees_a_refusal_as_bad_request_with_the_param(http):
    client = openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="unused", http_client=http, max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=HELLO, functions=[TOOL["function"]])
    assert (refused.value.status_code, refused.value.param, refused.value.code) == (
        400, "functions", "unsupported_parameter")
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=HELLO, tools=[TOOL], tool_choice="auto")
    assert refused.value.param == "tool_choice" and '"auto" is not served' in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=HELLO, extra_body={"min_p": 0.05})
    assert (refused.value.param, refused.value.code) == ("min_p", "unknown_parameter")
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="Hello", echo=True)
    assert refused.value.param == "echo"
    # at their defaults the same fields pass validation (and meet the missing workers)
    with pytest.raises(openai.InternalServerError) as unserved:
        client.chat.completions.create(model=MODEL, messages=HELLO, logprobs=False, n=1,
                                       response_format={"type": "text"}, user="user-1")
    assert unserved.value.status_code == 503


@pytest.mark.parametrize("n", [0, 17, -1])
def test_n_outside_one_to_sixteen_is_a_400_naming_it(http, n):
    for response in (chat(http, n=n), complete(http, n=n)):
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "n"


def test_n_of_several_is_accepted(http):
    assert_accepted(chat(http, n=3))
    assert_accepted(complete(http, n=16, seed=2**63 - 1))  # the last choices' seeds wrap within 64 bits
