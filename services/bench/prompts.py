"""Prompt sets: our dev JSONL, Spec-Bench's question.jsonl, ShareGPT-style conversations."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# The repository's dev set (data/dev_prompts.jsonl, see data/README.md), found from this file rather than the
# current directory, so `mirror-sd bench` works from anywhere in a source checkout or an editable install.
DEV_PROMPTS_PATH = Path(__file__).resolve().parents[2] / "data" / "dev_prompts.jsonl"


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    prompt: str
    context_chars: int = 0

    @property
    def group(self) -> str:
        """`grounded` prompts carry their source text (prompt lookup shines); `open` ones do not."""
        return "grounded" if self.context_chars > 0 else "open"


def _from_record(record: dict, line_number: int) -> BenchPrompt:
    if "prompt" in record:  # ours
        return BenchPrompt(
            str(record.get("id", line_number)),
            str(record.get("category", "default")),
            record["prompt"],
            int(record.get("context_chars", 0)),
        )
    if "turns" in record:  # Spec-Bench question.jsonl
        return BenchPrompt(
            str(record.get("question_id", line_number)), str(record.get("category", "default")), record["turns"][0]
        )
    if "conversations" in record:  # ShareGPT
        first = next(turn for turn in record["conversations"] if turn.get("from") in ("human", "user"))
        return BenchPrompt(str(record.get("id", line_number)), "sharegpt", first["value"])
    raise ValueError(f"line {line_number}: no 'prompt', 'turns' or 'conversations' field")


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
) -> list[BenchPrompt]:
    chosen = [p for p in prompts if not categories or p.category in categories]
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
