"""Tool calls: `tools` with `tool_choice` "required" or a named function. The answer is constrained to the
function's argument schema (services/speculative/grammar.py) and returned as `tool_calls`, as OpenAI returns them.

"auto" (the model chooses between text and a call) is refused with a 400 until it can be done well: deciding
whether to call needs a model trained for it, and a constrained answer cannot express that choice. Pure functions
over the request's values; gateway/api/generation.py shapes the answer with them."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from services.speculative.grammar import json_schema_grammar

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
ANY_ARGUMENTS = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    """What the answer must be: a call of `named`, or (named None) a call of any of `functions`, written as
    {"name": ..., "arguments": {...}}."""

    grammar: str
    named: str | None
    functions: dict[str, dict]  # name -> its function object (description, parameters)


def _functions(tools: list[dict]) -> dict[str, dict]:
    functions: dict[str, dict] = {}
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ValueError(f'tools[{index}] must be {{"type": "function", "function": {{...}}}}')
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ValueError(f"tools[{index}].function.name must be 1-64 letters, digits, _ or -, got {name!r}")
        if name in functions:
            raise ValueError(f"tools[{index}]: a second function named {name!r}")
        parameters = function.get("parameters", ANY_ARGUMENTS)
        if not isinstance(parameters, dict):
            raise ValueError(f"tools[{index}].function.parameters must be a JSON schema (an object)")
        functions[name] = function
    return functions


def plan_tool_call(tools: list[dict] | None, tool_choice: str | dict | None) -> ToolPlan | None:
    """None when no call is asked for (no tools, or tool_choice "none"); ValueError naming what is wrong."""
    if tool_choice in (None, "none") and not tools:
        return None
    if tool_choice == "none":
        return None
    if not tools:
        raise ValueError("tool_choice asks for a call, but no tools are given")
    functions = _functions(tools)
    if tool_choice in (None, "auto"):
        raise ValueError('"auto" is not served (the model cannot choose well between text and a call): send '
                         'tool_choice "required", {"type": "function", "function": {"name": ...}}, or "none"')
    if tool_choice == "required":
        options = [{"type": "object", "properties": {"name": {"const": name},
                                                      "arguments": function.get("parameters", ANY_ARGUMENTS)},
                    "required": ["name", "arguments"], "additionalProperties": False}
                   for name, function in functions.items()]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return ToolPlan(json_schema_grammar(schema), None, functions)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in functions:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools ({', '.join(functions)})")
        return ToolPlan(json_schema_grammar(functions[name].get("parameters", ANY_ARGUMENTS)), name, functions)
    raise ValueError(f'tool_choice must be "none", "auto", "required" or a named function, got {tool_choice!r}')


def tools_note(plan: ToolPlan) -> str:
    """A system message telling the model what it calls (for chat templates that do not render tools)."""
    described = "\n".join(f"- {name}: {function.get('description', '')} Arguments (JSON schema): "
                          f"{json.dumps(function.get('parameters', ANY_ARGUMENTS))}"
                          for name, function in plan.functions.items() if plan.named in (None, name))
    how = (f"Call {plan.named}: reply with its arguments as a JSON object." if plan.named else
           'Call one of them: reply with {"name": <function>, "arguments": <its arguments>} as JSON.')
    return f"You can call these functions:\n{described}\n{how}"


def tool_calls(plan: ToolPlan, text: str) -> list[dict[str, Any]]:
    """The answer's text as OpenAI's tool_calls; [] when it is not a whole call (cut by a stop string)."""
    try:
        value = json.loads(text)
        name, arguments = (plan.named, value) if plan.named else (value["name"], value["arguments"])
    except (ValueError, TypeError, KeyError):
        return []
    return [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(arguments)}}]


def history_message(message: dict[str, Any]) -> dict[str, Any]:
    """An earlier turn of a tool conversation as the chat template takes it: an assistant's calls written as
    their JSON, a tool's result as its text."""
    calls = message.get("tool_calls") or []
    if message["role"] == "assistant" and calls:
        written = [{"name": call["function"]["name"], "arguments": json.loads(call["function"]["arguments"] or "{}")}
                   for call in calls]
        return {"role": "assistant", "content": json.dumps(written[0] if len(written) == 1 else written)}
    return {"role": message["role"], "content": message.get("content") or ""}


def answer_as_call(choice: dict[str, Any], plan: ToolPlan | None, text: str) -> None:
    """A chat body's choice, rewritten in place as the call its text is (finished answers only; one cut short
    keeps its text)."""
    calls = tool_calls(plan, text) if plan is not None and choice["finish_reason"] == "stop" else []
    if calls:
        choice["message"] = {"role": "assistant", "content": None, "tool_calls": calls}
        choice["finish_reason"] = "stop" if plan.named else "tool_calls"


def call_delta(plan: ToolPlan, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A streamed tool call's chunk delta and finish reason: nothing until the end, then the call whole (or, cut
    short, the text)."""
    calls = tool_calls(plan, text) if finish_reason == "stop" else []
    if calls:
        return {"tool_calls": [dict(call, index=0) for call in calls]}, "stop" if plan.named else "tool_calls"
    return ({"content": text} if finish_reason else {}), finish_reason
