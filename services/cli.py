"""`mirror-sd`: the command line for the whole suite.

Errors from bad input print one line naming the bad value and exit 2.
"""

from __future__ import annotations

import json
import logging
import sys
from enum import Enum
from typing import Annotated

import typer

from services.bench.prompts import DEV_PROMPTS_PATH
from services.errors import MirrorSDError

logger = logging.getLogger(__name__)

app = typer.Typer(help="Mirror-SD: distributed speculative decoding.", no_args_is_help=True, add_completion=False)
models_app = typer.Typer(help="Built-in and local models.", no_args_is_help=True)
app.add_typer(models_app, name="models")
telemetry_app = typer.Typer(help="Telemetry: routing-table service and probe overrides.", no_args_is_help=True)
app.add_typer(telemetry_app, name="telemetry")
keys_app = typer.Typer(help="API keys (stored hashed, each with a priority tier).", no_args_is_help=True)
app.add_typer(keys_app, name="keys")


BENCH_DEFAULT_MODES = "ar,sd:ngram,sd:int8"


class Mode(str, Enum):
    sd = "sd"
    ar = "ar"


def _fail(message: str) -> None:
    typer.echo(f"Error: {message}", err=True)
    raise typer.Exit(code=2)


def _setup(num_threads: int | None, verbose: bool) -> None:
    import torch

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not verbose:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    if num_threads:
        torch.set_num_threads(num_threads)


_GAMMA_FLAGS = {"num_draft_tokens": "--gamma", "min_draft_tokens": "--min-gamma", "max_draft_tokens": "--max-gamma"}


def _describe_gamma_error(exc) -> str:
    parts = []
    for error in exc.errors():
        field = ".".join(map(str, error["loc"]))
        name = _GAMMA_FLAGS.get(field, field or "gamma")
        message = error["msg"].removeprefix("Value error, ")
        parts.append(f"{name} {message.lower()}, got {error['input']!r}" if field else message)
    return "; ".join(parts)


