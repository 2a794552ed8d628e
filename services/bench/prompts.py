"""Prompt sets: our dev JSONL, Spec-Bench's question.jsonl, ShareGPT-style conversations.

A record with several user turns is a conversation: the bench runs its turns in order, each mode answering
every turn with its own earlier answers in context (as Spec-Bench's runner does), and reports the turns after
the first as a group of their own (`turn2+`). A record's `schema` (a JSON schema, data/extraction.jsonl) is the
format of its answers, every turn's (services/bench/formats.py)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

logger = logging.getLogger(__name__)

LATER_TURNS_GROUP = "turn2+"  # the group every turn after a conversation's first is reported in

# The repository's dev set (data/dev_prompts.jsonl, see data/README.md), found from this file rather than the
# current directory, so `mirror-sd bench` works from anywhere in a source checkout or an editable install.
DEV_PROMPTS_PATH = Path(__file__).resolve().parents[2] / "data" / "dev_prompts.jsonl"
# Conversations whose later turns rework earlier output, one extraction schema over many documents, code edited
# step by step (data/README.md): where drafting from the fleet's earlier outputs pays.
REPEATED_WORK_PATH = DEV_PROMPTS_PATH.parent / "repeated_work.jsonl"
# Extraction prompts, each with the JSON schema its answer must follow (structured output, data/README.md).
EXTRACTION_PATH = DEV_PROMPTS_PATH.parent / "extraction.jsonl"


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    prompt: str  # the first user turn (the only one of a single-turn prompt)
    context_chars: int = 0
    later_turns: tuple[str, ...] = ()  # a conversation's next user turns, in order
    schema: dict | None = field(default=None, hash=False)  # the JSON schema its answers follow; None: free text

    @property
    def group(self) -> str:
        """`grounded` prompts carry their source text (prompt lookup shines); `open` ones do not."""
        return "grounded" if self.context_chars > 0 else "open"

    @property
    def turns(self) -> tuple[str, ...]:
        return (self.prompt, *self.later_turns)

    def turn_group(self, turn: int) -> str:
        """The group a turn (1 = the first) is reported in: the prompt's own for the first, `turn2+` after it."""
        return self.group if turn == 1 else LATER_TURNS_GROUP

    def turn_id(self, turn: int) -> str:
        """A turn's id in reports and the journal: the prompt's own for the first turn, `<id>/turn<N>` after."""
        return self.id if turn == 1 else f"{self.id}/turn{turn}"


@dataclass(frozen=True)
class Turn:
    """One measured request of a prompt: the chat so far as one mode saw it (user, that mode's own answer,
    ..., this user turn), and the same tokenized for the target."""

    id: str
    messages: list[dict]
    prompt_ids: list[int]
    schema: dict | None = None  # the prompt's: the format this turn's answer is asked for


def _user_turns(turns: object, line_number: int, field: str) -> list[str]:
    if not isinstance(turns, list) or not turns or not all(isinstance(turn, str) and turn for turn in turns):
        raise ValueError(f"line {line_number}: {field!r} must hold at least one user turn, each a non-empty string")
    return turns


def _schema(record: dict, line_number: int) -> dict | None:
    schema = record.get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise ValueError(f"line {line_number}: 'schema' must be a JSON schema (an object), got {schema!r}")
    return schema


def _from_record(record: dict, line_number: int) -> BenchPrompt:
    if "prompt" in record:  # ours, single-turn
        return BenchPrompt(
            str(record.get("id", line_number)),
            str(record.get("category", "default")),
            record["prompt"],
            int(record.get("context_chars", 0)),
            schema=_schema(record, line_number),
        )
    if "turns" in record:  # Spec-Bench question.jsonl (MT-bench's two turns), or ours multi-turn
        turns = _user_turns(record["turns"], line_number, "turns")
        return BenchPrompt(str(record.get("id", record.get("question_id", line_number))),
                           str(record.get("category", "default")), turns[0], int(record.get("context_chars", 0)),
                           tuple(turns[1:]), _schema(record, line_number))
    if "conversations" in record:  # ShareGPT: its user turns; the bench answers them with each mode's own words
        conversation = record["conversations"]
        turns = [turn.get("value") for turn in conversation if isinstance(turn, dict)
                 and turn.get("from") in ("human", "user")] if isinstance(conversation, list) else None
        turns = _user_turns(turns, line_number, "conversations")
        return BenchPrompt(str(record.get("id", line_number)), "sharegpt", turns[0], later_turns=tuple(turns[1:]))
    raise ValueError(f"line {line_number}: no 'prompt', 'turns' or 'conversations' field")


def next_messages(messages: list[dict], answer: str, user_turn: str) -> list[dict]:
    """The chat for the next turn: this one's messages, the mode's own answer to it, the next user turn."""
    return [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": user_turn}]


def load_prompts(path: Path) -> list[BenchPrompt]:
    if not path.is_file():
        raise ValueError(f"prompt file {str(path)!r} does not exist")
    text = path.read_text()
    if path.suffix == ".json":  # ShareGPT dumps are one JSON array
        records = json.loads(text)
    else:
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [_from_record(record, index + 1) for index, record in enumerate(records)]


def select_prompts(
    prompts: list[BenchPrompt],
    *,
    categories: list[str] | None = None,
    limit: int | None = None,
    per_group: int | None = None,
    max_turns: int | None = None,
) -> list[BenchPrompt]:
    """Conversations are chosen whole (by their first turn's group), then cut to their first max_turns turns."""
    if max_turns is not None and max_turns < 1:
        raise ValueError(f"--max-turns must be at least 1, got {max_turns}")
    chosen = [p for p in prompts if not categories or p.category in categories]
    if max_turns is not None:
        chosen = [replace(p, later_turns=p.later_turns[: max_turns - 1]) for p in chosen]
    if per_group is not None:
        by_group: dict[str, list[BenchPrompt]] = {}
        for prompt in chosen:
            by_group.setdefault(prompt.group, []).append(prompt)
        chosen = [p for group in sorted(by_group) for p in by_group[group][:per_group]]
    # a limit takes the first N of the balanced order (round-robin over categories), not the file's first N
    return stratified(chosen)[:limit] if limit is not None else chosen


def stratified(prompts: list[BenchPrompt]) -> list[BenchPrompt]:
    """Round-robin over categories (first of each, then second of each, ...), so that any prefix
    of a run is a balanced sample of the set: an interrupted run still reads as a whole."""
    seen: dict[str, int] = {}
    ranked = []
    for position, prompt in enumerate(prompts):
        rank = seen.get(prompt.category, 0)
        seen[prompt.category] = rank + 1
        ranked.append((rank, position, prompt))
    return [prompt for _, _, prompt in sorted(ranked, key=lambda item: item[:2])]
