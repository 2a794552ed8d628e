"""`mirror-sd bench --suffix-index`: our suffix index (services/models/drafters/suffix_index.py) against
arctic-inference's suffix tree, where that is importable, on build time, lookup cost and memory.

Each implementation and size runs in a child process of its own (`python -m services.bench.suffix_index JOB
RESULT`, JSON both ways), so that its RSS growth is its own. A child fills an index of `index_tokens` tokens
with the corpus (services/bench/suffix_corpus.py), times each lookup (wall and thread CPU time: on a shared
machine the wall time's tail is mostly other processes' turns) of contexts taken from the indexed documents
(seen) and from held-out ones (unseen), then floods it with FLOOD_FACTOR times its size of unique
random ids, reading memory after each step.

Comparable settings: max depth 32, min prob 0.1, factor 1.0 and offset 1.0 (our SuffixOptions' defaults), 16
draft tokens at most. arctic-inference's cache bounds its global tree by requests, not tokens: it gets
max_cached_requests = the documents that fill the size, and the flood's documents are the corpus's mean
length, so both hold about `index_tokens` tokens. Its lookups go through SuffixDecodingCache.speculate with
int32 numpy contexts (as vLLM calls it), against a probe request with an empty prompt; ours through
SuffixIndex.speculate with lists (as our drafter calls it).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import logging
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from services.bench.suffix_corpus import Corpus, contexts, fill, flood
from services.speculative.stats import percentile

logger = logging.getLogger(__name__)

DEFAULT_INDEX_TOKENS = "100000,1000000"
FLOOD_FACTOR = 5  # the flood: this many times the index's size of unique text, read after each step of 1x
NUM_LOOKUPS = 2000  # per kind of context
NUM_WARMUP_LOOKUPS = 50
CONTEXT_TOKENS = 64  # a lookup's context (both implementations read its last max_depth tokens)
OURS = "ours"
ARCTIC = "arctic-inference"
ARCTIC_MODULE = "arctic_inference.suffix_decoding"


@dataclass(frozen=True)
class LookupSettings:
    max_depth: int = 32
    min_prob: float = 0.1
    max_spec_factor: float = 1.0
    max_spec_offset: float = 1.0
    max_draft_tokens: int = 16


@dataclass(frozen=True)
class SuffixBenchConfig:
    index_tokens: list[int]
    seed: int = 0
    lookups: int = NUM_LOOKUPS
    flood_factor: int = FLOOD_FACTOR
    settings: LookupSettings = LookupSettings()


def parse_index_tokens(text: str) -> list[int]:
    try:
        sizes = [int(part.replace("_", "")) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--index-tokens must be a comma list of token counts, e.g. 100000,1000000; got {text!r}")
    if not sizes or min(sizes) < 1000:
        raise ValueError(f"--index-tokens: each size must be at least 1000 tokens, got {text!r}")
    return sizes


def arctic_available() -> bool:
    try:
        return importlib.util.find_spec(ARCTIC_MODULE) is not None
    except ModuleNotFoundError:
        return False


# --- the implementations, behind one face ------------------------------------------------------------------
class _Ours:
    name = OURS
    modules = ("services.models.drafters.suffix_index",)

    def __init__(self, capacity: int, num_documents: int, settings: LookupSettings) -> None:
        from services.models.drafters.suffix_index import SuffixIndex

        self.index = SuffixIndex(capacity, max_depth=settings.max_depth)
        self.options = {"min_prob": settings.min_prob, "max_spec_factor": settings.max_spec_factor,
                        "max_spec_offset": settings.max_spec_offset}
        self.max_tokens = settings.max_draft_tokens

    def add(self, doc: list[int]) -> None:
        self.index.add_document(doc)

    def prepare(self, context: list[int]) -> list[int]:
        return context

    def speculate(self, context) -> tuple[int, int]:
        draft = self.index.speculate(context, self.max_tokens, **self.options)
        return len(draft.token_ids), draft.match_length

    def memory_bytes(self) -> int:
        return self.index.memory_bytes


class _Arctic:
    name = ARCTIC
    modules = ("numpy", ARCTIC_MODULE)
    PROBE = "probe"  # the active request lookups are made for (empty prompt: its local tree matches nothing)

    def __init__(self, capacity: int, num_documents: int, settings: LookupSettings) -> None:
        import numpy as np
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.np = np
        self.cache = SuffixDecodingCache(max_tree_depth=settings.max_depth, max_cached_requests=num_documents)
        self.settings = settings
        self.cache.start_request(self.PROBE, np.empty(0, dtype=np.int32))
        self.num_added = 0

    def add(self, doc: list[int]) -> None:
        request = self.num_added
        self.num_added += 1
        self.cache.start_request(request, self.np.empty(0, dtype=self.np.int32))
        self.cache.add_active_response(request, self.np.asarray(doc, dtype=self.np.int32))
        self.cache.stop_request(request)

    def prepare(self, context: list[int]):
        return self.np.asarray(context, dtype=self.np.int32)

    def speculate(self, context) -> tuple[int, int]:
        s = self.settings
        draft = self.cache.speculate(self.PROBE, context, max_spec_tokens=s.max_draft_tokens,
                                     max_spec_factor=s.max_spec_factor, max_spec_offset=s.max_spec_offset,
                                     min_token_prob=s.min_prob)
        return len(draft.token_ids), draft.match_len

    def memory_bytes(self) -> int:
        # its own estimate (a walk of the tree, "for debugging"); it counts each held token as a vector's
        # size (24 bytes) where 4 are held, so it runs ~20 bytes a token high
        return int(self.cache._global_tree.estimate_memory())


IMPLEMENTATIONS = {OURS: _Ours, ARCTIC: _Arctic}


# --- one implementation at one size (in a child process) ---------------------------------------------------
def _rss() -> int:
    import psutil

    gc.collect()
    return psutil.Process().memory_info().rss


def _lookups(index, context_list: list[list[int]]) -> dict:
    prepared = [index.prepare(context) for context in context_list]
    for context in prepared[:NUM_WARMUP_LOOKUPS]:
        index.speculate(context)
    times_us: list[float] = []
    cpu_us: list[float] = []
    draft_tokens: list[int] = []
    match_lengths: list[int] = []
    clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    for context in prepared:
        start, cpu_start = clock(), cpu_clock()
        num_tokens, match_length = index.speculate(context)
        cpu_us.append((cpu_clock() - cpu_start) / 1000)
        times_us.append((clock() - start) / 1000)
        draft_tokens.append(num_tokens)
        match_lengths.append(match_length)
    calls = len(times_us)
    return {"calls": calls, "p50_us": percentile(times_us, 0.5), "p99_us": percentile(times_us, 0.99),
            "mean_us": sum(times_us) / calls, "cpu_p50_us": percentile(cpu_us, 0.5),
            "cpu_p99_us": percentile(cpu_us, 0.99), "mean_draft_tokens": sum(draft_tokens) / calls,
            "drafted_share": sum(1 for n in draft_tokens if n) / calls,
            "mean_match_length": sum(match_lengths) / calls}


def measure(name: str, corpus: Corpus, index_tokens: int, config: SuffixBenchConfig) -> dict:
    """Build, look up, flood: every figure of one implementation at one size."""
    documents = fill(corpus, index_tokens, config.seed)
    seen = contexts(documents, config.lookups, CONTEXT_TOKENS, config.seed + 1)
    unseen = contexts(corpus.held_out or corpus.documents, config.lookups, CONTEXT_TOKENS, config.seed + 2)
    num_tokens = sum(map(len, documents))
    for module in IMPLEMENTATIONS[name].modules:  # imported before the baseline: the index's growth alone
        importlib.import_module(module)
    rss_before = _rss()
    index = IMPLEMENTATIONS[name](index_tokens, len(documents), config.settings)
    start = time.perf_counter()
    for doc in documents:
        index.add(doc)
    build_s = time.perf_counter() - start
    rss_built = _rss()
    row = {"implementation": name, "index_tokens": index_tokens, "num_documents": len(documents),
           "num_tokens": num_tokens, "build_s": build_s, "build_us_per_token": build_s * 1e6 / num_tokens,
           "seen": _lookups(index, seen), "unseen": _lookups(index, unseen),
           "memory_bytes": index.memory_bytes(), "rss_growth_bytes": rss_built - rss_before, "flood": []}
    for step in range(1, config.flood_factor + 1):
        flooded = 0
        start = time.perf_counter()
        for doc in flood(index_tokens, corpus.mean_length, corpus.vocab_size, config.seed + 100 + step):
            index.add(doc)
            flooded += len(doc)
        seconds = time.perf_counter() - start
        row["flood"].append({"times_size": step, "us_per_token": seconds * 1e6 / max(1, flooded),
                             "memory_bytes": index.memory_bytes(), "rss_growth_bytes": _rss() - rss_before})
    return row


def _child(job_path: str, result_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    settings = LookupSettings(**job["config"].pop("settings"))
    config = SuffixBenchConfig(**job["config"], settings=settings)
    corpus = Corpus.from_json(json.loads(Path(job["corpus"]).read_text()))
    row = measure(job["implementation"], corpus, job["index_tokens"], config)
    Path(result_path).write_text(json.dumps(row))


# --- the bench (the parent) --------------------------------------------------------------------------------
def run_suffix_index_bench(config: SuffixBenchConfig, corpus: Corpus,
                           progress: Callable[[str], None] = lambda line: None) -> list[dict]:
    """Every implementation that imports here at every size, each in a child process; the rows in order."""
    names = [OURS, *([ARCTIC] if arctic_available() else [])]
    rows = []
    with tempfile.TemporaryDirectory(prefix="suffix-bench-") as scratch:
        corpus_path = Path(scratch) / "corpus.json"
        corpus_path.write_text(json.dumps(corpus.to_json()))
        for index_tokens in config.index_tokens:
            for name in names:
                progress(f"suffix index: {name}, {index_tokens:,} tokens")
                job = {"implementation": name, "index_tokens": index_tokens, "corpus": str(corpus_path),
                       "config": asdict(config)}
                job_path, result_path = Path(scratch) / "job.json", Path(scratch) / "result.json"
                job_path.write_text(json.dumps(job))
                done = subprocess.run([sys.executable, "-m", "services.bench.suffix_index", str(job_path),
                                       str(result_path)], capture_output=True, text=True)
                if done.returncode != 0:
                    raise RuntimeError(f"the suffix-index bench's child for {name} at {index_tokens} tokens failed "
                                       f"(exit {done.returncode}): {done.stderr[-2000:]}")
                rows.append(json.loads(result_path.read_text()))
    return rows


if __name__ == "__main__":
    _child(*sys.argv[1:3])
