"""Prompt text -> token ids, with the model's chat template when asked."""

from __future__ import annotations

from collections.abc import Sequence


def encode_prompt(tokenizer: object, prompt: str, *, chat: bool) -> list[int]:
    """Plain text, or one user turn through the chat template with the assistant prompt added."""
    return encode_messages(tokenizer, [{"role": "user", "content": prompt}]) if chat else tokenizer.encode(prompt)


def encode_messages(tokenizer: object, messages: Sequence[dict]) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)