@app.command()
def generate(
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="prompt text")],
    target: Annotated[str | None, typer.Option(help="target model: alias, directory, .gguf or cached HF id")] = None,
    draft: Annotated[str | None, typer.Option(help="ngram | int8 | bf16 | fp16 | none | model spec")] = None,
    mode: Annotated[Mode, typer.Option(help="sd: speculative; ar: target only")] = Mode.sd,
    chat: Annotated[bool, typer.Option("--chat", help="wrap the prompt in the chat template")] = False,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n")] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="0 = off")] = 0,
    seed: Annotated[int | None, typer.Option()] = None,
    gamma: Annotated[int | None, typer.Option(help="initial draft block length")] = None,
    min_gamma: Annotated[int | None, typer.Option("--min-gamma")] = None,
    max_gamma: Annotated[int | None, typer.Option("--max-gamma")] = None,
    precision: Annotated[str | None, typer.Option(help="target precision: fp32 | bf16 | fp16 | int8")] = None,
    draft_precision: Annotated[str | None, typer.Option("--draft-precision")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="stop string (repeatable)")] = None,
    threads: Annotated[int | None, typer.Option(help="torch threads")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print text, token ids and stats as JSON")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Generate text in one process, speculatively (--mode sd) or with the target alone (--mode ar)."""
    from pydantic import ValidationError

    from services.config import get_settings
    from services.speculative.sampling import SamplingParams

    try:
        settings = get_settings()
        overrides = {"num_draft_tokens": gamma, "min_draft_tokens": min_gamma, "max_draft_tokens": max_gamma}
        speculative = settings.speculative.model_validate(
            {**settings.speculative.model_dump(), **{k: v for k, v in overrides.items() if v is not None}}
        )
        sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        if max_new_tokens < 1 or max_new_tokens > settings.max_new_tokens_limit:
            raise ValueError(f"--max-new-tokens must be in 1..{settings.max_new_tokens_limit}, got {max_new_tokens}")
    except ValidationError as exc:
        _fail(_describe_gamma_error(exc))
    except ValueError as exc:
        _fail(str(exc))
    _setup(threads or settings.num_threads, verbose)
    from dataclasses import replace

    from services.engine import GenerationOptions
    from services.engine import generate as run_generate
    from services.models.drafters import load_draft_source
    from services.models.loading import load_model
    from services.models.progress import loading_progress
    from services.models.tokenization import encode_prompt

    draft_spec = "none" if mode is Mode.ar else (draft or settings.draft)
    if draft_spec.startswith("synthetic:"):
        _fail(f"--draft {draft_spec}: synthetic drafts need reference runs; use them in `mirror-sd bench`")
    try:
        with loading_progress(enabled=not as_json) as progress:
            progress.stage(f"loading target {target or settings.target}")
            target_model = load_model(
                target or settings.target,
                precision=precision or settings.target_precision,
                device=settings.device,
                cache_dir=settings.cache_dir,
            )
            progress.stage(f"loading draft {draft_spec}")
            draft_source = load_draft_source(
                draft_spec,
                target_model,
                speculative=speculative,
                precision=draft_precision or settings.draft_precision,
                chunk_size=settings.prefill_chunk_size,
            )
        if target_model.tokenizer is None:
            raise ValueError(f"target {target_model.name!r} has no tokenizer; it cannot take a text prompt")
        prompt_ids = encode_prompt(target_model.tokenizer, prompt, chat=chat)
        options = GenerationOptions(
            sampling=sampling,
            max_new_tokens=max_new_tokens,
            stop=tuple(stop or ()),
            speculative=speculative,
            chunk_size=settings.prefill_chunk_size,
        )
        if speculative.block_policy == "cost" and not draft_source.is_none:
            from services.engine.profile import measure_cost_model

            options = replace(options, cost=measure_cost_model(target_model, draft_source, settings.cache_dir))
        result = run_generate(target_model, draft_source, prompt_ids, options)
    except (MirrorSDError, ValueError) as exc:
        _fail(str(exc))
    if as_json:
        typer.echo(json.dumps({"mode": mode.value, "target": target_model.name, **result.to_dict()}))
        return
    typer.echo(result.text)
    stats = result.stats
    typer.echo(
        f"[{mode.value} draft={result.draft}] {result.num_tokens} tokens in {result.total_s:.2f}s "
        f"({result.tokens_per_s:.1f} tok/s, TTFT {result.ttft_s * 1000:.0f} ms); rounds {stats.num_target_calls}, "
        f"acceptance {stats.acceptance_rate:.2f}, mean acceptance length {stats.mean_acceptance_length:.2f}",
        err=True,
    )


@app.command()
def bench(
    prompts: Annotated[str, typer.Option(help="JSONL (ours or Spec-Bench) or ShareGPT JSON (default: the repository's "
                                         "data/dev_prompts.jsonl)")] = str(DEV_PROMPTS_PATH),
    modes: Annotated[str, typer.Option(help="comma list of ar, sd:<draft> (incl. sd:synthetic:<a>), hf-assisted[:<draft>], hf-lookup[:<n>], stack; with --concurrency: stack, stack-ar, baseline, hf-batch")] = BENCH_DEFAULT_MODES,
    target: Annotated[str | None, typer.Option()] = None,
    limit: Annotated[int | None, typer.Option(min=1)] = None,
    per_group: Annotated[int | None, typer.Option("--per-group", min=1, help="first N open and N grounded")] = None,
    categories: Annotated[str | None, typer.Option(help="comma list of categories")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", min=1)] = 128,
    repeat: Annotated[int, typer.Option(min=1)] = 1,
    warmup: Annotated[int, typer.Option(min=0, help="8-token runs before each mode's first timed run")] = 1,
    temperature: Annotated[float, typer.Option(help="0 = greedy (checked against ar)")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k")] = 0,
    seed: Annotated[int | None, typer.Option()] = 0,
    threads: Annotated[int | None, typer.Option()] = None,
    chat: Annotated[bool, typer.Option("--chat/--no-chat", help="wrap prompts in the target's chat template")] = True,
    progress: Annotated[bool, typer.Option("--progress/--no-progress")] = True,
    block_policy: Annotated[str | None, typer.Option("--block-policy", help="acceptance or cost (default: settings)")] = None,
    out: Annotated[str, typer.Option(help="folder for results.json, results.md, the PNG plots and the runs journal")] = "bench-results",
    resume: Annotated[bool | None, typer.Option("--resume/--fresh", help="continue the runs journalled in --out by an interrupted run with the same settings, or start over (default: refuse to replace a journal that holds runs)")] = None,
    report_only: Annotated[bool, typer.Option("--report-only", help="run nothing: report the prompts the journal in --out holds in every mode")] = False,
    url: Annotated[str, typer.Option(help="gateway for the stack mode")] = "http://127.0.0.1:8000",
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="MIRROR_SD_API_KEY")] = None,
    redis_url: Annotated[str | None, typer.Option("--redis-url", help="the stack's Redis, for transport and drafting figures (default: settings)")] = None,
    concurrency: Annotated[str | None, typer.Option(help="throughput under load: comma list of requests in flight, e.g. 1,4,8,16,32; modes stack, stack-ar, baseline, hf-batch")] = None,
    baseline_url: Annotated[str | None, typer.Option("--baseline-url", help="another gateway for the baseline mode")] = None,
    requests: Annotated[int | None, typer.Option(min=1, help="requests per concurrency level (default: max(prompts, level))")] = None,
    max_prompt_chars: Annotated[int | None, typer.Option("--max-prompt-chars", min=1, help="only prompts at most this long")] = None,
) -> None:
    """Benchmark decoding modes on one prompt set, in one process; greedy runs must equal ar.

    With --concurrency: throughput and latency of a running stack at each number of requests in flight,
    against its own plain route and transformers' static batching (hf-batch)."""
    from pathlib import Path

    from services.bench.prompts import load_prompts, select_prompts
    from services.bench.run import BenchConfig, parse_modes, run_bench
    from services.config import get_settings
    from services.speculative.sampling import SamplingParams

    settings = get_settings()
    if concurrency is not None:
        _bench_concurrency(prompts=prompts, modes=modes if modes != BENCH_DEFAULT_MODES else "stack,stack-ar,hf-batch",
                           target=target, limit=limit, per_group=per_group, categories=categories,
                           max_prompt_chars=max_prompt_chars, levels=concurrency, requests=requests,
                           max_new_tokens=max_new_tokens, threads=threads, chat=chat, out=out, url=url,
                           baseline_url=baseline_url, api_key=api_key, redis_url=redis_url, repeat=repeat)
        return
    if block_policy is not None:
        if block_policy not in ("acceptance", "cost"):
            _fail(f"--block-policy must be acceptance or cost, got {block_policy!r}")
        settings = settings.model_copy(update={"speculative": settings.speculative.model_copy(
            update={"block_policy": block_policy})})
    try:
        config = BenchConfig(
            modes=parse_modes(modes),
            prompts=select_prompts(load_prompts(Path(prompts)), limit=limit, per_group=per_group,
                                   categories=categories.split(",") if categories else None),
            sampling=SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed),
            max_new_tokens=max_new_tokens, repeat=repeat, warmup=warmup, url=url, api_key=api_key, redis_url=redis_url,
            chat=chat, progress=progress, resume=resume, report_only=report_only,
            meta={"prompts": prompts, "threads": threads or settings.num_threads,
                  "block_policy": settings.speculative.block_policy},
        )
    except ValueError as exc:
        _fail(str(exc))
    target_model = _bench_target(config.prompts, target, threads, settings)
    try:
        outcome = run_bench(config, settings, target_model, Path(out))
    except (ValueError, MirrorSDError) as exc:
        _fail(str(exc))
    typer.echo(outcome.table)
    typer.echo("wrote " + ", ".join(str(path) for path in outcome.files))
    for mode, ids in outcome.peer_mismatches.items():
        typer.echo(f"note: transformers' {mode} differs from ar on {', '.join(ids)}", err=True)
    for mode, ids in outcome.mismatches.items():
        typer.echo(f"MISMATCH {mode}: greedy output differs from ar on {', '.join(ids)}", err=True)
    if outcome.mismatches:
        raise typer.Exit(code=1)


