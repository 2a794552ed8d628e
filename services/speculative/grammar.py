"""Structured output: a request's format (a JSON schema, a regex, a choice) as grammar text, checked against a
tokenizer, on llguidance (docs/api.md, "Structured output", says why that engine). Torch-free: the gateway checks
formats with it. The grammar's state in a session, and its masks, are in grammar_state.py.

The wire carries the grammar's text only (SamplingParams.grammar); whoever verifies a session builds its matcher
from that text and the session's committed output, so a session moved to another worker, or rebuilt after one
was lost, is in the same grammar state without any state crossing the wire.

Per round (grammar_state.py, services/engine/target.py): the tokens the grammar forces next (a schema's keys
and punctuation) open the block, free, where the draft does not already; the draft is cut at its first token the
grammar forbids, before the target sees it (such a token can never be accepted); the tokens the grammar forces
after the draft close the block, free too. The target's logits at each of the block's positions are masked with
what the grammar allows after the block's earlier tokens: greedy output is exactly constrained target-only
decoding's, and sampling draws from the masked distribution.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence


class GrammarError(ValueError):
    """A format that cannot be served: an invalid schema or regex, a keyword the engine does not support."""


def llguidance():
    import llguidance

    return llguidance


# JSON without free whitespace: compact, one way to write each value. A schema's keys and punctuation are then
# forced (drafted for free), and a small model cannot stall on newlines and indentation until max_tokens: on the
# extraction set's first prompts, free whitespace ran out of 128 tokens on 3 of 4, compact JSON finished in 65-79.
JSON_OPTIONS = {"whitespace_flexible": False}


def json_schema_grammar(schema: dict | bool) -> str:
    """A JSON schema (OpenAI's json_schema.schema; `{"type": "object"}` for json_object) as grammar text."""
    try:
        return llguidance().LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    except ValueError as exc:
        raise GrammarError(f"not a JSON schema: {exc}") from exc


def regex_grammar(pattern: str) -> str:
    return llguidance().LLMatcher.grammar_from_regex(pattern)


def choice_grammar(choices: Sequence[str]) -> str:
    """Exactly one of the strings."""
    if not choices or not all(isinstance(choice, str) and choice for choice in choices):
        raise GrammarError("choices must be a non-empty list of non-empty strings")
    return regex_grammar("(" + "|".join(re.escape(choice) for choice in choices) + ")")


@functools.lru_cache(maxsize=4)
def vocabulary(tokenizer: object, vocab_size: int, eos_ids: tuple[int, ...]):
    """llguidance's view of the tokenizer (about 0.4 s to build, so once per process and model)."""
    import llguidance.hf

    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_ids) or None)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"structured output needs a fast Hugging Face tokenizer ({exc})") from exc


def check_grammar(grammar: str, tokenizer: object, vocab_size: int, eos_ids: Sequence[int]) -> None:
    """GrammarError naming what is wrong, before any worker sees the grammar."""
    is_error, messages = llguidance().LLMatcher.validate_grammar_with_warnings(
        grammar, vocabulary(tokenizer, vocab_size, tuple(sorted(eos_ids))))
    if is_error:
        raise GrammarError(messages[0] if messages else "invalid grammar")
