"""`mirror-sd distill`: train a small draft on text the target generates."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from services.cli.common import fail, setup
from services.errors import MirrorSDError

logger = logging.getLogger(__name__)


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
        fail(f"--init-layers {init_layers!r}: use comma-separated layer numbers, e.g. 0,-1")
    try:
        resolve_bf16(precision)
    except ValueError as exc:
        fail(str(exc))
    recipe = DistillRecipe(target=target or settings.target, seed=seed, num_layers=layers, init_from_layers=init,
                           keep_tokens=keep_tokens, num_prompts=num_prompts, samples_per_prompt=samples_per_prompt,
                           max_new_tokens=max_new_tokens, generate_batch_size=generate_batch_size, steps=steps,
                           batch_size=batch_size, lr=lr, precision=precision, chat=chat)
    setup(threads or settings.num_threads, False)
    try:
        target_model = load_model(recipe.target, precision="fp32", device=settings.device,
                                  cache_dir=settings.cache_dir)
        report = run_distill(target_model, recipe, Path(out), progress=progress, pause_after=pause_after)
    except (ValueError, MirrorSDError) as exc:
        fail(str(exc))
    if "paused_at_step" in report:
        typer.echo(f"paused at step {report['paused_at_step']} of {report['steps']}; rerun the same command to go on")
        return
    after, before = report["heldout_after"], report["heldout_before"]
    typer.echo(f"draft written to {out} ({report['corpus']['answer_tokens']} target tokens, "
               f"{report['keep']['tokens']} kept tokens covering {report['keep']['top1_coverage']:.1%} of top-1)")
    typer.echo(f"held-out top-1 agreement {before['top1_agreement']:.3f} -> {after['top1_agreement']:.3f}; "
               f"use it with --draft {out}")
