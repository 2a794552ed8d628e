"""`mirror-sd bench --overhead`: the stack's machinery against a near-free target (services/bench/overhead.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import typer

from services.cli.common import fail, setup
from services.errors import MirrorSDError

logger = logging.getLogger(__name__)


def bench_overhead(*, prompts: str, levels: str | None, limit: int | None, max_prompt_chars: int | None,
                   requests: int | None, max_new_tokens: int, warmup: int, threads: int | None, chat: bool,
                   profile: bool, out: str) -> None:
    """Checks the options, loads the target in this process, runs the bench and writes its report."""
    import os

    from services.bench.concurrency import parse_levels
    from services.bench.overhead import DEFAULT_LEVELS, DEFAULT_PROMPTS, OVERHEAD_TARGET, OverheadConfig, run_overhead_bench
    from services.bench.overhead_report import meta, write_json, write_markdown
    from services.bench.prompts import load_prompts, select_prompts
    from services.models.loading import load_model

    try:
        chosen = load_prompts(Path(prompts))
        if max_prompt_chars is not None:
            chosen = [prompt for prompt in chosen if len(prompt.prompt) <= max_prompt_chars]
        chosen = select_prompts(chosen, limit=limit or DEFAULT_PROMPTS)
        config = OverheadConfig(levels=parse_levels(levels or DEFAULT_LEVELS), prompts=chosen,
                                max_tokens=max_new_tokens, requests=requests, warmup=warmup, profile=profile,
                                chat=chat)
    except ValueError as exc:
        fail(str(exc).replace("--concurrency", "--levels"))
    if not config.prompts:
        fail("no prompts selected")
    # the verify worker of a local placement runs on every core: the in-process floor does too
    threads = threads or len(os.sched_getaffinity(0))
    setup(threads, False)
    try:
        target = load_model(OVERHEAD_TARGET)
        floor, rows, profiles = run_overhead_bench(config, target, Path(out),
                                                   progress=lambda line: typer.echo(line, err=True))
    except (ValueError, RuntimeError, MirrorSDError) as exc:
        fail(str(exc))
    info = meta(config, threads)
    files = [write_json(Path(out) / "overhead.json", info, floor, rows, profiles),
             write_markdown(Path(out) / "overhead.md", info, floor, rows, profiles)]
    typer.echo(files[1].read_text())
    typer.echo("wrote " + ", ".join(str(path) for path in files))
    if any(row.level.mismatches for row in rows):
        typer.echo("MISMATCH: a stream's greedy output differs from in-process decoding (see overhead.md)", err=True)
        raise typer.Exit(code=1)
