"""The concurrency bench's report: its JSON, its table with each turn's figures, its plot
(services/bench/concurrency.py runs the levels)."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from services.synthetic import describe_label

if TYPE_CHECKING:  # the runner imports this module
    from services.bench.concurrency import ConcurrencyConfig, LevelRow, Mismatch


def paired_ratios(rows: list[LevelRow], mode: str, peer: str) -> dict[int, list[float]]:
    """Per level, `mode`'s tokens/s over `peer`'s, turn by turn (each turn ran both back to back, so a drift of
    the machine's speed between turns cancels): {C: [ratio of turn 1, turn 2, ...]}, for levels with 2+ turns."""
    by_key = {(row.mode, row.concurrency): row.extra.get("tokens_per_s_runs") for row in rows}
    ratios = {}
    for (row_mode, level), runs in by_key.items():
        peers = by_key.get((peer, level))
        if row_mode == mode and runs and peers and len(runs) == len(peers):
            ratios[level] = [round(a / b, 3) for a, b in zip(runs, peers) if b]
    return ratios


def write_json(path: Path, config: ConcurrencyConfig, rows: list[LevelRow], mismatches: list[Mismatch],
               label: dict | None = None) -> Path:
    meta = {"levels": config.levels, "modes": config.modes, "max_tokens": config.max_tokens,
            "prompts": [p.id for p in config.prompts], "url": config.url, "baseline_url": config.baseline_url,
            "repeat": config.repeat, "warmup": config.warmup, "synthetic": label}
    path.write_text(json.dumps({"meta": meta, "rows": [asdict(row) for row in rows],
                                "mismatches": [{**asdict(m), "fatal": m.fatal} for m in mismatches]}, indent=1))
    return path


def _cell(value) -> str:
    return "–" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def write_markdown(path: Path, rows: list[LevelRow], mismatches: list[Mismatch], label: dict | None = None, *,
                   warmup: int = 0, warmup_tokens: int = 8) -> Path:
    by_key = {(row.mode, row.concurrency): row for row in rows}
    lines = [f"stack: {describe_label(label)}", ""] if label else []
    lines += ["| mode | C | tok/s | x one stream | x hf-batch | TTFT p50 / p99 ms | ITL p50 / p99 ms | TPOT p50 ms "
             "| acceptance | rows/step | bookkeeping | mismatches |", "|" + "---|" * 12]
    for row in rows:
        single = by_key.get((row.mode, min(c for m, c in by_key if m == row.mode)))
        peer = by_key.get(("hf-batch", row.concurrency))
        lines.append("| " + " | ".join([
            row.mode, str(row.concurrency), f"{row.tokens_per_s:.1f}",
            f"{row.tokens_per_s / single.tokens_per_s:.2f}" if single and single.tokens_per_s else "–",
            f"{row.tokens_per_s / peer.tokens_per_s:.2f}" if peer and peer.tokens_per_s else "–",
            f"{_cell(row.ttft_p50_ms)} / {_cell(row.ttft_p99_ms)}", f"{_cell(row.itl_p50_ms)} / {_cell(row.itl_p99_ms)}",
            _cell(row.tpot_p50_ms), _cell(row.acceptance_rate), _cell(row.extra.get("mean_rows_per_step")),
            f"{row.extra['bookkeeping_share']:.1%}" if "bookkeeping_share" in row.extra else "–",
            str(row.mismatches)]) + " |")
    turns = [row for row in rows if row.extra.get("tokens_per_s_runs")]
    if turns:
        lines.append("\nTokens/s turn by turn (modes took turns in alternating order: as listed, then reversed):")
        lines += [f"- {row.mode} C={row.concurrency}: {', '.join(f'{v:g}' for v in row.extra['tokens_per_s_runs'])}"
                  for row in turns]
        for level, ratios in sorted(paired_ratios(rows, "stack", "stack-ar").items()):
            lines.append(f"- stack / stack-ar C={level}, turn by turn: {', '.join(f'{v:g}' for v in ratios)} "
                         f"(median {round(statistics.median(ratios), 3):g})")
    for mismatch in mismatches:
        lines.append(f"\n{'MISMATCH' if mismatch.fatal else 'near-tie'} {mismatch.mode} C={mismatch.concurrency} "
                     f"{mismatch.prompt_id} at token {mismatch.position}: top-2 logit gap {mismatch.top2_gap:g}")
    if warmup:
        lines.append(f"\nBefore its timed runs, each level ran {warmup} untimed pass(es) of C requests at C in flight "
                     f"({warmup_tokens} tokens each) by every stack mode.")
    path.write_text("\n".join(lines) + "\n")
    return path


def plot_concurrency(rows: list[LevelRow], path: Path) -> Path | None:
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (throughput, latency) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode in dict.fromkeys(row.mode for row in rows):
        points = sorted((row.concurrency, row.tokens_per_s, row.itl_p99_ms) for row in rows if row.mode == mode)
        throughput.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=mode)
        latency.plot([p[0] for p in points], [p[2] for p in points], marker="o", label=mode)
    for axes, label in ((throughput, "aggregate tokens/s"), (latency, "inter-token latency p99 (ms)")):
        axes.set_xscale("log", base=2)
        axes.set_xlabel("requests in flight")
        axes.set_ylabel(label)
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    throughput.set_title("Throughput vs concurrency")
    latency.set_title("Tail inter-token latency")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
