"""`mirror-sd bench --merging`: what similar-request merging buys, through a running stack, in one run.

- prefix: for each of a few ~1,000-token documents, a cold request (nothing to reuse), then the same
  document with another question: TTFT of the second against the first, and its cached tokens;
- single-flight: one request alone, then 8 identical greedy requests at once (another prompt of the same
  shape): wall time and target tokens stepped by the verify workers, and whether the 8 answers are identical;
- unrelated: prompts that share nothing, on this stack and, with --baseline-url, on a stack with merging off,
  interleaved: TTFT and total time, so any slowdown merging brings to unrelated traffic shows.
"""

from __future__ import annotations

import json
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from services.bench.concurrency import _verify_counters
from services.bench.prompts import BenchPrompt
from services.gateway_client import chat_body, stream_chat

QUESTIONS = ("Question: what is the main topic of the text above? Answer in one sentence.",
             "Question: list three facts the text above states.")


@dataclass
class Answer:
    ttft_s: float
    total_s: float
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    stats: dict = field(default_factory=dict)


def ask(client: httpx.Client, model: str, prompt: str, max_tokens: int) -> Answer:
    """One streamed greedy chat completion, timed from the request to the first content and to the end."""
    body = chat_body(model, prompt, max_tokens, temperature=0, ignore_eos=True)
    answer = stream_chat(client, body).raise_for_error()
    details = answer.usage.get("usage") or {}
    return Answer(ttft_s=answer.ttft_s or answer.total_s, total_s=answer.total_s, token_ids=answer.token_ids or [],
                  prompt_tokens=details.get("prompt_tokens", 0),
                  cached_tokens=(details.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                  stats=answer.stats)


def documents(prompts: list[BenchPrompt], count: int) -> list[str]:
    """Distinct ~1,000-token documents: pairs of the set's grounded prompts (each ~2,000 characters)."""
    grounded = sorted((p for p in prompts if p.context_chars > 1500), key=lambda p: p.id)
    if len(grounded) < 2 * count:
        raise ValueError(f"--merging needs {2 * count} grounded prompts with long contexts, found {len(grounded)}")
    return [f"{grounded[2 * i].prompt}\n\n{grounded[2 * i + 1].prompt}" for i in range(count)]


def _tokens_stepped(redis_url: str | None, after: float) -> int | None:
    counters = _verify_counters(redis_url, sent_after=after)
    return sum(int(c.get("tokens", 0)) for c in counters.values()) if counters else None


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 4) if values else 0.0


