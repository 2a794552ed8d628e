"""`mirror-sd bench`: decoding modes side by side on one prompt set, or a running stack under load."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from services.bench.prompts import DEV_PROMPTS_PATH
from services.cli.common import fail, setup
from services.errors import MirrorSDError

logger = logging.getLogger(__name__)

BENCH_DEFAULT_MODES = "ar,sd:auto,sd:ngram"  # auto: suffix drafts or the built-in target's own GGUF, per round


def bench(
    prompts: Annotated[str, typer.Option(help="JSONL (ours or Spec-Bench) or ShareGPT JSON (default: the repository's "
                                         "data/dev_prompts.jsonl)")] = str(DEV_PROMPTS_PATH),
    modes: Annotated[str, typer.Option(help="comma list of ar, sd:<draft> (incl. sd:synthetic:<a>), hf-assisted[:<draft>], hf-lookup[:<n>], stack; with --concurrency: stack, stack-ar, baseline, hf-batch")] = BENCH_DEFAULT_MODES,
    target: Annotated[str | None, typer.Option()] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="the first N prompts of the order balanced over categories")] = None,
    per_group: Annotated[int | None, typer.Option("--per-group", min=1, help="first N open and N grounded")] = None,
    categories: Annotated[str | None, typer.Option(help="comma list of categories")] = None,
    max_turns: Annotated[int | None, typer.Option("--max-turns", min=1, help="a conversation's first N user turns (Spec-Bench's MT-bench, ShareGPT, data/repeated_work.jsonl); each turn is a request of its own, answered with the mode's own earlier answers in context (default: every turn)")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", min=1)] = 128,
    repeat: Annotated[int, typer.Option(min=1, help="runs of each prompt (or, with --concurrency, of each level) per mode, the modes taking turns; with --concurrency in alternating order, each turn reported")] = 1,
    warmup: Annotated[int, typer.Option(min=0, help="8-token runs before each mode's first timed run; with --concurrency, untimed passes of each level (C requests at C in flight, 8 tokens) by every stack mode before its timed runs")] = 1,
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
    merging: Annotated[bool, typer.Option("--merging", help="similar-request merging through the stack at --url: TTFT sharing a ~1,000-token prefix against cold, 8 identical requests against one, unrelated prompts against --baseline-url (a stack with merging off)")] = False,
    draft_link: Annotated[str | None, typer.Option("--draft-link", metavar="RTT_MS[:JITTER_MS],...", help="the bench once per level, the stack's draft workers behind a link of that RTT (and jitter), side by side in <out>/links.md; the stack must run a draft link (mirror-sd up --draft-link 0)")] = None,
    link_turns: Annotated[int, typer.Option("--link-turns", min=1, help="with --draft-link: the levels taken in turn this many times (0,20,0,20,...) so the box's drift falls on every level alike; each level's figures are the median of its turns, and links.md adds each level over the first, turn by turn")] = 1,
    overhead: Annotated[bool, typer.Option("--overhead", help="the stack's machinery against a near-free target: starts its own stack (random:tiny, synthetic:1.0 draft, placement local, private Redis), decodes the prompts in process first, then each of --levels through the plain route (stack-ar) and the speculative one (stack): tok/s, TPOT against in process, TTFT, the verify worker's step split per stage, CPU per streamed token, py-spy profiles (overhead.md, overhead.json); --limit defaults to 16 prompts")] = False,
    overhead_levels: Annotated[str | None, typer.Option("--levels", help="with --overhead: streams in flight, comma list (default 1,8,32,64)")] = None,
    profile: Annotated[bool, typer.Option("--profile/--no-profile", help="with --overhead: one more pass of the largest level per route under py-spy, untimed")] = True,
    suffix_index: Annotated[bool, typer.Option("--suffix-index", help="our suffix index against arctic-inference's suffix tree (measured where arctic_inference.suffix_decoding imports): build us/token, lookup p50/p99 on seen and unseen contexts, draft length, memory and RSS, a flood of 5x unique text (suffix_index.md, suffix_index.json); no model loads")] = False,
    index_tokens: Annotated[str | None, typer.Option("--index-tokens", help="with --suffix-index: index sizes, comma list of tokens (default 100000,1000000)")] = None,
    capacity: Annotated[str | None, typer.Option("--capacity", metavar="TOK_S|itl:MS", help="verifier capacity: the streams in flight each still getting this many tokens/s (10) or an ITL p50 of at most this (itl:100), per mode, from a concurrency bench (levels default 1,2,4,8,16,32, modes stack,stack-ar); with --draft-link, against RTT (capacity.png)")] = None,
) -> None:
    """Benchmark decoding modes on one prompt set, in one process; greedy runs must equal ar.

    With --concurrency: throughput and latency of a running stack at each number of requests in flight,
    against its own plain route and transformers' static batching (hf-batch).
    With --draft-link: either, once per link level between the draft workers and Redis.
    With --overhead: the stack's machinery against a near-free target, on a stack it starts itself.
    With --suffix-index: our suffix index against arctic-inference's, alone (no model)."""
    from pathlib import Path

    from services.bench.prompts import load_prompts, select_prompts
    from services.bench.run import BenchConfig, parse_modes, run_bench
    from services.config import get_settings
    from services.speculative.params import SamplingParams

    if suffix_index:
        from services.cli.bench_suffix_index import bench_suffix_index

        if overhead or draft_link or concurrency or capacity or merging:
            fail("--suffix-index measures the index alone: not with --overhead, --draft-link, --concurrency, "
                 "--capacity or --merging")
        bench_suffix_index(index_tokens=index_tokens, seed=seed or 0, out=out)
        return
    if index_tokens is not None:
        fail("--index-tokens is for --suffix-index")
    if overhead:
        from services.cli.bench_overhead import bench_overhead

        if draft_link or concurrency or capacity or merging:
            fail("--overhead starts a stack of its own: not with --draft-link, --concurrency, --capacity or --merging")
        bench_overhead(prompts=prompts, levels=overhead_levels, limit=limit, max_prompt_chars=max_prompt_chars,
                       requests=requests, max_new_tokens=max_new_tokens, warmup=warmup, threads=threads, chat=chat,
                       profile=profile, out=out)
        return
    if overhead_levels is not None:
        fail("--levels is for --overhead (a running stack's levels: --concurrency)")
    settings = get_settings()
    levels = _parse_link_levels(draft_link, merging, redis_url or settings.redis_url)
    if link_turns > 1 and levels is None:
        fail(f"--link-turns {link_turns}: takes link levels in turn; give them with --draft-link (e.g. 0,20)")
    if merging:
        _bench_merging(prompts=prompts, url=url, baseline_url=baseline_url, api_key=api_key,
                       redis_url=redis_url or settings.redis_url, model=target or settings.target, out=out)
        return
    capacity_target = None
    if capacity is not None:
        from services.bench.capacity import DEFAULT_LEVELS, parse_capacity_target

        try:
            capacity_target = parse_capacity_target(capacity)
        except ValueError as exc:
            fail(str(exc))
        concurrency = concurrency or DEFAULT_LEVELS
        if modes == BENCH_DEFAULT_MODES:
            modes = "stack,stack-ar"
    if concurrency is not None:
        run_level = _bench_concurrency(
            prompts=prompts, modes=modes if modes != BENCH_DEFAULT_MODES else "stack,stack-ar,hf-batch",
            target=target, limit=limit, per_group=per_group, categories=categories,
            max_prompt_chars=max_prompt_chars, levels=concurrency, requests=requests, max_new_tokens=max_new_tokens,
            threads=threads, chat=chat, url=url, baseline_url=baseline_url, api_key=api_key, redis_url=redis_url,
            repeat=repeat, warmup=warmup, linked=levels is not None, capacity_target=capacity_target)
        _run_levels(run_level, levels, redis_url or settings.redis_url, Path(out), turns=link_turns,
                    on_levels=_capacity_plot(capacity_target, Path(out)) if capacity_target else None)
        return
    if block_policy is not None:
        if block_policy not in ("acceptance", "cost"):
            fail(f"--block-policy must be acceptance or cost, got {block_policy!r}")
        settings = settings.model_copy(update={"speculative": settings.speculative.model_copy(
            update={"block_policy": block_policy})})
    try:
        config = BenchConfig(
            modes=parse_modes(modes),
            prompts=select_prompts(load_prompts(Path(prompts)), limit=limit, per_group=per_group,
                                   categories=categories.split(",") if categories else None, max_turns=max_turns),
            sampling=SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed),
            max_new_tokens=max_new_tokens, repeat=repeat, warmup=warmup, url=url, api_key=api_key, redis_url=redis_url,
            chat=chat, progress=progress, resume=resume, report_only=report_only,
            meta={"prompts": prompts, "threads": threads or settings.num_threads,
                  "block_policy": settings.speculative.block_policy, "target_spec": target or settings.target},
        )
    except ValueError as exc:
        fail(str(exc))
    if levels is not None and "stack" not in config.modes:
        fail("--draft-link changes the link of a running stack's draft workers: add the stack mode (e.g. --modes "
             "ar,stack)")
    target_model = _bench_target(config.prompts, target, threads, settings)

    def run_level(folder: Path) -> tuple[dict, bool]:
        try:
            outcome = run_bench(config, settings, target_model, folder)
        except (ValueError, MirrorSDError) as exc:
            fail(str(exc))
        typer.echo(outcome.table)
        typer.echo("wrote " + ", ".join(str(path) for path in outcome.files))
        for mode, ids in outcome.peer_mismatches.items():
            typer.echo(f"note: transformers' {mode} differs from ar on {', '.join(ids)}", err=True)
        for mode, ids in outcome.mismatches.items():
            typer.echo(f"MISMATCH {mode}: greedy output differs from ar on {', '.join(ids)}", err=True)
        return _stack_headline(folder / "results.json"), bool(outcome.mismatches)

    _run_levels(run_level, levels, redis_url or settings.redis_url, Path(out), turns=link_turns)