def _bench_target(prompts: list, target: str | None, threads: int | None, settings):
    """The bench's common start: some prompts chosen, threads set, the target loaded (errors exit 2)."""
    from services.models.loading import load_model

    if not prompts:
        _fail("no prompts selected")
    _setup(threads or settings.num_threads, False)
    try:
        return load_model(target or settings.target, precision=settings.target_precision, device=settings.device)
    except MirrorSDError as exc:
        _fail(str(exc))


def _bench_concurrency(*, prompts: str, modes: str, target: str | None, limit: int | None, per_group: int | None,
                       categories: str | None, max_prompt_chars: int | None, levels: str, requests: int | None,
                       max_new_tokens: int, threads: int | None, chat: bool, out: str, url: str,
                       baseline_url: str | None, api_key: str | None, redis_url: str | None, repeat: int) -> None:
    from pathlib import Path

    from services.bench.concurrency import (
        ConcurrencyConfig,
        parse_concurrency_modes,
        parse_levels,
        run_concurrency_bench,
    )
    from services.bench.prompts import load_prompts, select_prompts
    from services.config import get_settings

    settings = get_settings()
    try:
        chosen = load_prompts(Path(prompts))
        if max_prompt_chars is not None:
            chosen = [prompt for prompt in chosen if len(prompt.prompt) <= max_prompt_chars]
        chosen = select_prompts(chosen, limit=limit, per_group=per_group,
                                categories=categories.split(",") if categories else None)
        config = ConcurrencyConfig(levels=parse_levels(levels), modes=parse_concurrency_modes(modes, baseline_url),
                                   prompts=chosen, max_tokens=max_new_tokens, url=url, model=settings.target,
                                   baseline_url=baseline_url, api_key=api_key,
                                   redis_url=redis_url or settings.redis_url, chat=chat, requests=requests,
                                   repeat=repeat)
    except ValueError as exc:
        _fail(str(exc))
    target_model = _bench_target(config.prompts, target, threads, settings)
    try:
        rows, mismatches, files = run_concurrency_bench(config, target_model, Path(out),
                                                        progress=lambda line: typer.echo(line, err=True))
    except (ValueError, RuntimeError, MirrorSDError) as exc:
        _fail(str(exc))
    typer.echo(Path(files[1]).read_text())
    typer.echo("wrote " + ", ".join(str(path) for path in files))
    if any(mismatch.fatal for mismatch in mismatches):
        raise typer.Exit(code=1)