def run_merging_bench(*, url: str, model: str, api_key: str | None, prompts: list[BenchPrompt], out: Path,
                      redis_url: str | None, baseline_url: str | None = None, documents_count: int = 3,
                      identical: int = 8, max_tokens: int = 16, unrelated: int = 8,
                      progress=lambda line: None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    client = httpx.Client(base_url=url, headers=headers, timeout=600)
    run_tag = uuid.uuid4().hex[:8]  # nothing of an earlier run is reused
    report: dict = {"url": url, "baseline_url": baseline_url, "max_tokens": max_tokens}

    pairs = []
    for index, document in enumerate(documents(prompts, documents_count)):
        document = f"[{run_tag}-{index}] {document}"
        cold = ask(client, model, f"{document}\n\n{QUESTIONS[0]}", max_tokens)
        warm = ask(client, model, f"{document}\n\n{QUESTIONS[1]}", max_tokens)
        pairs.append({"prompt_tokens": cold.prompt_tokens, "cold_ttft_s": round(cold.ttft_s, 4),
                      "warm_ttft_s": round(warm.ttft_s, 4), "warm_cached_tokens": warm.cached_tokens,
                      "warm_prompt_tokens": warm.prompt_tokens,
                      "same_worker": cold.stats.get("verify_worker") == warm.stats.get("verify_worker")})
        progress(f"prefix {index}: cold TTFT {cold.ttft_s:.3f}s, warm {warm.ttft_s:.3f}s "
                 f"({warm.cached_tokens}/{warm.prompt_tokens} cached)")
    cold_ttft, warm_ttft = _median([p["cold_ttft_s"] for p in pairs]), _median([p["warm_ttft_s"] for p in pairs])
    report["prefix"] = {"pairs": pairs, "cold_ttft_s": cold_ttft, "warm_ttft_s": warm_ttft,
                        "warm_over_cold": round(warm_ttft / cold_ttft, 4) if cold_ttft else None}

    open_prompts = [p for p in prompts if p.context_chars == 0]
    alone_prompt, shared_prompt = (f"[{run_tag}-sf{i}] {open_prompts[i].prompt}" for i in range(2))
    flight_tokens = 4 * max_tokens
    mark = time.time()
    before = _tokens_stepped(redis_url, 0.0)
    alone = ask(client, model, alone_prompt, flight_tokens)
    after_alone = _tokens_stepped(redis_url, time.time())
    started = time.perf_counter()
    with ThreadPoolExecutor(identical) as pool:
        answers = list(pool.map(lambda _: ask(client, model, shared_prompt, flight_tokens), range(identical)))
    together_s = time.perf_counter() - started
    after_all = _tokens_stepped(redis_url, time.time())
    stepped = (None if None in (before, after_alone, after_all)
               else {"alone": after_alone - before, "together": after_all - after_alone})
    baseline_together_s = None
    if baseline_url:  # the same 8 where nothing merges: 8 generations batched
        with httpx.Client(base_url=baseline_url, headers=headers, timeout=600) as other, \
                ThreadPoolExecutor(identical) as pool:
            started = time.perf_counter()
            list(pool.map(lambda _: ask(other, model, shared_prompt, flight_tokens), range(identical)))
            baseline_together_s = round(time.perf_counter() - started, 4)
    report["single_flight"] = {
        "requests": identical, "max_tokens": flight_tokens, "alone_s": round(alone.total_s, 4),
        "together_s": round(together_s, 4), "together_over_alone": round(together_s / alone.total_s, 4),
        "identical_answers": sum(a.token_ids == answers[0].token_ids for a in answers),
        "merged": sum(1 for a in answers if a.stats.get("merged_into")), "verify_tokens_stepped": stepped,
        "baseline_together_s": baseline_together_s, "started_after": mark,
    }
    progress(f"single-flight: 1 alone {alone.total_s:.2f}s, {identical} identical at once {together_s:.2f}s, "
             f"tokens stepped {stepped}")

    rows = []
    baseline = httpx.Client(base_url=baseline_url, headers=headers, timeout=600) if baseline_url else None
    for index, prompt in enumerate(open_prompts[2 : 2 + unrelated]):
        text = f"[{run_tag}-u{index}] {prompt.prompt}"
        row = {"id": prompt.id}
        theirs = ask(baseline, model, text, flight_tokens) if baseline is not None and index % 2 else None
        ours = ask(client, model, text, flight_tokens)  # who goes first alternates: no order effect
        row.update(ttft_s=round(ours.ttft_s, 4), total_s=round(ours.total_s, 4))
        if baseline is not None:
            theirs = theirs or ask(baseline, model, text, flight_tokens)
            row.update(baseline_ttft_s=round(theirs.ttft_s, 4), baseline_total_s=round(theirs.total_s, 4),
                       identical=theirs.token_ids == ours.token_ids)
        rows.append(row)
    unrelated_report = {"prompts": rows, "ttft_s": _median([r["ttft_s"] for r in rows]),
                        "total_s": _median([r["total_s"] for r in rows])}
    if baseline is not None:
        unrelated_report.update(baseline_ttft_s=_median([r["baseline_ttft_s"] for r in rows]),
                                baseline_total_s=_median([r["baseline_total_s"] for r in rows]),
                                identical=sum(r["identical"] for r in rows))
        unrelated_report["total_over_baseline"] = round(unrelated_report["total_s"]
                                                        / unrelated_report["baseline_total_s"], 4)
    report["unrelated"] = unrelated_report
    out.mkdir(parents=True, exist_ok=True)
    (out / "merging.json").write_text(json.dumps(report, indent=2))
    (out / "merging.md").write_text(render(report))
    return report


def render(report: dict) -> str:
    prefix, flight, unrelated = report["prefix"], report["single_flight"], report["unrelated"]
    lines = [
        "| scenario | figure | value |", "|---|---|---|",
        f"| prefix (~{prefix['pairs'][0]['prompt_tokens']} tokens) | TTFT cold, median | {prefix['cold_ttft_s']:.3f} s |",
        f"| | TTFT sharing the document, median | {prefix['warm_ttft_s']:.3f} s |",
        f"| | warm / cold | {prefix['warm_over_cold']:.1%} |",
        f"| | cached tokens | {', '.join(str(p['warm_cached_tokens']) for p in prefix['pairs'])} |",
        f"| single-flight ({flight['max_tokens']} tokens) | 1 request alone | {flight['alone_s']:.2f} s |",
        f"| | {flight['requests']} identical at once | {flight['together_s']:.2f} s "
        f"({flight['together_over_alone']:.2f}x) |",
        f"| | identical answers / merged | {flight['identical_answers']} / {flight['merged']} |",
        *([f"| | the same {flight['requests']} on the baseline (merging off) | {flight['baseline_together_s']:.2f} s |"]
          if flight.get("baseline_together_s") is not None else []),
        f"| | target tokens stepped (alone, together) | {flight['verify_tokens_stepped']} |",
        f"| unrelated ({len(unrelated['prompts'])} prompts, {flight['max_tokens']} tokens) | TTFT, median | "
        f"{unrelated['ttft_s']:.3f} s |",
        f"| | total, median | {unrelated['total_s']:.3f} s |",
    ]
    if "baseline_total_s" in unrelated:
        lines += [f"| | baseline (merging off): TTFT, total, median | {unrelated['baseline_ttft_s']:.3f} s, "
                  f"{unrelated['baseline_total_s']:.3f} s |",
                  f"| | ours / baseline | {unrelated['total_over_baseline']:.2f}x |",
                  f"| | identical to baseline | {unrelated['identical']}/{len(unrelated['prompts'])} |"]
    return "\n".join(lines) + "\n"
