"""OpenAI request shapes, validated with clear messages. Unknown fields are ignored, as OpenAI clients send many."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.speculative.params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, le=2**31 - 1, description="default 16 (completions) or the limit (chat)")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=2**31 - 1, description="0 or -1: off (vLLM extension)")
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1, description="a 64-bit integer, as OpenAI's")
    stop: str | list[str] | None = Field(None, validate_default=True)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False  # vLLM extension, for benchmarks
    return_token_ids: bool = False  # vLLM extension: the output's token ids in the choice
    # Mirror-SD extension: "ar" asks for plain target decoding (no draft), e.g. to compare; "sd" is the
    # default, where the routing table may still choose plain decoding for the pool.
    route: Literal["sd", "ar"] | None = None
    # vLLM extension: requests share work (a prefix's KV, an identical generation) only with requests of the same
    # salt; a tenant's own salt keeps its prompts from being guessed through another tenant's timings.
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    user: str | None = None

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

    @model_validator(mode="after")
    def _supported(self) -> "SamplingFields":
        if self.n != 1:
            raise ValueError(f"n must be 1 (one choice per request), got {self.n}")
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported (must be 0)")
        if self.top_k == -1:
            self.top_k = 0
        return self

    def sampling(self) -> SamplingParams:
        """The request's sampling values as the workers take them (ValueError when they do not fit)."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str]
    echo: bool = False
    logprobs: int | None = None

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
        if self.echo or self.logprobs:
            raise ValueError("echo and logprobs are not supported")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    @model_validator(mode="after")
    def _max_tokens_alias(self) -> "ChatCompletionRequest":
        if self.max_tokens is None and self.max_completion_tokens is not None:
            if self.max_completion_tokens <= 0:
                raise ValueError(f"max_completion_tokens must be >= 1, got {self.max_completion_tokens}")
            self.max_tokens = self.max_completion_tokens
        return self
