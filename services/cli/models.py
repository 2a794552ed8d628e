"""`mirror-sd models`: the built-in models, and timing targets and drafts on this machine."""

from __future__ import annotations

import json
import logging
from typing import Annotated

import typer

from services.cli.common import fail, setup
from services.errors import MirrorSDError

logger = logging.getLogger(__name__)

app = typer.Typer(help="Built-in and local models.", no_args_is_help=True)


@app.command("list")
def models_list() -> None:
    """Built-in aliases and whether their converted weights are cached."""
    from services.config import get_settings
    from services.models.builtin import BUILTIN_MODELS, converted_dir, is_converted

    cache_dir = get_settings().cache_dir
    for alias, builtin in BUILTIN_MODELS.items():
        state = "cached" if is_converted(builtin, cache_dir) else "not converted yet"
        typer.echo(f"{alias}\t{builtin.display_name}\t{state}\t{converted_dir(builtin, cache_dir)}")


@app.command("prepare")
def models_prepare(
    alias: Annotated[str, typer.Argument(help="built-in alias")] = "smollm2-135m",
) -> None:
    """Convert a built-in model's GGUF into the cache once (make install runs this)."""
    from services.config import get_settings
    from services.models.builtin import BUILTIN_MODELS, convert_builtin

    if alias not in BUILTIN_MODELS:
        fail(f"unknown built-in model {alias!r}; known: {', '.join(BUILTIN_MODELS)}")
    try:
        path = convert_builtin(BUILTIN_MODELS[alias], get_settings().cache_dir)
    except MirrorSDError as exc:
        fail(str(exc))
    typer.echo(f"{alias}: {path}")


@app.command("profile")
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
    wanted = layouts or settings.cpu_weight_layout
    chosen = [item.strip() for item in ("native,transposed" if wanted == "auto" else wanted).split(",")
              if item.strip()]
    for layout in chosen:
        if layout not in LAYOUTS:
            fail(f"--layout {layout!r}: choose from {', '.join(LAYOUTS)}")
    if len(chosen) > 1 and (settings.target_precision != "fp32" or settings.device != "cpu"):
        fail(f"layouts differ for fp32 on cpu only, not {settings.target_precision} on {settings.device}")
    setup(threads or settings.num_threads, False)
    try:
        loaded = {layout: load_model(target or settings.target, precision=settings.target_precision,
                                     device=settings.device, layout=layout) for layout in chosen}
        results = measure_verify_profiles(loaded, context_tokens=context, rounds=repeats)
        if draft:
            for layout in chosen:
                source = load_draft_source(draft, loaded[layout], speculative=settings.speculative,
                                           llamacpp=settings.llamacpp, cache_dir=settings.cache_dir)
                results[layout].update(measure_draft_profile(source, loaded[layout].vocab_size,
                                                             context_tokens=context, repeats=repeats))
    except (ValueError, MirrorSDError) as exc:
        fail(str(exc))
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


@app.command("step-profile")
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
        fail(f"--rows {rows!r} / --tokens {tokens!r}: {exc}")
    setup(threads or settings.num_threads, False)
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
        fail(str(exc))
    if as_json:
        typer.echo(json.dumps({"model": loaded.name, "device": str(loaded.device), "precision": chosen_precision,
                               "context": context, "profile": profile, "kv_store": kv}))
        return
    typer.echo(f"{loaded.name} ({chosen_precision}, {loaded.device}), {context} tokens of context per row")
    typer.echo(step_table(profile, row_counts, sizes))
    if kv is not None:
        typer.echo(f"KV store at {max(row_counts)} rows x 1 token: {kv['kv_ms']:.2f} ms of a {kv['step_ms']:.1f} ms "
                   f"step ({kv['kv_share']:.1%})")
