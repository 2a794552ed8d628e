"""Aggregate bench runs per mode x (group, category) and render results.json + a Markdown table."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

from services.bench.runner import PromptRun
from services.speculative.bound import alpha_from_mean_accepted, leviathan_speedup
from services.speculative.cost_model import CostModel, cost_curve_bound
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
    rounds: int  # target forwards after prefill (0 where the mode does not report them)
    acceptance_rate: float | None  # None where nothing was drafted (ar) or the mode does not say (hf-*)
    mean_acceptance_length: float | None  # tokens per drafted round
    acceptance_rate_per_pos: list[float]
    tokens_per_s: float  # sum of tokens / sum of wall time
    ms_per_token: float
    tpot_ms: float | None = None  # time per output token after the first: sum(total - TTFT) / sum(tokens - 1)
    draft_ms_per_token: float | None = None  # per proposed draft token (in-process modes)
    speedup_vs_ar: float | None = None
    decode_speedup_vs_ar: float | None = None  # ar's TPOT / this mode's: decoding alone, prefill left out
    cost_ratio: float | None = None  # c: draft time per token / target's TPOT
    alpha: float | None = None  # per-token acceptance solved from the measured mean accepted length
    mean_block_length: float | None = None  # gamma: draft tokens per drafted round
    leviathan_bound: float | None = None
    measured_over_bound: float | None = None
    curve_bound: float | None = None  # the bound with the measured verify cost curve (cost_model.py)
    measured_over_curve_bound: float | None = None
    rouge_l: float | None = None
    num_mismatches: int = 0
    synthetic: bool = False  # acceptance chosen by a synthetic draft, not earned, or a random-weight target
    # structured output (prompts with a schema): answers asked for one, the share that parse as JSON and match it,
    # and the draft tokens the grammar forced (counted in the rounds' drafts too) and of them accepted
    num_formatted: int = 0
    num_valid: int = 0
    valid_share: float | None = None  # num_valid / num_formatted; None when no prompt had a schema
    num_forced_draft_tokens: int = 0
    num_forced_accepted_tokens: int = 0


def aggregate(mode: str, scope: str, runs: list[PromptRun]) -> Aggregate:
    stats = SpecDecodingStats()
    for run in runs:
        stats.merge(run.result.stats)
    num_tokens = sum(run.result.num_tokens for run in runs)
    total_s = sum(run.result.total_s for run in runs)
    draft_s = sum(run.result.draft_s for run in runs)
    rouge = [run.rouge_l for run in runs if run.rouge_l is not None]
    decoding = [run.result for run in runs if run.result.num_tokens > 1]
    decode_tokens = sum(result.num_tokens - 1 for result in decoding)
    formatted = [run for run in runs if run.matches_schema is not None]
    num_valid = sum(1 for run in formatted if run.matches_schema)
    return Aggregate(
        mode=mode,
        scope=scope,
        num_prompts=len(runs),
        num_tokens=num_tokens,
        total_s=total_s,
        mean_ttft_ms=1000 * sum(run.result.ttft_s for run in runs) / max(len(runs), 1),
        rounds=stats.num_target_calls,
        acceptance_rate=stats.acceptance_rate if stats.num_drafts else None,
        mean_acceptance_length=stats.mean_acceptance_length if stats.num_drafts else None,
        acceptance_rate_per_pos=stats.acceptance_rate_per_pos,
        tokens_per_s=num_tokens / total_s if total_s else 0.0,
        ms_per_token=1000 * total_s / num_tokens if num_tokens else 0.0,
        tpot_ms=1000 * sum(result.total_s - result.ttft_s for result in decoding) / decode_tokens
        if decode_tokens else None,
        draft_ms_per_token=1000 * draft_s / stats.num_draft_tokens if stats.num_draft_tokens and draft_s else None,
        mean_block_length=stats.num_draft_tokens / stats.num_drafts if stats.num_drafts else None,
        rouge_l=sum(rouge) / len(rouge) if rouge else None,
        num_mismatches=sum(1 for run in runs if run.matches_ar is False),
        synthetic="synthetic" in mode,
        num_formatted=len(formatted),
        num_valid=num_valid,
        valid_share=num_valid / len(formatted) if formatted else None,
        num_forced_draft_tokens=stats.num_forced_draft_tokens,
        num_forced_accepted_tokens=stats.num_forced_accepted_tokens,
    )


def apply_bound(row: Aggregate, target_ms_per_token: float | None, draft_ms_per_token: float | None,
                verify_curve: CostModel | None = None) -> None:
    """Fill c, alpha, the Leviathan bound and measured/bound for a row that drafted (and the bound
    under the measured verify curve, when there is one).

    The bounds are about decoding, so they are held to the decode speedup (ar's TPOT over this mode's) and c
    is taken against ar's TPOT: both leave the prefill out, which the draft cannot speed up and which, on a
    long prompt, is most of the request (a 2,000-token prompt to a 1B target on a CPU: 50 s of prefill
    before 64 tokens)."""
    gamma = row.mean_block_length
    if not gamma or row.mean_acceptance_length is None or (target_ms_per_token or 0.0) <= 0:
        return
    row.cost_ratio = (draft_ms_per_token or 0.0) / target_ms_per_token
    mean_accepted = min(gamma, row.mean_acceptance_length - 1.0)
    row.alpha = alpha_from_mean_accepted(mean_accepted, gamma)
    row.leviathan_bound = leviathan_speedup(row.alpha, gamma, row.cost_ratio)
    if row.decode_speedup_vs_ar is not None:
        row.measured_over_bound = row.decode_speedup_vs_ar / row.leviathan_bound
    if verify_curve is not None:
        curve = CostModel(verify_curve.verify_ms, row.cost_ratio * verify_curve.verify_cost(1))
        row.curve_bound = cost_curve_bound(row.alpha, gamma, curve)
        if row.decode_speedup_vs_ar is not None:
            row.measured_over_curve_bound = row.decode_speedup_vs_ar / row.curve_bound


def scopes(runs: list[PromptRun]) -> dict[str, list[PromptRun]]:
    grouped: dict[str, list[PromptRun]] = {"all": list(runs)}
    for run in runs:
        grouped.setdefault(f"group:{run.group}", []).append(run)
        grouped.setdefault(f"category:{run.prompt.category}", []).append(run)
    return grouped


def build_report(
    runs_by_mode: dict[str, list[PromptRun]], draft_ms_overrides: dict[str, float] | None = None,
    verify_curve: CostModel | None = None, synthetic_modes: set[str] | frozenset[str] = frozenset(),
) -> list[Aggregate]:
    """Rows per mode x scope; speedups and bounds against `ar` in the same scope.

    draft_ms_overrides: draft ms/token for modes that cannot time their drafter
    in-process (the stack reads it from the draft workers' device profiles).
    synthetic_modes: modes labelled synthetic besides `sd:synthetic:*` (a stack serving a synthetic draft
    or a random-weight target, docs/synthetic.md).
    """
    draft_ms_overrides = draft_ms_overrides or {}
    rows: list[Aggregate] = []
    ar_rows: dict[str, Aggregate] = {}
    for mode, runs in runs_by_mode.items():
        for scope, scoped in scopes(runs).items():
            row = aggregate(mode, scope, scoped)
            row.synthetic = row.synthetic or mode in synthetic_modes
            if mode == "ar":
                ar_rows[scope] = row
            rows.append(row)
    for row in rows:
        ar = ar_rows.get(row.scope)
        if ar is None or ar.tokens_per_s <= 0:
            continue
        row.speedup_vs_ar = row.tokens_per_s / ar.tokens_per_s
        if ar.tpot_ms and row.tpot_ms:
            row.decode_speedup_vs_ar = ar.tpot_ms / row.tpot_ms
        apply_bound(row, ar.tpot_ms, draft_ms_overrides.get(row.mode, row.draft_ms_per_token), verify_curve)
    return rows


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else format(value, pattern)


def _format_cells(row: Aggregate) -> list[str]:
    """Structured output: valid answers (parse as JSON, match the schema) of those asked for one, and the draft
    tokens the grammar forced and of them accepted."""
    valid = "-" if row.valid_share is None else f"{row.valid_share:.0%} ({row.num_valid}/{row.num_formatted})"
    return [valid, str(row.num_forced_draft_tokens), str(row.num_forced_accepted_tokens)]


def to_markdown(rows: list[Aggregate]) -> str:
    """The structured-output columns appear when some prompt had a schema."""
    formats = any(row.num_formatted for row in rows)
    columns = ["mode", "scope", "prompts", "tokens", "tok/s", "ms/token", "TTFT ms", "rounds", "acceptance",
               "mean acc. len", "acc. per position", "speedup vs ar", "TPOT ms", "decode x ar", "c", "bound",
               "measured/bound", "curve bound", "measured/curve bound", "ROUGE-L", "mismatches"]
    columns += ["valid JSON", "forced draft tokens", "forced accepted"] if formats else []
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        mode = f"{row.mode} (synthetic)" if row.synthetic else row.mode
        per_pos = " ".join(f"{rate:.2f}" for rate in row.acceptance_rate_per_pos[:8]) or "-"
        cells = [mode, row.scope, str(row.num_prompts), str(row.num_tokens), f"{row.tokens_per_s:.1f}",
                 f"{row.ms_per_token:.1f}", f"{row.mean_ttft_ms:.0f}", str(row.rounds or "-"),
                 _fmt(row.acceptance_rate, ".2f"), _fmt(row.mean_acceptance_length, ".2f"), per_pos,
                 _fmt(row.speedup_vs_ar, ".2f") + ("x" if row.speedup_vs_ar is not None else ""),
                 _fmt(row.tpot_ms, ".1f"),
                 _fmt(row.decode_speedup_vs_ar, ".2f") + ("x" if row.decode_speedup_vs_ar is not None else ""),
                 _fmt(row.cost_ratio, ".3f"), _fmt(row.leviathan_bound, ".2f"), _fmt(row.measured_over_bound, ".0%"),
                 _fmt(row.curve_bound, ".2f"), _fmt(row.measured_over_curve_bound, ".0%"),
                 _fmt(row.rouge_l, ".3f"), str(row.num_mismatches)]
        cells += _format_cells(row) if formats else []
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def to_json(rows: list[Aggregate], runs_by_mode: dict[str, list[PromptRun]], meta: dict) -> dict:
    return {
        "meta": meta,
        "aggregates": [asdict(row) for row in rows],
        "runs": [
            {
                "mode": run.mode,
                "id": run.id,
                "prompt_id": run.prompt.id,
                "turn": run.turn,
                "category": run.prompt.category,
                "group": run.group,
                "matches_ar": run.matches_ar,
                "rouge_l": run.rouge_l,
                "parses_as_json": run.parses_as_json,
                "matches_schema": run.matches_schema,
                **{k: v for k, v in run.result.to_dict().items() if k != "text"},
            }
            for runs in runs_by_mode.values()
            for run in runs
        ],
    }
