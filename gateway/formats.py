"""What a request asks its answer to look like, as the grammar text the workers constrain decoding with
(services/speculative/grammar.py): OpenAI's `response_format` (chat) and vLLM's `structured_outputs` extension
(`json`, `regex`, `choice`; both endpoints). Pure functions over the request's values; a ValueError names what is
wrong, and the schema validator that calls them turns it into a 400 naming the field. Whether the grammar fits the
served tokenizer is checked where the tokenizer is (gateway/sessions/submit.py)."""

from __future__ import annotations

from typing import Any

from services.speculative.grammar import GrammarError, choice_grammar, json_schema_grammar, regex_grammar

ANY_OBJECT = {"type": "object"}  # json_object: some JSON object


def response_format_grammar(value: dict[str, Any] | None) -> str | None:
    """OpenAI's response_format: text (None), json_object, or json_schema {name, schema, strict}."""
    kind = (value or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar(ANY_OBJECT)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise GrammarError('json_schema must be an object with a "name" and a "schema"')
        schema = spec.get("schema", {})
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("json_schema.schema must be a JSON schema (an object)")
        return json_schema_grammar(schema)
    raise GrammarError(f'type must be "text", "json_object" or "json_schema", got {kind!r}')


def structured_outputs_grammar(value: dict[str, Any] | None) -> str | None:
    """vLLM's structured_outputs: exactly one of json (a schema, or its text), regex, choice."""
    if not value:
        return None
    served = {"json", "regex", "choice"}
    unknown = sorted(set(value) - served)
    if unknown:
        raise GrammarError(f"{unknown[0]!r} is not served: one of json, regex, choice")
    given = [key for key in sorted(served) if value.get(key) is not None]
    if len(given) != 1:
        raise GrammarError(f"exactly one of json, regex, choice, got {given or 'none'}")
    kind = given[0]
    if kind == "json":
        schema = value["json"]
        if isinstance(schema, str):
            import json

            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise GrammarError(f"json is not valid JSON: {exc}") from exc
        return json_schema_grammar(schema)
    if kind == "regex":
        if not isinstance(value["regex"], str) or not value["regex"]:
            raise GrammarError("regex must be a non-empty string")
        return regex_grammar(value["regex"])
    return choice_grammar(value["choice"])
