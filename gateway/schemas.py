"""OpenAI request shapes, validated with clear messages.

Every field is served, accepted as a no-op (it cannot change the answer), or refused unless it asks for nothing
(gateway/fields.py); a field of neither OpenAI's API nor Mirror-SD's extensions is refused, as OpenAI refuses
it (docs/api.md, "Request fields")."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from gateway import fields
from gateway.fields import Refusal, check_part, refuse_unsupported
from gateway.formats import response_format_grammar, structured_outputs_grammar
from gateway.tools import ToolPlan, plan_tool_call
from services.speculative.params import BIAS_LIMIT, MAX_LOGPROBS, PENALTY_LIMIT, REPETITION_RANGE, SamplingParams


MAX_CHOICES = 16  # `n`: each choice is a session and an admission slot


class Strict(BaseModel):
    """A request part whose unknown fields are refused (code unknown_parameter), never dropped."""

    model_config = ConfigDict(extra="forbid")

    def refuse(self, rules: dict[str, Refusal]) -> None:
        refuse_unsupported({name: getattr(self, name) for name in rules}, rules)


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # refused when true: no padding is sent

    @model_validator(mode="after")
    def _supported(self) -> "StreamOptions":
        self.refuse(fields.STREAM_OPTIONS)
        return self


class SamplingFields(Strict):
    model: str
    max_tokens: int | None = Field(None, le=2**31 - 1, description="default 16 (completions) or the limit (chat)")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=2**31 - 1, description="0 or -1: off (vLLM extension)")
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1, description="a 64-bit integer, as OpenAI's")
    stop: str | list[str] | None = Field(None, validate_default=True)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1, le=MAX_CHOICES, description=f"choices, 1..{MAX_CHOICES}: a session each "
                          "(gateway/api/choices.py)")
    presence_penalty: float | None = Field(0.0, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    frequency_penalty: float | None = Field(0.0, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    repetition_penalty: float | None = Field(1.0, ge=REPETITION_RANGE[0], le=REPETITION_RANGE[1],
                                             description="vLLM extension: > 1 discourages tokens already in the "
                                             "prompt or the output")
    # token id (as a string, OpenAI's shape) -> bias added to its logit; ids checked against the vocabulary
    # where the tokenizer is known (gateway/sessions/submit.py)
    logit_bias: dict[str, float] | None = None
    # vLLM extension: the answer constrained to a JSON schema (`json`), a regular expression or one of `choice`
    structured_outputs: dict | None = None
    ignore_eos: bool = False  # vLLM extension, for benchmarks
    return_token_ids: bool = False  # vLLM extension: the output's token ids in the choice
    # Mirror-SD extension: "ar" asks for plain target decoding (no draft), e.g. to compare; "sd" is the
    # default, where the routing table may still choose plain decoding for the pool.
    route: Literal["sd", "ar"] | None = None
    # vLLM extension: requests share work (a prefix's KV, an identical generation) only with requests of the same
    # salt; a tenant's own salt keeps its prompts from being guessed through another tenant's timings.
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    user: str | None = None  # no-op: OpenAI's abuse-monitoring id

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, value: int | None) -> int | None:
        if value is not None and value <= 0:
            raise ValueError(f"max_tokens must be >= 1, got {value}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops

    _grammar: str | None = PrivateAttr(None)  # the format's grammar text (gateway/formats.py)

    @field_validator("structured_outputs")
    @classmethod
    def _structured(cls, value: dict | None) -> dict | None:
        structured_outputs_grammar(value)  # a ValueError here is a 400 naming the field
        return value

    @model_validator(mode="after")
    def _format(self) -> "SamplingFields":
        self._grammar = structured_outputs_grammar(self.structured_outputs)
        return self

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"logit_bias keys are token ids (integers as strings), got {key!r}")
            if not -BIAS_LIMIT <= bias <= BIAS_LIMIT:
                raise ValueError(f"logit_bias[{key}] must be in [-{BIAS_LIMIT:g}, {BIAS_LIMIT:g}], got {bias}")
        return value

    @model_validator(mode="after")
    def _top_k_off(self) -> "SamplingFields":
        if self.top_k == -1:
            self.top_k = 0
        return self

    def num_logprobs(self) -> int | None:
        """Alternatives per token when log probabilities are asked for, else None (each endpoint says how)."""
        return None

    def sampling(self) -> SamplingParams:
        """The request's sampling values as the workers take them (ValueError when they do not fit)."""
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias={int(key): bias for key, bias in (self.logit_bias or {}).items()},
            logprobs=self.num_logprobs(), grammar=self._grammar)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str]
    # known, refused unless they ask for nothing (gateway/fields.py COMPLETIONS)
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="the chosen token's log probability "
                                 f"and this many alternatives, 0-{MAX_LOGPROBS}")
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> "CompletionRequest":
        if isinstance(self.prompt, list):
            if not self.prompt:
                raise ValueError("prompt must not be empty")
            if isinstance(self.prompt[0], str):
                if len(self.prompt) != 1:
                    raise ValueError(f"one prompt per request, got a batch of {len(self.prompt)}")
                self.prompt = self.prompt[0]
        if self.prompt == "":
            raise ValueError("prompt must not be empty")
        return self

    def num_logprobs(self) -> int | None:
        return self.logprobs

    @model_validator(mode="after")
    def _supported(self) -> "CompletionRequest":
        self.refuse(fields.COMPLETIONS)
        return self


