"""OpenAI response and chunk bodies for completions and chat completions."""

from __future__ import annotations

import time


def usage(prompt_tokens: int, completion_tokens: int, stats: dict) -> dict:
    """OpenAI's usage; prompt tokens whose KV was reused (prefix reuse) are its cached_tokens."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.get("num_cached_tokens", 0)}}


def completion_body(*, request_id: str, model: str, text: str, finish_reason: str | None, prompt_tokens: int,
                    completion_tokens: int, stats: dict) -> dict:
    return {
        "id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage(prompt_tokens, completion_tokens, stats),
        "mirror_sd": stats,
    }


def chat_body(*, request_id: str, model: str, text: str, finish_reason: str | None, prompt_tokens: int,
              completion_tokens: int, stats: dict) -> dict:
    return {
        "id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                     "finish_reason": finish_reason}],
        "usage": usage(prompt_tokens, completion_tokens, stats),
        "mirror_sd": stats,
    }


def completion_chunk(*, request_id: str, model: str, text: str, finish_reason: str | None) -> dict:
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def chat_chunk(*, request_id: str, model: str, delta: dict, finish_reason: str | None) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def usage_chunk(*, request_id: str, model: str, chat: bool, prompt_tokens: int, completion_tokens: int,
                stats: dict) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens, stats), "mirror_sd": stats}