@app.command()
def distill(
    out: Annotated[str, typer.Option(help="folder for the corpus, checkpoints, the draft and recipe.json")],
    target: Annotated[str | None, typer.Option()] = None,
    layers: Annotated[int, typer.Option(min=1, help="decoder layers of the draft")] = 2,
    init_layers: Annotated[str, typer.Option("--init-layers", help="target layers to start from, e.g. 0,-1")] = "0,-1",
    keep_tokens: Annotated[int, typer.Option("--keep-tokens", min=16, help="size of the trimmed head")] = 8192,
    num_prompts: Annotated[int | None, typer.Option("--num-prompts", min=1, help="first N seed prompts")] = None,
    samples_per_prompt: Annotated[int, typer.Option("--samples-per-prompt", min=1, help="1 = the greedy answer only")] = 1,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", min=1)] = 192,
    generate_batch_size: Annotated[int, typer.Option("--generate-batch-size", min=1)] = 32,
    steps: Annotated[int, typer.Option(min=1)] = 1200,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1)] = 8,
    lr: Annotated[float, typer.Option(min=0.0)] = 5e-4,
    seed: Annotated[int, typer.Option()] = 0,
    precision: Annotated[str, typer.Option(help="training autocast: auto (bf16 where the CPU has it), fp32, bf16")] = "auto",
    chat: Annotated[bool, typer.Option("--chat/--no-chat", help="seed prompts in the chat template")] = True,
    pause_after: Annotated[int | None, typer.Option("--pause-after", min=1, help="stop after N steps; rerun resumes")] = None,
    threads: Annotated[int | None, typer.Option(min=1)] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress")] = True,
) -> None:
    """Train a small draft on text the target generates (knowledge distillation); rerun to resume.

    The defaults are the recipe of the shipped default draft (services/models/default_draft/recipe.json)."""
    from pathlib import Path

    from services.config import get_settings
    from services.distill.run import DistillRecipe, distill as run_distill, resolve_bf16
    from services.models.loading import load_model

    settings = get_settings()
    try:
        init = [int(part) for part in init_layers.split(",") if part.strip()]
    except ValueError:
        _fail(f"--init-layers {init_layers!r}: use comma-separated layer numbers, e.g. 0,-1")
    try:
        resolve_bf16(precision)
    except ValueError as exc:
        _fail(str(exc))
    recipe = DistillRecipe(target=target or settings.target, seed=seed, num_layers=layers, init_from_layers=init,
                           keep_tokens=keep_tokens, num_prompts=num_prompts, samples_per_prompt=samples_per_prompt,
                           max_new_tokens=max_new_tokens, generate_batch_size=generate_batch_size, steps=steps,
                           batch_size=batch_size, lr=lr, precision=precision, chat=chat)
    _setup(threads or settings.num_threads, False)
    try:
        target_model = load_model(recipe.target, precision="fp32", device=settings.device,
                                  cache_dir=settings.cache_dir)
        report = run_distill(target_model, recipe, Path(out), progress=progress, pause_after=pause_after)
    except (ValueError, MirrorSDError) as exc:
        _fail(str(exc))
    if "paused_at_step" in report:
        typer.echo(f"paused at step {report['paused_at_step']} of {report['steps']}; rerun the same command to go on")
        return
    after, before = report["heldout_after"], report["heldout_before"]
    typer.echo(f"draft written to {out} ({report['corpus']['answer_tokens']} target tokens, "
               f"{report['keep']['tokens']} kept tokens covering {report['keep']['top1_coverage']:.1%} of top-1)")
    typer.echo(f"held-out top-1 agreement {before['top1_agreement']:.3f} -> {after['top1_agreement']:.3f}; "
               f"use it with --draft {out}")


def _apply_env(**values: object) -> None:
    """CLI flags become MIRROR_SD_* variables, so child processes and get_settings() agree."""
    import os

    for name, value in values.items():
        if value is not None:
            os.environ[f"MIRROR_SD_{name.upper()}"] = str(value)


