"""The context-window rule: one check, read by the gateway (before any worker sees a request) and the engine."""

from __future__ import annotations

from services.errors import ContextLengthError


def check_request_fits(model_name: str, max_context: int, num_prompt_tokens: int, max_new_tokens: int = 0) -> None:
    """The one context-window rule, used by the engine and by the gateway before any worker sees a request."""
    if num_prompt_tokens == 0:
        raise ValueError("prompt is empty: need at least one token")
    if num_prompt_tokens >= max_context:
        raise ContextLengthError(
            f"prompt of {num_prompt_tokens} tokens does not fit {model_name!r}'s context of {max_context} tokens"
        )
    if num_prompt_tokens + max_new_tokens > max_context:
        raise ContextLengthError(
            f"prompt of {num_prompt_tokens} tokens + max_new_tokens {max_new_tokens} exceeds "
            f"{model_name!r}'s context of {max_context} tokens"
        )
