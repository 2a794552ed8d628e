"""A bench run's journal: every finished prompt run appended as one JSON line, so a long run resumes.

A whole-dev-set run over several modes takes hours on a CPU; the journal
(`runs.jsonl` in the output folder) lets `mirror-sd bench --resume` pick up
after an interruption and only run what is missing. Its first line is the
run's fingerprint (target, weights, tokens, sampling, speculative settings,
chat template, threads): resuming under a different one is refused, since
the numbers would not be comparable. Each run also records a hash of its
prompt's token ids (and of the JSON schema its answer was held to, if any),
so a run is reused only for the very same request, not for another prompt
that happens to share its id.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from services.engine import GenerationResult

logger = logging.getLogger(__name__)

JOURNAL_NAME = "runs.jsonl"


class JournalMismatch(ValueError):
    """The journal in the output folder was written by a run with other settings, or would be lost."""


def prompt_hash(prompt_ids: Sequence[int], schema: dict | None = None) -> str:
    """A hash of the request: its prompt's token ids, and its answer's schema (a prompt without one hashes as it
    always did, so older journals still resume)."""
    text = json.dumps(list(prompt_ids))
    if schema is not None:
        text += json.dumps(schema, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _differences(old: dict, new: dict) -> str:
    keys = sorted(key for key in {*old, *new} if old.get(key, "(absent)") != new.get(key, "(absent)"))
    return "; ".join(f"{key}: {old.get(key, '(absent)')!r} then, {new.get(key, '(absent)')!r} now" for key in keys)


class Journal:
    """resume: True continues the journal in path, False starts over (an existing one is replaced),
    None starts a new one but refuses to replace a journal that holds runs. read_only: never writes
    (a report of a journal that another run may still be appending to)."""

    def __init__(self, path: Path, fingerprint: dict, *, resume: bool | None, read_only: bool = False) -> None:
        self.path = path
        self.fingerprint = fingerprint
        self.read_only = read_only
        self._done: dict[tuple[str, str, str], list[GenerationResult]] = defaultdict(list)
        if (resume or read_only) and path.exists():
            self._load()
            return
        if read_only:
            raise JournalMismatch(f"no {path.name} in {path.parent} to report on")
        if resume is None and path.exists():
            runs = max(0, len(path.read_text().splitlines()) - 1)
            if runs:
                raise JournalMismatch(f"{path} holds {runs} journalled runs: --resume to continue them, "
                                      "--fresh to start over, or another --out")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"fingerprint": fingerprint}) + "\n")

    def _load(self) -> None:
        text = self.path.read_text()
        lines = text.splitlines()
        try:
            header = json.loads(lines[0]).get("fingerprint") if lines else None
        except (ValueError, AttributeError):
            header = None
        if not isinstance(header, dict):
            raise JournalMismatch(f"{self.path} does not start with a bench fingerprint: use another --out or --fresh")
        if header != self.fingerprint:
            raise JournalMismatch(f"{self.path} was written with other settings ({_differences(header, self.fingerprint)}): "
                                  "use another --out, or --fresh to start over")
        kept = [lines[0]]
        for number, line in enumerate(lines[1:], start=2):
            try:
                record = json.loads(line)
                key = (record["mode"], record["prompt_id"], record["prompt_hash"])
                result = GenerationResult.from_dict(record["result"])
            except (ValueError, KeyError, TypeError):  # a line cut short by the interruption
                logger.warning("%s:%d: unreadable run, it will be run again", self.path, number)
                continue
            kept.append(line)
            self._done[key].append(result)
        if not self.read_only and (len(kept) < len(lines) or not text.endswith("\n")):
            # drop what was cut, so appends start on a fresh line; write aside, then swap (never half a journal)
            fresh = self.path.with_suffix(".jsonl.tmp")
            fresh.write_text("".join(line + "\n" for line in kept))
            os.replace(fresh, self.path)
        logger.info("journal %s: %d runs already done", self.path, sum(map(len, self._done.values())))

    def done(self, mode: str, prompt_id: str, prompt_ids: Sequence[int],
             schema: dict | None = None) -> list[GenerationResult]:
        """The finished runs of this prompt (same id, same tokens, same schema) in this mode, oldest first."""
        return list(self._done.get((mode, prompt_id, prompt_hash(prompt_ids, schema)), ()))

    def record(self, mode: str, prompt_id: str, prompt_ids: Sequence[int], result: GenerationResult,
               schema: dict | None = None) -> None:
        assert not self.read_only, "a read-only journal records nothing"
        digest = prompt_hash(prompt_ids, schema)
        self._done[(mode, prompt_id, digest)].append(result)
        with self.path.open("a") as handle:
            handle.write(json.dumps({"mode": mode, "prompt_id": prompt_id, "prompt_hash": digest,
                                     "result": result.to_dict()}) + "\n")
