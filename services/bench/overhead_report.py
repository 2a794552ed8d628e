"""The report of `mirror-sd bench --overhead` (services/bench/overhead.py runs it): overhead.json with every
figure, overhead.md with the tables, beside the profiles."""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the runner imports this module's caller
    from services.bench.overhead import OverheadConfig, OverheadRow, Profiles
    from services.bench.overhead_figures import InProcess

STEP_COLUMNS = ("turn", "wait", "intake", "draft", "plan", "prepare", "forward", "apply", "settle", "events", "commit",
                "other")


def _cell(value, digits: int = 3) -> str:
    """A figure to `digits` significant digits, whole numbers from 1,000 on (never 1.5e+03)."""
    if value is None:
        return "–"
    if not isinstance(value, float):
        return str(value)
    return f"{value:.0f}" if abs(value) >= 10 ** (digits - 1) else f"{value:.{digits}g}"


def meta(config: OverheadConfig, threads: int) -> dict:
    from services.bench.overhead import OVERHEAD_DRAFT, OVERHEAD_TARGET

    return {"target": OVERHEAD_TARGET, "draft": OVERHEAD_DRAFT, "placement": "local", "block_policy": "acceptance",
            "levels": config.levels, "max_tokens": config.max_tokens, "prompts": [p.id for p in config.prompts],
            "requests": config.requests, "warmup": config.warmup, "threads": threads,
            "cores": len(os.sched_getaffinity(0)), "cpu": platform.processor() or platform.machine()}


def write_json(path: Path, info: dict, floor: InProcess, rows: list[OverheadRow], profiles: Profiles) -> Path:
    payload = {
        "meta": info,
        "in_process": asdict(floor),
        "rows": [{"route": row.route, "concurrency": row.concurrency, **asdict(row.level),
                  "x_in_process": row.x_in_process, "rows_per_step": row.split.rows_per_step,
                  "machinery_ms_per_step": row.split.machinery_ms, "steps": row.split.steps,
                  "rows": row.split.rows, "turns": row.split.turns, "ms_per_step": row.split.ms_per_step,
                  "us_per_row": row.split.us_per_row, "cpu_us_per_token": row.cpu_us_per_token} for row in rows],
        "profiles": asdict(profiles),
    }
    path.write_text(json.dumps(payload, indent=1))
    return path


def write_markdown(path: Path, info: dict, floor: InProcess, rows: list[OverheadRow], profiles: Profiles) -> Path:
    lines = [
        f"# Stack overhead: {info['target']} target, {info['draft']} draft (synthetic), placement local",
        "",
        f"{info['cores']} cores ({info['cpu']}), torch threads {info['threads']}, {info['max_tokens']} tokens a "
        f"request, levels {', '.join(map(str, info['levels']))}. SYNTHETIC: random weights, an acceptance chosen, "
        "not earned: read these figures as the stack's machinery, never as a model's.",
        "",
        f"In process (target-only, one prompt at a time, {floor.num_prompts} prompts): {floor.tokens_per_s:g} tok/s, "
        f"TPOT p50 {_cell(floor.tpot_p50_ms, 4)} ms, TTFT p50 {_cell(floor.ttft_p50_ms)} ms.",
        "",
        "| route | C | tok/s | TPOT p50 ms | x in process | TTFT p50 ms | rows/step | machinery ms/step | "
        "gateway us CPU/token | verify us CPU/token | client us CPU/token | acceptance | mismatches |",
        "|" + "---|" * 13,
    ]
    for row in rows:
        cpu = row.cpu_us_per_token
        lines.append("| " + " | ".join([
            row.route, str(row.concurrency), f"{row.level.tokens_per_s:.1f}", _cell(row.level.tpot_p50_ms),
            _cell(row.x_in_process), _cell(row.level.ttft_p50_ms), _cell(row.split.rows_per_step),
            _cell(row.split.machinery_ms), _cell(cpu.get("gateway")), _cell(cpu.get("verify-worker")),
            _cell(cpu.get("bench client")), _cell(row.level.acceptance_rate), str(row.level.mismatches)]) + " |")
    lines += ["", "Per verify step, ms (the level's stage time over its steps; machinery = turn - forward - wait):", "",
              "| route | C | steps | " + " | ".join(STEP_COLUMNS) + " |", "|" + "---|" * (3 + len(STEP_COLUMNS))]
    lines += ["| " + " | ".join([row.route, str(row.concurrency), str(row.split.steps),
                                 *(_cell(row.split.ms_per_step.get(c)) for c in STEP_COLUMNS)]) + " |" for row in rows]
    lines += ["", "Per row of a step, us (the level's stage time over its rows):", "",
              "| route | C | rows | " + " | ".join(STEP_COLUMNS) + " |", "|" + "---|" * (3 + len(STEP_COLUMNS))]
    lines += ["| " + " | ".join([row.route, str(row.concurrency), str(row.split.rows),
                                 *(_cell(row.split.us_per_row.get(c)) for c in STEP_COLUMNS)]) + " |" for row in rows]
    lines += ["", STAGE_NOTES, "", *profile_lines(profiles)]
    path.write_text("\n".join(lines) + "\n")
    return path


STAGE_NOTES = (
    "Stages (verify_worker/figures.py StageTimes): intake = non-blocking pops of blocks, decoding, admitting them; "
    "wait = blocked on an empty queue or in the batch window; draft = co-located drafting; plan = choosing rows, "
    "KV budget, threads; prepare / forward / apply = building rows, the engine's forward, the round math; settle = "
    "the last step's commit replies read and acted on; events = output events and verdicts built; commit = writing "
    "them (the replies are read at the next settle, after the next forward); other = the rest of a turn. "
    "CPU per token: user + system time of each process over the level, over the tokens streamed (the client is "
    "this bench's own process, on the same cores).")


def profile_lines(profiles: Profiles) -> list[str]:
    if profiles.tool == "none":
        return [f"No profile: {profiles.note}"]
    lines = [f"## Profiles (py-spy, {profiles.level} streams, one untimed pass per route)", "",
             "Folded stacks (open in speedscope.app or flamegraph.pl), the top functions by samples on the CPU, and "
             "one `py-spy dump` of each process mid-level:", ""]
    lines += [f"- {key}: " + ", ".join(f"[{Path(name).name}]({name})" for name in names)
              for key, names in profiles.files.items()]
    for key, text in profiles.tops.items():
        lines += ["", f"### {key}", "", "```", *text.splitlines()[:17], "```"]
    return lines