@app.command("verify-worker")
def verify_worker_command(
    pool: Annotated[str | None, typer.Option(help="pool to serve (default settings.worker.pool)")] = None,
    worker_id: Annotated[str | None, typer.Option("--worker-id")] = None,
    threads: Annotated[int | None, typer.Option()] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Run a verify worker: the target model, verifying blocks from its pool and its own queue."""
    _apply_env(worker__pool=pool, worker__worker_id=worker_id, num_threads=threads)
    from services.config import get_settings
    from verify_worker.main import run_verify_worker

    settings = get_settings()
    _setup(settings.num_threads, verbose)
    logging.getLogger().setLevel(logging.INFO)
    try:
        run_verify_worker(settings)
    except MirrorSDError as exc:
        _fail(str(exc))


@app.command("draft-worker")
def draft_worker_command(
    pool: Annotated[str | None, typer.Option(help="pool whose sessions to drive")] = None,
    concurrency: Annotated[int | None, typer.Option(help="sessions driven at once (threads)")] = None,
    worker_id: Annotated[str | None, typer.Option("--worker-id")] = None,
    threads: Annotated[int | None, typer.Option()] = None,
    loglevel: Annotated[str, typer.Option()] = "INFO",
) -> None:
    """Run a Celery draft worker on queue draft.<pool> (thread pool: torch releases the GIL)."""
    _apply_env(worker__pool=pool, worker__worker_id=worker_id, num_threads=threads,
               worker__draft_concurrency=concurrency)
    from draft_worker.tasks import celery_app
    from services.config import get_settings
    from services.protocol import draft_queue

    settings = get_settings()
    name = settings.worker.worker_id or f"draft-{settings.worker.pool}"
    celery_app.worker_main([
        "worker", "--queues", draft_queue(settings.worker.pool), "--pool", "threads",
        "--concurrency", str(settings.worker.draft_concurrency), "--hostname", f"{name}@%h",
        "--loglevel", loglevel, "--without-mingle", "--without-gossip",
    ])


@app.command()
def up(
    port: Annotated[int, typer.Option(help="gateway port")] = 8000,
    auth_disabled: Annotated[bool, typer.Option("--auth-disabled/--auth", help="development only")] = True,
    draft: Annotated[str | None, typer.Option(help="draft spec for the draft worker (default: settings)")] = None,
    pin: Annotated[bool, typer.Option("--pin/--no-pin", help="draft and verify workers on separate cores")] = False,
) -> None:
    """Run the local stack (gateway, draft worker, verify worker) with the built-in model until Ctrl-C."""
    import signal as signal_lib
    import threading

    from services.config import get_settings
    from services.stack import start_stack, stop_children
    from services.storage.db import init_db

    _apply_env(gateway__auth_disabled=str(auth_disabled).lower(), draft=draft)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    settings = get_settings()
    init_db(settings.database_url)  # migrate once, before the children race to it
    typer.echo(f"starting gateway on :{port}, a draft worker and a verify worker ({settings.target}) ...", err=True)
    try:
        children, private = start_stack(redis_url=settings.redis_url, port=port, draft=settings.draft, pin=pin)
    except RuntimeError as exc:
        _fail(str(exc))
    typer.echo(
        f"ready. Try:\n  curl -s localhost:{port}/v1/chat/completions -H 'Content-Type: application/json' "
        f"-d '{{\"model\": \"{settings.target}\", \"messages\": [{{\"role\": \"user\", \"content\": "
        f"\"Say hello\"}}], \"max_tokens\": 32}}'\nCtrl-C stops everything.",
        err=True,
    )
    stop = threading.Event()
    for signum in (signal_lib.SIGINT, signal_lib.SIGTERM):
        signal_lib.signal(signum, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            dead = [name for name, child in children.items() if child.poll() is not None]
            if dead:
                typer.echo(f"{', '.join(dead)} exited; stopping the stack", err=True)
                break
    finally:
        stop_children(children)
        if private is not None:
            private.stop()


@telemetry_app.command("run")
def telemetry_run() -> None:
    """Turn heartbeats into the routing table (fallback rules), every telemetry.interval_s."""
    from services.config import get_settings
    from telemetry.main import run_telemetry

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    run_telemetry(get_settings())


@telemetry_app.command("inject")
def telemetry_inject(
    worker: Annotated[str, typer.Option(help="worker id (see mirror-sd status)")],
    temperature: Annotated[float | None, typer.Option(help="degrees C")] = None,
    utilization: Annotated[float | None, typer.Option(help="0..1")] = None,
    memory: Annotated[float | None, typer.Option(help="used fraction 0..1")] = None,
    device_kind: Annotated[str | None, typer.Option("--device-kind", help="e.g. cuda")] = None,
    duration: Annotated[str, typer.Option("--for", help="how long, e.g. 30s, 2m")] = "30s",
    clear: Annotated[bool, typer.Option("--clear", help="remove the override now")] = False,
) -> None:
    """Override a worker's probe readings for a while (tests and drills)."""
    import time

    import msgpack

    from services.config import get_settings
    from services.protocol import probe_override_key
    from services.redis_client import connect
    from telemetry.main import parse_duration

    client = connect(get_settings().redis_url)
    if clear:
        client.delete(probe_override_key(worker))
        typer.echo(f"cleared the override of {worker}")
        return
    try:
        seconds = parse_duration(duration)
        if utilization is not None and not 0 <= utilization <= 1:
            raise ValueError(f"--utilization must be in 0..1, got {utilization}")
    except ValueError as exc:
        _fail(str(exc))
    override = {"temperature_c": temperature, "utilization": utilization, "memory_used_frac": memory,
                "expires_at": time.time() + seconds}
    if device_kind:
        override["device_kind"] = device_kind
    client.set(probe_override_key(worker), msgpack.packb(override), ex=int(seconds) + 1)
    typer.echo(f"override on {worker} for {seconds:.0f}s: "
               + ", ".join(f"{k}={v}" for k, v in override.items() if v is not None and k != "expires_at"))


@telemetry_app.command("drill")
def telemetry_drill(
    worker: Annotated[str, typer.Option(help="an accelerator-pool verify worker")],
    temperature: Annotated[float, typer.Option()] = 90.0,
    url: Annotated[str, typer.Option(help="gateway")] = "http://127.0.0.1:8000",
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="MIRROR_SD_API_KEY")] = None,
) -> None:
    """Inject a temperature, then time the routing change and the first request that follows it."""
    from services.config import get_settings
    from services.redis_client import connect
    from telemetry.drill import run_drill

    settings = get_settings()
    try:
        result = run_drill(connect(settings.redis_url), worker=worker, temperature=temperature, url=url,
                           model=settings.gateway.model_name or settings.target, api_key=api_key)
    except TimeoutError as exc:
        _fail(str(exc))
    typer.echo(f"{temperature:.0f} C on {worker}: routing v{result.routing_version} {result.pool_weights} after "
               f"{result.to_routing_change_s * 1000:.0f} ms; first request on pool {result.first_rerouted_pool!r} "
               f"{result.to_first_rerouted_request_s * 1000:.0f} ms after the injection")


