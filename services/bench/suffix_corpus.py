"""The token text the suffix-index bench indexes (services/bench/suffix_index.py): realistic documents from the
repository's prompt sets, grown to a size by edited copies, and a flood of unique text.

Documents are token ids of the built-in tokenizer. Each prompt turn of data/dev_prompts.jsonl and
data/repeated_work.jsonl gives two: the turn through the chat template (what a session's context holds) and an
answer-like document, runs of the turn's own plain text in order (an answer quotes its source and restates its
question; no target is run, so these stand in for outputs). A tenth of the prompts is held out: never indexed,
their documents are the unseen text that lookups miss on. The index is filled with the documents in turn, each
pass after the first a copy with small random edits (a token replaced, dropped or inserted, 2% each), the way
repeated work repeats with changes. The flood is documents of uniformly random ids, as long as the documents
are on average: text nothing matches, that only evicts.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
PROMPT_FILES = (DATA_DIR / "dev_prompts.jsonl", DATA_DIR / "repeated_work.jsonl")
HELD_OUT_SHARE = 0.1  # of the prompts, never indexed: the unseen text
EDIT_RATE = 0.02  # per token of a copy, each of: replaced, dropped, a token inserted after it
RUN_TOKENS = (16, 96)  # an answer-like document's runs of its turn's text, tokens
NUM_RUNS = (1, 4)


@dataclass(frozen=True)
class Corpus:
    """The base documents (token ids) and the held-out ones; vocab_size bounds the flood's ids."""

    documents: list[list[int]]
    held_out: list[list[int]]
    vocab_size: int

    def to_json(self) -> dict:
        return {"documents": self.documents, "held_out": self.held_out, "vocab_size": self.vocab_size}

    @classmethod
    def from_json(cls, payload: dict) -> "Corpus":
        return cls([list(map(int, doc)) for doc in payload["documents"]],
                   [list(map(int, doc)) for doc in payload["held_out"]], int(payload["vocab_size"]))

    @property
    def mean_length(self) -> int:
        return max(1, round(sum(map(len, self.documents)) / max(1, len(self.documents))))


def load_turns(paths: Sequence[Path] = PROMPT_FILES) -> list[list[str]]:
    """Every prompt's user turns, in file order."""
    from services.bench.prompts import load_prompts

    return [list(prompt.turns) for path in paths for prompt in load_prompts(path)]


def answer_like(plain_ids: Sequence[int], rng: random.Random) -> list[int]:
    """Runs of a turn's own tokens in order, as an answer quotes and restates its source."""
    if not plain_ids:
        return []
    runs = []
    for _ in range(rng.randint(*NUM_RUNS)):
        length = min(len(plain_ids), rng.randint(*RUN_TOKENS))
        start = rng.randrange(len(plain_ids) - length + 1)
        runs.append((start, length))
    return [token for start, length in sorted(runs) for token in plain_ids[start:start + length]]


def build_corpus(turns: list[list[str]], encode_chat: Callable[[str], list[int]],
                 encode_plain: Callable[[str], list[int]], vocab_size: int, seed: int) -> Corpus:
    """The base and held-out documents of these prompts' turns (a prompt's documents stay together)."""
    if not turns:
        raise ValueError("the suffix-index bench needs at least one prompt")
    rng = random.Random(seed)
    order = list(range(len(turns)))
    rng.shuffle(order)
    held = set(order[:max(1, round(HELD_OUT_SHARE * len(turns)))]) if len(turns) > 1 else set()
    documents: list[list[int]] = []
    held_out: list[list[int]] = []
    for index, prompt_turns in enumerate(turns):
        into = held_out if index in held else documents
        for text in prompt_turns:
            into.append(encode_chat(text))
            answer = answer_like(encode_plain(text), rng)
            if answer:
                into.append(answer)
    return Corpus(documents, held_out, vocab_size)


def edited(doc: Sequence[int], rng: random.Random, pool: Sequence[int]) -> list[int]:
    """A copy with small random edits: each token replaced, dropped, or followed by an inserted one (EDIT_RATE
    each), the new tokens drawn from `pool` (the corpus's own tokens, so as frequent as in the text)."""
    out: list[int] = []
    for token in doc:
        draw = rng.random()
        if draw < EDIT_RATE:
            out.append(rng.choice(pool))
        elif draw < 2 * EDIT_RATE:
            continue
        else:
            out.append(token)
        if rng.random() < EDIT_RATE:
            out.append(rng.choice(pool))
    return out or list(doc)


def fill(corpus: Corpus, num_tokens: int, seed: int) -> list[list[int]]:
    """Documents that fill an index of num_tokens (each document's tokens plus its separator): the base ones,
    then edited copies, pass after pass; the last one cut to fit (one token short where a single one is left,
too few for a document and its separator)."""
    if not corpus.documents:
        raise ValueError("the corpus has no documents to index")
    rng = random.Random(seed)
    pool = [token for doc in corpus.documents for token in doc]
    out: list[list[int]] = []
    used = 0
    passes = 0
    while used < num_tokens:
        for doc in corpus.documents:
            doc = list(doc) if passes == 0 else edited(doc, rng, pool)
            room = num_tokens - used - 1
            if room <= 0:
                break
            doc = doc[:room]
            out.append(doc)
            used += len(doc) + 1
        else:
            passes += 1
            continue
        break
    return out


def flood(num_tokens: int, doc_length: int, vocab_size: int, seed: int) -> Iterator[list[int]]:
    """Documents of uniformly random ids, doc_length each (the last cut), num_tokens in all with separators (or
one short, as `fill`)."""
    rng = random.Random(seed)
    used = 0
    while used < num_tokens:
        length = min(doc_length, num_tokens - used - 1)
        if length <= 0:
            return
        yield [rng.randrange(vocab_size) for _ in range(length)]
        used += length + 1


def contexts(documents: Sequence[Sequence[int]], num_contexts: int, max_tokens: int, seed: int) -> list[list[int]]:
    """Lookup contexts: a document's tokens up to a random position (at least 2), at most max_tokens of them."""
    rng = random.Random(seed)
    usable = [doc for doc in documents if len(doc) >= 3]
    if not usable:
        raise ValueError("no document is long enough to take lookup contexts from")
    out = []
    for _ in range(num_contexts):
        doc = rng.choice(usable)
        end = rng.randint(2, len(doc) - 1)
        out.append(list(doc[max(0, end - max_tokens):end]))
    return out
