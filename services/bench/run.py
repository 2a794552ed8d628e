"""A whole bench run: modes over one prompt set, greedy checks, report files and plots."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path

from services.bench.formats import check_schemas, constrained
from services.bench.journal import JOURNAL_NAME, Journal
from services.bench.peers import hf_generate, parse_peer_mode
from services.bench.plots import plot_acceptance_per_position, plot_speedup
from services.bench.prompts import BenchPrompt, Turn, stratified
from services.bench.report import build_report, to_json, to_markdown
from services.bench.runner import (
    Encode,
    PromptRun,
    RunPrompt,
    check_against_ar,
    check_formats,
    run_interleaved,
    score_rouge_l,
)
from services.config import Settings
from services.engine import GenerationOptions, GenerationResult, generate
from services.engine.profile import cached_verify_profile, measure_cost_model
from services.models.drafters import load_draft_source
from services.models.synthetic_spec import ReferenceBook
from services.models.engine import TorchEngine
from services.models.loading import LoadedModel
from services.models.tokenization import encode_messages
from services.speculative.cost_model import CostModel
from services.speculative.params import SamplingParams
from services.synthetic import describe_label

logger = logging.getLogger(__name__)

MODES_HELP = "ar, sd:<draft>, hf-assisted[:<draft>], hf-lookup[:<n>], stack"


def parse_modes(text: str) -> list[str]:
    """Validate a comma list of modes; `ar` runs first (it is every other mode's reference)."""
    modes = list(dict.fromkeys(mode.strip() for mode in text.split(",") if mode.strip()))
    if not modes:
        raise ValueError("no modes given")
    for mode in modes:
        if mode in ("ar", "stack") or (mode.startswith("sd:") and len(mode) > 3):
            continue
        if mode.startswith(("hf-assisted", "hf-lookup")):
            parse_peer_mode(mode)
            continue
        raise ValueError(f"unknown mode {mode!r}: use {MODES_HELP}")
    if any(mode.startswith("sd:synthetic:") for mode in modes) and "ar" not in modes:
        raise ValueError("synthetic drafts replay the target's greedy output: add the ar mode to the same run")
    return sorted(modes, key=lambda mode: mode != "ar")


@dataclass
class BenchConfig:
    modes: list[str]
    prompts: list[BenchPrompt]
    sampling: SamplingParams
    max_new_tokens: int
    repeat: int = 1
    warmup: int = 1
    url: str = "http://127.0.0.1:8000"
    api_key: str | None = None
    redis_url: str | None = None  # where the stack's draft workers record transport and drafting time
    chat: bool = True
    progress: bool = True
    resume: bool | None = None  # True: continue the journal in the output folder; False: replace it;
    # None: start one, refusing to replace a journal that holds runs
    report_only: bool = False  # run nothing: report the prompts the journal holds in every mode
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        conversation = next((prompt for prompt in self.prompts if prompt.later_turns), None)
        if not self.chat and conversation is not None:
            raise ValueError(f"prompt {conversation.id!r} has {len(conversation.turns)} turns: a conversation needs "
                             "the chat template (leave out --no-chat, or keep first turns with --max-turns 1)")
        formatted = next((prompt for prompt in self.prompts if prompt.schema is not None), None)
        peer = next((mode for mode in self.modes if mode.startswith("hf-")), None)
        if formatted is not None and peer is not None:
            raise ValueError(f"prompt {formatted.id!r} asks for a JSON schema, which transformers' {peer} mode "
                             "cannot follow: leave the hf-* modes out, or choose prompts without a schema")

    def fingerprint(self, target: LoadedModel, settings: Settings) -> dict:
        """What must match for journalled runs to be reused (modes and prompts may differ: they are per run,
        and each run carries its prompt's hash)."""
        return {"target": target.name, "precision": target.precision, "layout": target.layout,
                "device": str(target.device), "draft_precision": settings.draft_precision,
                "max_new_tokens": self.max_new_tokens, "chat": self.chat,
                "temperature": self.sampling.temperature, "top_p": self.sampling.top_p,
                "top_k": self.sampling.top_k, "seed": self.sampling.seed, "threads": self.meta.get("threads"),
                "prefill_chunk_size": settings.prefill_chunk_size,
                "speculative": settings.speculative.model_dump(mode="json")}


@dataclass
class BenchOutcome:
    table: str
    mismatches: dict[str, list[str]]  # our modes' greedy mismatches: a failure
    peer_mismatches: dict[str, list[str]]  # transformers' own: reported, not ours to fail on
    files: list[Path]


def _stack_mode(config: BenchConfig, settings: Settings, resources: ExitStack) -> tuple[RunPrompt, dict | None]:
    """The stack mode's runner, and the stack's synthetic label (its /v1/models says; None for a real one)."""
    import httpx

    from services.bench.stack_client import run_one, served_model

    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    client = resources.enter_context(httpx.Client(base_url=config.url, headers=headers, timeout=600))
    model, label = served_model(client, settings.target)
    return (lambda turn, options: run_one(client, model, turn, options)), label


def _mode_label(mode: str, target_spec: str) -> dict | None:
    """An in-process mode's synthetic label: a synthetic draft, or a random-weight target (ar included)."""
    from services.synthetic import synthetic_label

    draft = mode.split(":", 1)[1] if mode.startswith(("sd:", "hf-assisted:")) else "none"
    return synthetic_label(target_spec, draft)


def _stack_overheads(redis_url: str, run: Callable[[], dict[str, list[PromptRun]]]) -> tuple[dict, dict]:
    """Run, and read what the draft workers recorded meanwhile: transport per round, drafting hidden."""
    from services.bench.stack_client import (
        draft_timing,
        fleet_draft_ms_per_token,
        new_samples,
        pipeline_summary,
        transport_samples,
    )
    from services.speculative.stats import percentile

    before = len(transport_samples(redis_url))
    timing_before = draft_timing(redis_url)
    runs = run()
    fresh = new_samples(before, transport_samples(redis_url))
    return runs, {"rounds": len(fresh), "p50_ms": percentile(fresh, 0.5), "p99_ms": percentile(fresh, 0.99),
                  "draft_ms_per_token": fleet_draft_ms_per_token(redis_url),
                  "pipeline": pipeline_summary(timing_before, draft_timing(redis_url))}


def _never_run(turn: Turn, _options: GenerationOptions) -> GenerationResult:
    raise AssertionError(f"--report-only ran {turn.id}")


def _encoder(target: LoadedModel, chat: bool) -> Encode:
    """A turn's chat as the target's prompt ids: through its chat template, or a lone first turn's plain text
    (--no-chat; BenchConfig refuses conversations without a template)."""
    if chat:
        return lambda messages: encode_messages(target.tokenizer, messages)

    def plain(messages: list[dict]) -> list[int]:
        assert len(messages) == 1, "a conversation without the chat template"
        return target.tokenizer.encode(messages[0]["content"])

    return plain


def _in_process_mode(mode: str, target: LoadedModel, settings: Settings) -> tuple[RunPrompt, ReferenceBook | None]:
    """The mode's runner, and the synthetic drafter's reference book (fed ar's output) if it has one."""
    if mode.startswith("hf-"):
        peer = parse_peer_mode(mode)
        assistant = None
        if peer.draft is not None:
            assistant = load_draft_source(peer.draft, target, speculative=settings.speculative).model
            if assistant is None or not hasattr(assistant.model, "generate"):
                raise ValueError(f"mode {mode!r}: hf-assisted needs a model draft that transformers can run, not {peer.draft!r}")
        return (lambda turn, options: hf_generate(target, turn.prompt_ids, options, peer, assistant)), None
    source = load_draft_source("none" if mode == "ar" else mode.split(":", 1)[1], target,
                               speculative=settings.speculative, llamacpp=settings.llamacpp,
                               cache_dir=settings.cache_dir, suffix=settings.suffix)
    cost = None
    if settings.speculative.block_policy == "cost" and not source.is_none:
        cost = measure_cost_model(target, source, settings.cache_dir)
        logger.info("%s: cost model %s", mode, cost)
    return (lambda turn, options: generate(target, source, turn.prompt_ids,
                                           replace(constrained(options, turn.schema), cost=cost)),
            source.references)


def run_bench(config: BenchConfig, settings: Settings, target: LoadedModel, out_dir: Path) -> BenchOutcome:
    options = GenerationOptions(sampling=config.sampling, max_new_tokens=config.max_new_tokens,
                                speculative=settings.speculative, chunk_size=settings.prefill_chunk_size)
    if not config.report_only:
        check_schemas(config.prompts, target)
    with ExitStack() as resources:
        modes: dict[str, RunPrompt] = {}
        books: list[ReferenceBook] = []
        labels = {mode: _mode_label(mode, config.meta.get("target_spec", target.name)) for mode in config.modes}
        for mode in config.modes:  # every runner is built before the journal is touched: a bad mode loses nothing
            if config.report_only:
                modes[mode] = _never_run
            elif mode == "stack":
                modes[mode], labels[mode] = _stack_mode(config, settings, resources)
            else:
                modes[mode], book = _in_process_mode(mode, target, settings)
                books += [book] if book is not None else []
        publish = _reference_publisher(config, settings, labels.get("stack"))
        journal = Journal(out_dir / JOURNAL_NAME, config.fingerprint(target, settings), resume=config.resume,
                          read_only=config.report_only)

        def feed_books(run: PromptRun) -> None:  # synthetic drafts replay ar's greedy output
            if run.mode == "ar":
                for book in books:
                    book.add(run.prompt_ids, run.result.token_ids)
                if publish is not None:  # the stack's synthetic draft too, through its Redis
                    publish(run.prompt_ids, run.result.token_ids)

        def run_all() -> dict[str, list[PromptRun]]:
            return run_interleaved(modes, stratified(config.prompts), _encoder(target, config.chat), options,
                                   repeat=config.repeat, warmup=config.warmup, progress=config.progress,
                                   journal=journal, after=feed_books, journalled_only=config.report_only)

        if "stack" in modes and not config.report_only:
            runs_by_mode, transport = _stack_overheads(config.redis_url or settings.redis_url, run_all)
        else:
            runs_by_mode, transport = run_all(), {}
    if not any(runs_by_mode.values()):
        raise ValueError(f"the journal in {out_dir} holds no prompt in every mode of {', '.join(config.modes)}")
    return _report(config, target, runs_by_mode, transport, out_dir, journal.path,
                   {mode: label for mode, label in labels.items() if label}, cache_dir=settings.cache_dir)


def _reference_publisher(config: BenchConfig, settings: Settings,
                         stack_label: dict | None) -> Callable[[list[int], list[int]], None] | None:
    """For a stack serving a synthetic draft: ar's greedy output, published to the stack's Redis before the
    stack mode runs the same prompt (services/synthetic.py); None otherwise."""
    if not stack_label or "draft" not in stack_label or "ar" not in config.modes:
        return None
    from services.redis_conn import connect

    from services.synthetic import publish_reference

    client = connect(config.redis_url or settings.redis_url)
    return lambda prompt_ids, output_ids: publish_reference(client, prompt_ids, output_ids)


def _report(config: BenchConfig, target: LoadedModel, runs_by_mode: dict[str, list[PromptRun]], transport: dict,
            out_dir: Path, journal_path: Path, labels: dict[str, dict] | None = None, *,
            cache_dir: Path | None = None) -> BenchOutcome:
    """Greedy checks and ROUGE-L against ar, format checks, then results.json, results.md and the plots.
    labels: the synthetic label of each mode that has one (services/synthetic.py), in every report.
    cache_dir: where the target's cost curve is kept (the one-row verify profile the in-process modes' cost
    models read, services/engine/profile.py); None: measured here every time."""
    mismatches: dict[str, list[str]] = {}
    for runs in runs_by_mode.values():
        check_formats(runs)
    if "ar" in runs_by_mode:
        for mode, runs in runs_by_mode.items():
            if mode == "ar":
                continue
            score_rouge_l(runs, runs_by_mode["ar"])
            if config.sampling.greedy:
                mismatches[mode] = check_against_ar(runs, runs_by_mode["ar"])
    overrides = {"stack": transport["draft_ms_per_token"]} if transport.get("draft_ms_per_token") is not None else {}
    # the target's cost curve, here: measured once per model, threads and torch (and kept), not once per report
    # (a bench over link levels and turns writes one for each)
    verify_curve = CostModel.from_profile(cached_verify_profile(TorchEngine(target), cache_dir, max_rows=1))
    labels = labels or {}
    rows = build_report(runs_by_mode, overrides, verify_curve, synthetic_modes=set(labels))
    num_prompts = len({run.prompt.id for runs in runs_by_mode.values() for run in runs})
    num_turns = len({run.id for runs in runs_by_mode.values() for run in runs})  # measured requests per mode
    meta = {**config.meta, "modes": config.modes, "num_prompts": num_prompts, "num_turns": num_turns,
            "target": target.name, "max_new_tokens": config.max_new_tokens, "temperature": config.sampling.temperature,
            "seed": config.sampling.seed, "repeat": config.repeat, "verify_ms": verify_curve.verify_ms}
    if transport:
        meta["transport_overhead"] = transport
    if labels:
        meta["synthetic"] = labels
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(to_json(rows, runs_by_mode, meta), indent=1))
    ordered = sorted(rows, key=lambda row: (row.scope.startswith("category:"), row.scope != "all"))
    table = "".join(f"{mode}: {describe_label(label)}\n" for mode, label in labels.items())
    table += ("\n" if labels else "") + to_markdown(ordered)
    if transport and transport["p50_ms"] is not None:
        table += ("\nstack transport overhead per round (round trip minus verify time and the draft driver's other "
                  f"work): p50 {transport['p50_ms']:.3f} ms, p99 {transport['p99_ms']:.3f} ms over "
                  f"{transport['rounds']} rounds (the stack runs of this invocation, not journalled ones)\n")
    if transport.get("pipeline", {}).get("drafting_s"):
        pipe = transport["pipeline"]
        table += (f"pipelined drafting: {pipe['hidden_s']:.2f} s of {pipe['drafting_s']:.2f} s drafting hidden behind "
                  f"verification ({pipe['hidden_fraction']:.0%}); {pipe['speculation_hits']:.0f} of "
                  f"{pipe['speculations']:.0f} speculated blocks used ({pipe['speculation_hit_rate']:.0%})\n")
    (out_dir / "results.md").write_text(table)
    files = [out_dir / "results.json", out_dir / "results.md", journal_path]
    files += [path for path in (plot_speedup(rows, out_dir / "speedup_per_category.png"),
                                plot_acceptance_per_position(rows, out_dir / "acceptance_per_position.png")) if path]
    ours = {mode: ids for mode, ids in mismatches.items() if ids and not mode.startswith("hf-")}
    peers = {mode: ids for mode, ids in mismatches.items() if ids and mode.startswith("hf-")}
    return BenchOutcome(table, ours, peers, files)