@app.command()
def status(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Workers, pools, temperatures, utilization, acceptance and routing weights."""
    import json as json_lib
    import time

    from services.config import get_settings
    from services.redis_client import connect
    from services.redis_client import read_heartbeats
    from telemetry.service import read_routing_table

    client = connect(get_settings().redis_url)
    beats = sorted(read_heartbeats(client), key=lambda b: (b.role, b.pool, b.worker_id))
    table = read_routing_table(client)
    if as_json:
        typer.echo(json_lib.dumps({"workers": [b.to_dict() for b in beats],
                                   "routing": table.to_dict() if table else None}))
        return
    typer.echo(f"{'worker':32} {'role':7} {'pool':6} {'device':6} {'temp':>6} {'util':>5} {'accept':>6} "
               f"{'p99 ms':>7} {'sessions':>8} {'age':>5}")
    for b in beats:
        temp = f"{b.temperature_c:.0f}C" if b.temperature_c is not None else "-"
        accept = f"{b.acceptance_rate:.2f}" if b.acceptance_rate is not None else "-"
        p99 = f"{b.latency_p99_ms:.0f}" if b.latency_p99_ms is not None else "-"
        typer.echo(f"{b.worker_id:32} {b.role:7} {b.pool:6} {b.device_kind:6} {temp:>6} {b.utilization:5.2f} "
                   f"{accept:>6} {p99:>7} {b.num_sessions:8d} {time.time() - b.sent_at:4.1f}s")
    if table is None:
        typer.echo("routing: no table yet (is `mirror-sd telemetry run` up?)")
    else:
        weights = ", ".join(f"{pool} {weight:.2f}" for pool, weight in table.pool_weights.items())
        typer.echo(f"routing v{table.version}: {weights}; ar {table.ar_pools or '-'}; degraded "
                   f"{table.degraded_pools or '-'}; hot {table.hot_workers or '-'}; alerts {table.alerts or '-'}")


@app.command("gateway")
def gateway_command(
    host: Annotated[str | None, typer.Option()] = None,
    port: Annotated[int | None, typer.Option()] = None,
    auth_disabled: Annotated[bool | None, typer.Option("--auth-disabled/--auth", help="development only")] = None,
) -> None:
    """Run the OpenAI-compatible HTTP gateway."""
    _apply_env(gateway__host=host, gateway__port=port,
               gateway__auth_disabled=None if auth_disabled is None else str(auth_disabled).lower())
    import uvicorn

    from services.config import get_settings

    try:
        settings = get_settings()
    except ValueError as exc:
        _fail(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    uvicorn.run("gateway.app:create_app", factory=True, host=settings.gateway.host, port=settings.gateway.port,
                log_level="info")


def _db():
    from services.config import get_settings
    from services.storage.db import init_db, session_factory

    return session_factory(init_db(get_settings().database_url))


@keys_app.command("create")
def keys_create(
    name: Annotated[str, typer.Option(help="who the key is for")] = "default",
    priority: Annotated[str, typer.Option(help="high | normal | low")] = "normal",
) -> None:
    """Create a key; it is printed once and only its hash is stored."""
    from services.storage import crud

    try:
        with _db()() as session:
            row, key = crud.create_api_key(session=session, name=name, priority=priority)
    except ValueError as exc:
        _fail(str(exc))
    typer.echo(key)
    typer.echo(f"created key {row.id} ({row.key_prefix}..., priority {row.priority}) for {name!r}", err=True)


@keys_app.command("list")
def keys_list() -> None:
    from services.storage import crud

    with _db()() as session:
        for row in crud.list_api_keys(session=session):
            state = "revoked" if row.revoked_at else "active"
            typer.echo(f"{row.id}\t{row.key_prefix}...\t{row.priority}\t{state}\t{row.name}")


@keys_app.command("revoke")
def keys_revoke(key_id: Annotated[int, typer.Argument()]) -> None:
    from services.storage import crud

    with _db()() as session:
        if not crud.revoke_api_key(session=session, key_id=key_id):
            _fail(f"no active key with id {key_id}")
    typer.echo(f"revoked key {key_id}")


@models_app.command("list")
def models_list() -> None:
    """Built-in aliases and whether their converted weights are cached."""
    from services.config import get_settings
    from services.models.builtin import BUILTIN_MODELS, converted_dir, is_converted

    cache_dir = get_settings().cache_dir
    for alias, builtin in BUILTIN_MODELS.items():
        state = "cached" if is_converted(builtin, cache_dir) else "not converted yet"
        typer.echo(f"{alias}\t{builtin.display_name}\t{state}\t{converted_dir(builtin, cache_dir)}")


@models_app.command("prepare")
def models_prepare(
    alias: Annotated[str, typer.Argument(help="built-in alias")] = "smollm2-135m",
) -> None:
    """Convert a built-in model's GGUF into the cache once (make install runs this)."""
    from services.config import get_settings
    from services.models.builtin import BUILTIN_MODELS, convert_builtin

    if alias not in BUILTIN_MODELS:
        _fail(f"unknown built-in model {alias!r}; known: {', '.join(BUILTIN_MODELS)}")
    try:
        path = convert_builtin(BUILTIN_MODELS[alias], get_settings().cache_dir)
    except MirrorSDError as exc:
        _fail(str(exc))
    typer.echo(f"{alias}: {path}")


@models_app.command("profile")
def models_profile(
    target: Annotated[str | None, typer.Option()] = None,
    layouts: Annotated[str | None, typer.Option("--layout", help="comma list of transposed, native (default: settings)")] = None,
    draft: Annotated[str | None, typer.Option(help="also time this draft's cost per token")] = None,
    context: Annotated[int, typer.Option(min=1, help="tokens already in the KV cache")] = 64,
    repeats: Annotated[int, typer.Option(min=1)] = 5,
    threads: Annotated[int | None, typer.Option(min=1)] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Time one target forward over 1..9 tokens here (the verify cost curve the block-length controller reads)."""
    import json

    from services.config import get_settings
    from services.engine.profile import measure_draft_profile, measure_verify_profiles
    from services.models.drafters import load_draft_source
    from services.models.linear_layout import LAYOUTS
    from services.models.loading import load_model

    settings = get_settings()
    chosen = [item.strip() for item in (layouts or settings.cpu_weight_layout).split(",") if item.strip()]
    for layout in chosen:
        if layout not in LAYOUTS:
            _fail(f"--layout {layout!r}: choose from {', '.join(LAYOUTS)}")
    if len(chosen) > 1 and (settings.target_precision != "fp32" or settings.device != "cpu"):
        _fail(f"layouts differ for fp32 on cpu only, not {settings.target_precision} on {settings.device}")
    _setup(threads or settings.num_threads, False)
    try:
        loaded = {layout: load_model(target or settings.target, precision=settings.target_precision,
                                     device=settings.device, layout=layout) for layout in chosen}
        results = measure_verify_profiles(loaded, context_tokens=context, rounds=repeats)
        if draft:
            for layout in chosen:
                source = load_draft_source(draft, loaded[layout], speculative=settings.speculative)
                results[layout].update(measure_draft_profile(source, loaded[layout].vocab_size,
                                                             context_tokens=context, repeats=repeats))
    except (ValueError, MirrorSDError) as exc:
        _fail(str(exc))
    if as_json:
        typer.echo(json.dumps(results, indent=1))
        return
    typer.echo("tokens\t" + "\t".join(f"{layout} ms\t(x 1 token)" for layout in chosen))
    for size in range(1, 10):
        cells = []
        for layout in chosen:
            value, single = results[layout][f"verify_ms_{size}"], results[layout]["verify_ms_1"]
            cells.append(f"{value:.1f}\t({value / single:.2f})")
        typer.echo(f"{size}\t" + "\t".join(cells))
    for layout in chosen:
        if "draft_ms_per_token" in results[layout]:
            typer.echo(f"draft {draft} ({layout} target): {results[layout]['draft_ms_per_token']:.2f} ms per token")


@models_app.command("step-profile")
def models_step_profile(
    target: Annotated[str | None, typer.Option(help="model to time (default: settings.target)")] = None,
    random: Annotated[str | None, typer.Option(help="time a random-weight Llama of this shape instead: tiny, "
                                               "smollm2-135m, llama-1b, llama-8b")] = None,
    device: Annotated[str | None, typer.Option(help="cpu, cuda, cuda:1 ... (default: settings.device)")] = None,
    precision: Annotated[str | None, typer.Option(help="fp32, bf16, fp16, int8 (default: settings)")] = None,
    rows: Annotated[str, typer.Option(help="rows (sessions) per step")] = "1,2,4,8,16,32",
    tokens: Annotated[str, typer.Option(help="tokens per row (1 = plain decoding, g + 1 = a block of g)")] = "1,2,3,5,9",
    context: Annotated[int, typer.Option(min=1, help="tokens each row already holds in the KV store")] = 256,
    repeats: Annotated[int, typer.Option(min=1)] = 3,
    threads: Annotated[int | None, typer.Option(min=1)] = None,
    breakdown: Annotated[bool, typer.Option("--breakdown", help="also: the share of a step at the largest row "
                                            "count spent in the KV store (reserve, write, view, crop)")] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Time batched target steps over rows x tokens per row (the grid the load-aware controller reads)."""
    from services.config import get_settings
    from services.engine.profile import measure_kv_share, measure_verify_profile, step_table
    from services.models.engine import TorchEngine
    from services.models.loading import load_model
    from services.models.random_shapes import build_random_model

    settings = get_settings()
    try:
        row_counts = sorted({int(part) for part in rows.split(",") if part.strip()})
        sizes = sorted({int(part) for part in tokens.split(",") if part.strip()})
        if not row_counts or not sizes or min(row_counts + sizes) < 1:
            raise ValueError("--rows and --tokens need integers >= 1")
    except ValueError as exc:
        _fail(f"--rows {rows!r} / --tokens {tokens!r}: {exc}")
    _setup(threads or settings.num_threads, False)
    chosen_precision = precision or settings.target_precision
    try:
        if random is not None:
            loaded = build_random_model(random, precision=chosen_precision, device=device or settings.device)
        else:
            loaded = load_model(target or settings.target, precision=chosen_precision,
                                device=device or settings.device)
        engine = TorchEngine(loaded)
        profile = measure_verify_profile(engine, context_tokens=context, repeats=repeats, sizes=tuple(sizes),
                                         max_rows=max(row_counts), step_sizes=tuple(sizes),
                                         step_rows=tuple(row_counts))
        kv = measure_kv_share(engine, rows=max(row_counts), context_tokens=context) if breakdown else None
    except (ValueError, RuntimeError, MirrorSDError) as exc:
        _fail(str(exc))
    if as_json:
        typer.echo(json.dumps({"model": loaded.name, "device": str(loaded.device), "precision": chosen_precision,
                               "context": context, "profile": profile, "kv_store": kv}))
        return
    typer.echo(f"{loaded.name} ({chosen_precision}, {loaded.device}), {context} tokens of context per row")
    typer.echo(step_table(profile, row_counts, sizes))
    if kv is not None:
        typer.echo(f"KV store at {max(row_counts)} rows x 1 token: {kv['kv_ms']:.2f} ms of a {kv['step_ms']:.1f} ms "
                   f"step ({kv['kv_share']:.1%})")


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
