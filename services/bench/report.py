"""Aggregate bench runs per mode x (group, category) and render results.json + a Markdown table."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

from services.bench.runner import PromptRun
from services.speculative.stats import SpecDecodingStats

logger = logging.getLogger(__name__)


@dataclass
class Aggregate:
    mode: str
    scope: str  # "all", "group:open", "category:chat", ...
    num_prompts: int
    num_tokens: int
    total_s: float
    mean_ttft_ms: float
    acceptance_rate: float
    mean_acceptance_length: float
    tokens_per_s: float  # sum of tokens / sum of wall time
    ms_per_token: float
    speedup_vs_ar: float | None = None
    num_mismatches: int = 0


def aggregate(mode: str, scope: str, runs: list[PromptRun]) -> Aggregate:
    stats = SpecDecodingStats()
    for run in runs:
        stats.merge(run.result.stats)
    num_tokens = sum(run.result.num_tokens for run in runs)
    total_s = sum(run.result.total_s for run in runs)
    return Aggregate(
        mode=mode,
        scope=scope,
        num_prompts=len(runs),
        num_tokens=num_tokens,
        total_s=total_s,
        mean_ttft_ms=1000 * sum(run.result.ttft_s for run in runs) / max(len(runs), 1),
        acceptance_rate=stats.acceptance_rate,
        mean_acceptance_length=stats.mean_acceptance_length,
        tokens_per_s=num_tokens / total_s if total_s else 0.0,
        ms_per_token=1000 * total_s / num_tokens if num_tokens else 0.0,
        num_mismatches=sum(1 for run in runs if run.matches_ar is False),
    )


def scopes(runs: list[PromptRun]) -> dict[str, list[PromptRun]]:
    grouped: dict[str, list[PromptRun]] = {"all": list(runs)}
    for run in runs:
        grouped.setdefault(f"group:{run.prompt.group}", []).append(run)
        grouped.setdefault(f"category:{run.prompt.category}", []).append(run)
    return grouped


def build_report(runs_by_mode: dict[str, list[PromptRun]]) -> list[Aggregate]:
    rows: list[Aggregate] = []
    ar_rates: dict[str, float] = {}
    for mode, runs in runs_by_mode.items():
        for scope, scoped in scopes(runs).items():
            row = aggregate(mode, scope, scoped)
            if mode == "ar":
                ar_rates[scope] = row.tokens_per_s
            rows.append(row)
    for row in rows:
        if row.scope in ar_rates and ar_rates[row.scope] > 0:
            row.speedup_vs_ar = row.tokens_per_s / ar_rates[row.scope]
    return rows


def to_markdown(rows: list[Aggregate]) -> str:
    header = "| mode | scope | prompts | tokens | tok/s | ms/token | TTFT ms | acceptance | mean acc. len | speedup vs ar | mismatches |"
    lines = [header, "|" + "---|" * 11]
    for row in rows:
        speedup = f"{row.speedup_vs_ar:.2f}x" if row.speedup_vs_ar is not None else "-"
        lines.append(
            f"| {row.mode} | {row.scope} | {row.num_prompts} | {row.num_tokens} | {row.tokens_per_s:.1f} | "
            f"{row.ms_per_token:.1f} | {row.mean_ttft_ms:.0f} | {row.acceptance_rate:.2f} | "
            f"{row.mean_acceptance_length:.2f} | {speedup} | {row.num_mismatches} |"
        )
    return "\n".join(lines) + "\n"


def to_json(rows: list[Aggregate], runs_by_mode: dict[str, list[PromptRun]], meta: dict) -> dict:
    return {
        "meta": meta,
        "aggregates": [asdict(row) for row in rows],
        "runs": [
            {
                "mode": run.mode,
                "id": run.prompt.id,
                "category": run.prompt.category,
                "group": run.prompt.group,
                "matches_ar": run.matches_ar,
                **{k: v for k, v in run.result.to_dict().items() if k != "text"},
            }
            for runs in runs_by_mode.values()
            for run in runs
        ],
    }