def _parse_link_levels(text: str | None, merging: bool, redis_url: str):
    """--draft-link's levels (None without it), once a draft link is found running: before a model loads."""
    if text is None:
        return None
    from services.bench.links import find_draft_link
    from services.link.spec import parse_link_levels

    if merging:
        fail("--draft-link runs the stack or concurrency bench once per link level; not with --merging")
    try:
        levels = parse_link_levels(text)
    except ValueError as exc:
        fail(f"--draft-link: {exc}")
    try:
        find_draft_link(redis_url)
    except RuntimeError as exc:
        fail(str(exc))
    return levels


def _capacity_plot(target, out):
    """After the link levels: capacity against RTT, per mode."""
    def plot(rows) -> None:
        from services.bench.capacity import plot_capacity_vs_link

        path = plot_capacity_vs_link([(row.link, row.headline) for row in rows], target, out / "capacity.png")
        if path is not None:
            typer.echo(f"wrote {path}")

    return plot


def _run_levels(run_level, levels, redis_url: str, out, on_levels=None, turns: int = 1):
    """The bench once (levels None) or once per draft link level (`turns` times, in turn), side by side (then
    on_levels(rows)); exit 1 on a greedy mismatch."""
    if levels is None:
        failed = run_level(out)[1]
    else:
        from services.bench.links import run_link_levels

        failures = []

        def one_level(folder):
            headline, failed_here = run_level(folder)
            failures.append(failed_here)
            return headline

        try:
            rows, files = run_link_levels(levels, redis_url=redis_url, out_dir=out, run_level=one_level,
                                          progress=lambda line: typer.echo(line, err=True), turns=turns)
        except RuntimeError as exc:
            fail(str(exc))
        typer.echo(files[1].read_text())
        typer.echo("wrote " + ", ".join(str(path) for path in files))
        if on_levels is not None:
            on_levels(rows)
        failed = any(failures)
    if failed:
        raise typer.Exit(code=1)


