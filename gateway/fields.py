"""What the gateway does with each request field it knows but does not serve: it accepts such a field only at the
value that asks for nothing (its default: `functions: []`, `audio: null`), and refuses any other value
with a 400 that names the field and says why. Nothing is silently ignored.

Pure decisions over a request's validated values; gateway/schemas.py calls `refuse_unsupported` after its own
type checks, and gateway/errors.py turns the error into OpenAI's shape. docs/api.md's field table says the same
in words (a unit test keeps the two in step)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic_core import PydanticCustomError

logger = logging.getLogger(__name__)

UNSUPPORTED = "unsupported_parameter"  # a field of OpenAI's API at a value the gateway does not serve
UNKNOWN = "unknown_parameter"  # a field of neither OpenAI's API nor Mirror-SD's documented extensions
MISSING = "missing_required_parameter"
CODES = (UNSUPPORTED, UNKNOWN, MISSING)  # OpenAI's own codes for these three


@dataclass(frozen=True)
class Refusal:
    """A field the gateway does not serve: accepted where `accepts(value)` (`allowed` says which values, in
    words), refused otherwise for `reason`."""

    allowed: str
    reason: str
    accepts: Callable[[Any], bool]


def _absent(value: Any) -> bool:
    return value is None


def _empty(value: Any) -> bool:
    """None, 0, false, "", [] or {}: the value that asks for nothing."""
    return not value


def _one_of(*values: Any) -> Callable[[Any], bool]:
    """Equal in value and type: `true` is not `1`."""
    return lambda value: any(value is v or (v is not None and type(value) is type(v) and value == v)
                             for v in values)


NOT_YET = "not served yet"

CHAT = {
    "functions": Refusal("empty", "the deprecated function calling is not served (use tools)", _empty),
    "function_call": Refusal('"none" or "auto"', "the deprecated function calling is not served (use tools)",
                             _one_of(None, "none", "auto")),
    "audio": Refusal("null", "audio output is not served: the model writes text", _absent),
    "modalities": Refusal('["text"]', "the model writes text only",
                          lambda value: value is None or set(value) <= {"text"}),
    "prediction": Refusal("null", f"predicted outputs are {NOT_YET}", _absent),
    "web_search_options": Refusal("null", "web search is not served", _absent),
    "reasoning_effort": Refusal('"none"', "the served model does not reason", _one_of(None, "none")),
    "verbosity": Refusal('"medium"', "the served model has no verbosity control", _one_of(None, "medium")),
    "store": Refusal("false", "answers are not stored for OpenAI's stored-completions API "
                              "(GET /v1/requests/{id} has each request's record)", _one_of(None, False)),
    "service_tier": Refusal('"auto" or "default"', "a request's tier comes from its API key",
                            _one_of(None, "auto", "default")),
}

COMPLETIONS = {
    "echo": Refusal("false", "echoing the prompt (and its log probabilities) is not served", _empty),
    "suffix": Refusal("empty", "insertion (a suffix) is not served", _empty),
    "best_of": Refusal("1", "one candidate per request", _one_of(None, 1)),
}

STREAM_OPTIONS = {
    "include_obfuscation": Refusal("false", "streams carry no obfuscation padding", _one_of(None, False)),
}

MESSAGE = {
    "name": Refusal("null", "the chat template takes no participant names", _absent),
    "function_call": Refusal("null", "the deprecated function calling is not served (use tools)", _absent),
    "audio": Refusal("null", "audio is not served: the model reads and writes text", _absent),
    "refusal": Refusal("null", "the chat template has no place for a refusal", _absent),
}


def _shown(value: Any, limit: int = 80) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def first_refused(values: Mapping[str, Any], rules: Mapping[str, Refusal]) -> tuple[str, str] | None:
    """The first field (in `rules`' order) whose value is refused, and what to say after its name; None when
    every value is accepted."""
    for name, rule in rules.items():
        value = values.get(name)
        if not rule.accepts(value):
            return name, f"must be {rule.allowed} or absent: {rule.reason} (got {_shown(value)})"
    return None


def refuse(code: str, param: str, detail: str = "") -> None:
    """Raise the validation error that gateway/errors.py answers as a 400 with this code. `param` is relative
    to where the validator runs (a message's own validator says `name`); the answer names the field from the
    body's root (`messages[0].name`), and its message is that name, then `detail`."""
    raise PydanticCustomError(code, "{param} {detail}", {"param": param, "detail": detail})


def refuse_unsupported(values: Mapping[str, Any], rules: Mapping[str, Refusal]) -> None:
    found = first_refused(values, rules)
    if found is not None:
        refuse(UNSUPPORTED, *found)


def check_part(index: int, part_type: str, text: Any, extra: Mapping[str, Any]) -> None:
    """One part of a message's content: text is served; an image, audio or file part is refused (the served
    model reads text only), and a text part's unknown field is refused as unknown."""
    if part_type != "text":
        refuse(UNSUPPORTED, f"content[{index}].type",
               f'must be "text": the served model reads text only (got {_shown(part_type)})')
    if not isinstance(text, str):
        refuse(MISSING, f"content[{index}].text")
    for name in extra:
        refuse(UNKNOWN, f"content[{index}].{name}")


def message_for(code: str, param: str, detail: str = "") -> str:
    """What a 400 of this code says about the field `param` (named from the body's root)."""
    if code == UNKNOWN:
        return (f"unknown field {param!r}: neither a field of OpenAI's API nor one of Mirror-SD's extensions "
                "(docs/api.md lists every field)")
    if code == MISSING:
        return f"missing required field {param!r}"
    return f"{param} {detail}"
