"""A bench run's journal: every finished prompt run appended as one JSON line, so a long run resumes.

A whole-dev-set run over several modes takes hours on a CPU; the journal
(`runs.jsonl` in the output folder) lets `mirror-sd bench --resume` pick up
after an interruption and only run what is missing. Its first line is the
run's fingerprint (target, prompt set, tokens, sampling, chat template,
block policy): resuming under a different one is refused, since the numbers
would not be comparable.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path

from services.engine import GenerationResult

logger = logging.getLogger(__name__)

JOURNAL_NAME = "runs.jsonl"


class JournalMismatch(ValueError):
    """The journal in the output folder was written by a run with other settings."""


class Journal:
    def __init__(self, path: Path, fingerprint: dict, *, resume: bool) -> None:
        self.path = path
        self.fingerprint = fingerprint
        self._done: dict[tuple[str, str], list[GenerationResult]] = defaultdict(list)
        if resume and path.exists():
            self._load()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"fingerprint": fingerprint}) + "\n")

    def _load(self) -> None:
        text = self.path.read_text()
        lines = text.splitlines()
        header = json.loads(lines[0]) if lines else {}
        if header.get("fingerprint") != self.fingerprint:
            differing = sorted(key for key in {*self.fingerprint, *header.get("fingerprint", {})}
                               if header.get("fingerprint", {}).get(key) != self.fingerprint.get(key))
            raise JournalMismatch(f"{self.path} was written with other settings ({', '.join(differing)}): "
                                  "use another --out, or drop --resume to start over")
        kept = [lines[0]]
        for number, line in enumerate(lines[1:], start=2):
            try:
                record = json.loads(line)
                result = GenerationResult.from_dict(record["result"])
            except (ValueError, KeyError, TypeError):  # a line cut short by the interruption
                logger.warning("%s:%d: unreadable run, it will be run again", self.path, number)
                continue
            kept.append(line)
            self._done[(record["mode"], record["prompt_id"])].append(result)
        if len(kept) < len(lines) or not text.endswith("\n"):  # drop what was cut; appends start a fresh line
            self.path.write_text("".join(line + "\n" for line in kept))
        logger.info("resuming %s: %d runs already done", self.path, sum(map(len, self._done.values())))

    def done(self, mode: str, prompt_id: str) -> list[GenerationResult]:
        """The finished runs of this prompt in this mode, oldest first."""
        return list(self._done.get((mode, prompt_id), ()))

    def record(self, mode: str, prompt_id: str, result: GenerationResult) -> None:
        self._done[(mode, prompt_id)].append(result)
        with self.path.open("a") as handle:
            handle.write(json.dumps({"mode": mode, "prompt_id": prompt_id, "result": result.to_dict()}) + "\n")