class ContentPart(BaseModel):
    """One part of a message's content; only text is served (gateway/fields.py check_part)."""

    model_config = ConfigDict(extra="allow")  # an image part's own fields: its type is what is refused

    type: str
    text: str | None = None


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    # known, refused unless they ask for nothing (gateway/fields.py MESSAGE)
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    function_call: dict | None = None
    audio: dict | None = None
    refusal: str | None = None

    @field_validator("tool_calls")
    @classmethod
    def _calls(cls, value: list[dict] | None) -> list[dict] | None:
        import json

        for index, call in enumerate(value or []):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ValueError(f'tool_calls[{index}] must be {{"type": "function", "function": {{"name", '
                                 '"arguments"}}}}')
            try:
                json.loads(function.get("arguments") or "{}")
            except (TypeError, ValueError) as exc:
                raise ValueError(f"tool_calls[{index}].function.arguments is not JSON text: {exc}") from exc
        return value

    @model_validator(mode="after")
    def _supported(self) -> "ChatMessage":
        self.refuse(fields.MESSAGE)
        for index, part in enumerate(self.content if isinstance(self.content, list) else []):
            check_part(index, part.type, part.text, part.model_extra or {})
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text or "" for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    # no-ops: they cannot change the answer (docs/api.md, "Request fields")
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    # known, refused unless they ask for nothing (gateway/fields.py CHAT)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: dict | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = Field(None, validate_default=True)
    functions: list[dict] | None = None
    function_call: str | dict | None = None
    audio: dict | None = None
    modalities: list[str] | None = None
    prediction: dict | None = None
    web_search_options: dict | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    store: bool | None = None
    service_tier: str | None = None

    @model_validator(mode="after")
    def _max_tokens_alias(self) -> "ChatCompletionRequest":
        if self.max_tokens is None and self.max_completion_tokens is not None:
            if self.max_completion_tokens <= 0:
                raise ValueError(f"max_completion_tokens must be >= 1, got {self.max_completion_tokens}")
            self.max_tokens = self.max_completion_tokens
        return self

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, value: dict | None) -> dict | None:
        response_format_grammar(value)  # a ValueError here is a 400 naming the field
        return value

    _tools: ToolPlan | None = PrivateAttr(None)  # a tool call asked for (gateway/tools.py)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: str | dict | None, info) -> str | dict | None:
        plan_tool_call(info.data.get("tools"), value)  # a ValueError here is a 400 naming the field
        return value

    @model_validator(mode="after")
    def _one_format(self) -> "ChatCompletionRequest":
        grammar = response_format_grammar(self.response_format)
        self._tools = plan_tool_call(self.tools, self.tool_choice)
        formats = [g for g in (grammar, self._grammar, self._tools and self._tools.grammar) if g is not None]
        if len(formats) > 1:
            raise ValueError("one format at a time: response_format, structured_outputs or a tool call")
        self._grammar = formats[0] if formats else None
        return self

    @property
    def tool_plan(self) -> ToolPlan | None:
        return self._tools

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _supported(self) -> "ChatCompletionRequest":
        self.refuse(fields.CHAT)
        return self
