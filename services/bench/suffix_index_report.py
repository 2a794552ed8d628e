"""The report of `mirror-sd bench --suffix-index` (services/bench/suffix_index.py runs it): suffix_index.json with
every figure, suffix_index.md with the tables."""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict
from pathlib import Path

from services.bench.suffix_corpus import EDIT_RATE, Corpus
from services.bench.suffix_index import ARCTIC, CONTEXT_TOKENS, SuffixBenchConfig, arctic_available

LOOKUP_GOAL_US = 50.0  # issue 55: a suffix lookup at 1M indexed tokens
GOAL_TOKENS = 1_000_000
MB = 1 << 20


def meta(config: SuffixBenchConfig, corpus: Corpus, tokenizer: str) -> dict:
    return {"index_tokens": config.index_tokens, "seed": config.seed, "lookups": config.lookups,
            "flood_factor": config.flood_factor, "settings": asdict(config.settings), "tokenizer": tokenizer,
            "context_tokens": CONTEXT_TOKENS, "edit_rate": EDIT_RATE,
            "corpus": {"documents": len(corpus.documents), "tokens": sum(map(len, corpus.documents)),
                       "held_out_documents": len(corpus.held_out), "mean_document_tokens": corpus.mean_length,
                       "vocab_size": corpus.vocab_size},
            "arctic_inference": arctic_available(), "cores": len(os.sched_getaffinity(0)),
            "cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
            "load_average": list(os.getloadavg())}


def goal(rows: list[dict]) -> dict:
    """Issue 55's goals for our index at 1M tokens (or the largest size run): a lookup within LOOKUP_GOAL_US on
    seen and unseen contexts (the slower kind's wall p50, and its CPU p99: the wall p99 of a shared machine is
    other processes' turns), and memory that the flood did not grow (its own count the same after every step)."""
    ours = [row for row in rows if row["implementation"] == "ours"]
    if not ours:
        return {}
    row = max(ours, key=lambda row: row["index_tokens"])
    p50 = max(row["seen"]["p50_us"], row["unseen"]["p50_us"])
    p99 = max(row["seen"]["p99_us"], row["unseen"]["p99_us"])
    cpu_p99 = max(row["seen"]["cpu_p99_us"], row["unseen"]["cpu_p99_us"])
    return {"index_tokens": row["index_tokens"], "lookup_p50_us": p50, "lookup_p99_us": p99,
            "lookup_cpu_p99_us": cpu_p99, "lookup_goal_us": LOOKUP_GOAL_US,
            "lookup_p50_met": p50 <= LOOKUP_GOAL_US, "lookup_cpu_p99_met": cpu_p99 <= LOOKUP_GOAL_US,
            "at_goal_size": row["index_tokens"] >= GOAL_TOKENS,
            "memory_fixed": all(step["memory_bytes"] == row["memory_bytes"] for step in row["flood"])}


def write_json(path: Path, info: dict, rows: list[dict]) -> Path:
    path.write_text(json.dumps({"meta": info, "goal": goal(rows), "rows": rows}, indent=1))
    return path


def _f(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "–"
    return f"{value:.0f}" if abs(value) >= 10 ** (digits - 1) else f"{value:.{digits}g}"


def _pair(lookups: dict, prefix: str) -> str:
    return f"{_f(lookups[prefix + 'p50_us'])} / {_f(lookups[prefix + 'p99_us'])}"


def _mb(value: int) -> str:
    return _f(value / MB)


def write_markdown(path: Path, info: dict, rows: list[dict]) -> Path:
    s = info["settings"]
    corpus = info["corpus"]
    lines = [
        "# Suffix index: ours against arctic-inference's suffix tree",
        "",
        f"{info['cores']} cores ({info['cpu']}), Python {info['python']}, load average at start "
        f"{', '.join(f'{x:.2f}' for x in info['load_average'])}. Settings: max depth {s['max_depth']}, min prob "
        f"{s['min_prob']}, factor {s['max_spec_factor']}, offset {s['max_spec_offset']}, at most "
        f"{s['max_draft_tokens']} draft tokens; {info['lookups']} lookups per kind, contexts of up to "
        f"{info['context_tokens']} tokens. Corpus: {corpus['documents']} documents, {corpus['tokens']:,} tokens "
        f"({info['tokenizer']} tokenizer; mean {corpus['mean_document_tokens']} tokens), grown by copies with "
        f"{info['edit_rate']:.0%} edits; {corpus['held_out_documents']} held-out documents give the unseen contexts.",
        "",
        "Lookup times: wall p50 / p99 us (CPU p50 / p99 us: the thread's own time, without other processes' turns).",
        "",
        "| implementation | indexed tokens | documents | build us/token | seen lookup us | seen CPU us | seen draft "
        "tokens | seen drafted | unseen lookup us | unseen CPU us | unseen draft tokens | memory MB (own count) | "
        "RSS growth MB | RSS bytes/token |",
        "|" + "---|" * 14,
    ]
    for row in rows:
        seen, unseen = row["seen"], row["unseen"]
        lines.append("| " + " | ".join([
            row["implementation"], f"{row['index_tokens']:,}", str(row["num_documents"]),
            _f(row["build_us_per_token"]), _pair(seen, ""), _pair(seen, "cpu_"), _f(seen["mean_draft_tokens"]),
            f"{seen['drafted_share']:.0%}", _pair(unseen, ""), _pair(unseen, "cpu_"),
            _f(unseen["mean_draft_tokens"]), _mb(row["memory_bytes"]), _mb(row["rss_growth_bytes"]),
            _f(row["rss_growth_bytes"] / row["num_tokens"])]) + " |")
    steps = range(1, info["flood_factor"] + 1)
    lines += ["", f"A flood of unique random ids, {info['flood_factor']}x the index's size, read after each 1x "
              "(memory MB by its own count / RSS growth MB since before the index; flood us/token):", "",
              "| implementation | indexed tokens | built | " + " | ".join(f"+{n}x" for n in steps) + " | us/token |",
              "|" + "---|" * (4 + len(steps))]
    for row in rows:
        cells = [f"{_mb(step['memory_bytes'])} / {_mb(step['rss_growth_bytes'])}" for step in row["flood"]]
        mean_us = sum(step["us_per_token"] for step in row["flood"]) / max(1, len(row["flood"]))
        lines.append("| " + " | ".join([row["implementation"], f"{row['index_tokens']:,}",
                                        f"{_mb(row['memory_bytes'])} / {_mb(row['rss_growth_bytes'])}", *cells,
                                        _f(mean_us)]) + " |")
    met = goal(rows)
    if met:
        verdict = {True: "met", False: "NOT met"}
        lines += ["", f"Goal (issue 55): our lookup at {met['index_tokens']:,} tokens against "
                  f"{met['lookup_goal_us']:g} us: wall p50 {_f(met['lookup_p50_us'])} us "
                  f"({verdict[met['lookup_p50_met']]}), CPU p99 {_f(met['lookup_cpu_p99_us'])} us "
                  f"({verdict[met['lookup_cpu_p99_met']]}), wall p99 {_f(met['lookup_p99_us'])} us"
                  f"{'' if met['at_goal_size'] else ' (below the 1M tokens the goal names)'}; memory under the "
                  f"flood: {'fixed' if met['memory_fixed'] else 'GREW'}."]
    if not info["arctic_inference"]:
        lines += ["", f"{ARCTIC}: not importable here (`arctic_inference.suffix_decoding`); only ours was measured."]
    lines += ["", "Times are per call on a machine that may be shared: compare rows of one run, and read the CPU "
              "columns for the tail."]
    path.write_text("\n".join(lines) + "\n")
    return path