def _stack_headline(results_path) -> dict:
    """The stack mode's figures over all prompts, from a bench's results.json."""
    import json

    rows = json.loads(results_path.read_text())["aggregates"]
    row = next((row for row in rows if row["mode"] == "stack" and row["scope"] == "all"), {})
    return {"stack tok/s": row.get("tokens_per_s"), "x ar": row.get("speedup_vs_ar"),
            "acceptance": row.get("acceptance_rate")}


def _bench_merging(*, prompts: str, url: str, baseline_url: str | None, api_key: str | None, redis_url: str,
                   model: str, out: str) -> None:
    from pathlib import Path

    import httpx

    from services.bench.merging import run_merging_bench
    from services.bench.prompts import load_prompts

    try:
        run_merging_bench(url=url, model=model, api_key=api_key, prompts=load_prompts(Path(prompts)), out=Path(out),
                          redis_url=redis_url, baseline_url=baseline_url,
                          progress=lambda line: typer.echo(line, err=True))
    except (ValueError, RuntimeError, httpx.HTTPError) as exc:
        fail(str(exc))
    typer.echo((Path(out) / "merging.md").read_text())
    typer.echo(f"wrote {Path(out) / 'merging.json'}, {Path(out) / 'merging.md'}")


def _bench_target(prompts: list, target: str | None, threads: int | None, settings):
    """The bench's common start: some prompts chosen, threads set, the target loaded (errors exit 2)."""
    from services.models.loading import load_model

    if not prompts:
        fail("no prompts selected")
    setup(threads or settings.num_threads, False)
    try:
        return load_model(target or settings.target, precision=settings.target_precision, device=settings.device)
    except MirrorSDError as exc:
        fail(str(exc))


