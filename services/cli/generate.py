"""`mirror-sd generate`: one request in this process, speculative or target-only."""

from __future__ import annotations

import json
import logging
from enum import Enum
from typing import Annotated

import typer

from services.cli.common import fail, setup
from services.errors import MirrorSDError

logger = logging.getLogger(__name__)


class Mode(str, Enum):
    sd = "sd"
    ar = "ar"


_GAMMA_FLAGS = {"num_draft_tokens": "--gamma", "min_draft_tokens": "--min-gamma", "max_draft_tokens": "--max-gamma"}


def _describe_gamma_error(exc) -> str:
    parts = []
    for error in exc.errors():
        field = ".".join(map(str, error["loc"]))
        name = _GAMMA_FLAGS.get(field, field or "gamma")
        message = error["msg"].removeprefix("Value error, ")
        parts.append(f"{name} {message.lower()}, got {error['input']!r}" if field else message)
    return "; ".join(parts)


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
    from services.speculative.params import SamplingParams

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
        fail(_describe_gamma_error(exc))
    except ValueError as exc:
        fail(str(exc))
    setup(threads or settings.num_threads, verbose)
    from dataclasses import replace

    from services.engine import GenerationOptions
    from services.engine import generate as run_generate
    from services.engine.context import check_request_fits
    from services.models.drafters import load_draft_source
    from services.models.loading import load_model
    from services.models.progress import loading_progress
    from services.models.tokenization import encode_prompt

    draft_spec = "none" if mode is Mode.ar else (draft or settings.draft)
    if draft_spec.startswith("synthetic:"):
        fail(f"--draft {draft_spec}: synthetic drafts need reference runs; use them in `mirror-sd bench`")
    try:
        with loading_progress(enabled=not as_json) as progress:
            progress.stage(f"loading target {target or settings.target}")
            target_model = load_model(
                target or settings.target,
                precision=precision or settings.target_precision,
                device=settings.device,
                cache_dir=settings.cache_dir,
            )
            if target_model.tokenizer is None:
                raise ValueError(f"target {target_model.name!r} has no tokenizer; it cannot take a text prompt")
            prompt_ids = encode_prompt(target_model.tokenizer, prompt, chat=chat)
            # a prompt that cannot fit is refused before the draft loads (and its engine is checked)
            check_request_fits(target_model.name, target_model.max_context, len(prompt_ids), max_new_tokens)
            progress.stage(f"loading draft {draft_spec}")
            draft_source = load_draft_source(
                draft_spec,
                target_model,
                speculative=speculative,
                precision=draft_precision or settings.draft_precision,
                chunk_size=settings.prefill_chunk_size,
                llamacpp=settings.llamacpp,
                cache_dir=settings.cache_dir,
                suffix=settings.suffix,
            )
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
        fail(str(exc))
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
