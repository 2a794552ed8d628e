"""Structured output in the bench: a prompt's JSON schema as its request's format (a grammar in process, OpenAI's
`response_format` over HTTP), and whether an answer follows it (data/extraction.jsonl, docs/benchmarks.md)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

from services.engine import GenerationOptions
from services.speculative.grammar import check_grammar, json_schema_grammar

if TYPE_CHECKING:
    from services.bench.prompts import BenchPrompt
    from services.models.loading import LoadedModel

logger = logging.getLogger(__name__)

RESPONSE_FORMAT_NAME = "answer"  # json_schema.name in the requests the stack mode sends


class FormatCheck(NamedTuple):
    parses_as_json: bool  # the answer is one JSON value
    matches_schema: bool  # and jsonschema finds it valid against the prompt's schema


def constrained(options: GenerationOptions, schema: dict | None) -> GenerationOptions:
    """The run's options with its sampling held to the schema (the same temperature, top_p, seed); as they are
    without one."""
    if schema is None:
        return options
    return replace(options, sampling=replace(options.sampling, grammar=json_schema_grammar(schema)))


def response_format(schema: dict) -> dict:
    """OpenAI's chat `response_format` asking for the schema, strictly."""
    return {"type": "json_schema", "json_schema": {"name": RESPONSE_FORMAT_NAME, "schema": schema, "strict": True}}


def check_output(text: str, schema: dict) -> FormatCheck:
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError:
        return FormatCheck(False, False)
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return FormatCheck(True, False)
    return FormatCheck(True, True)


def check_schemas(prompts: Iterable[BenchPrompt], target: LoadedModel) -> None:
    """Every prompt's schema as a grammar the target's tokenizer can follow, before anything runs: a ValueError
    naming the first prompt whose schema cannot be served. The first check also builds llguidance's view of the
    vocabulary (about 0.4 s, kept for the process), here rather than inside a timed run."""
    seen: set[str] = set()
    for prompt in prompts:
        if prompt.schema is None:
            continue
        key = json.dumps(prompt.schema, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        try:
            check_grammar(json_schema_grammar(prompt.schema), target.tokenizer, target.vocab_size,
                          sorted(target.eos_token_ids))
        except ValueError as exc:
            raise ValueError(f"prompt {prompt.id!r}: its schema cannot be served: {exc}") from None