def _bench_concurrency(*, prompts: str, modes: str, target: str | None, limit: int | None, per_group: int | None,
                       categories: str | None, max_prompt_chars: int | None, levels: str, requests: int | None,
                       max_new_tokens: int, threads: int | None, chat: bool, url: str,
                       baseline_url: str | None, api_key: str | None, redis_url: str | None, repeat: int,
                       warmup: int = 1, linked: bool = False, capacity_target=None):
    """Checks the options and loads the target once; returns the run of one bench into a folder."""
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
        # a closed loop of independent requests: a conversation's first turn only (docs/benchmarks.md)
        chosen = select_prompts(chosen, limit=limit, per_group=per_group, max_turns=1,
                                categories=categories.split(",") if categories else None)
        formatted = sum(1 for prompt in chosen if prompt.schema is not None)
        if formatted:  # its greedy reference and hf-batch decode free text, so its requests ask for no format
            typer.echo(f"note: --concurrency sends no response_format: {formatted} prompts' schemas are not asked for",
                       err=True)
        config = ConcurrencyConfig(levels=parse_levels(levels), modes=parse_concurrency_modes(modes, baseline_url),
                                   prompts=chosen, max_tokens=max_new_tokens, url=url, model=settings.target,
                                   baseline_url=baseline_url, api_key=api_key,
                                   redis_url=redis_url or settings.redis_url, chat=chat, requests=requests,
                                   repeat=repeat, warmup=warmup)
    except ValueError as exc:
        fail(str(exc))
    if linked and "stack" not in config.modes:
        fail("--draft-link changes the link of a running stack's draft workers: add the stack mode")
    target_model = _bench_target(config.prompts, target, threads, settings)

    def run_level(folder: Path) -> tuple[dict, bool]:
        try:
            rows, mismatches, files = run_concurrency_bench(config, target_model, folder,
                                                            progress=lambda line: typer.echo(line, err=True))
        except (ValueError, RuntimeError, MirrorSDError) as exc:
            fail(str(exc))
        typer.echo(Path(files[1]).read_text())
        # the stack's rate per level, and any other mode's beside it (the plain route: stack-ar tok/s)
        headline = {f"C={row.concurrency} {'' if row.mode == 'stack' else row.mode + ' '}tok/s": row.tokens_per_s
                    for row in rows if row.mode in ("stack", "stack-ar", "baseline")}
        if capacity_target is not None:
            from services.bench import capacity

            found = capacity.capacities(rows, capacity_target)
            written = capacity.write_capacity(folder, found, capacity_target)
            typer.echo(written[0].read_text())
            files = [*files, *written]
            headline.update(capacity.headline(found))
        typer.echo("wrote " + ", ".join(str(path) for path in files))
        return headline, any(mismatch.fatal for mismatch in mismatches)

    return run_level
