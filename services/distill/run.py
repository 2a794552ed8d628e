"""`mirror-sd distill`: corpus from the target, a trimmed draft trained on it, the recipe written down."""

from __future__ import annotations

import json
import logging
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from services.distill.corpus import CorpusPlan, build_corpus, read_corpus
from services.distill.seed_prompts import seed_prompts
from services.distill.train import TrainPlan, choose_keep_ids, evaluate, make_examples, train
from services.models.loading import LoadedModel
from services.models.trimmed_draft import TrimmedDraft, save_trimmed_draft

logger = logging.getLogger(__name__)

RECIPE_FILE = "recipe.json"


@dataclass
class DistillRecipe:
    target: str
    seed: int = 0
    num_layers: int = 2
    init_from_layers: list[int] = field(default_factory=lambda: [0, -1])  # target layers; negative from the end
    keep_tokens: int = 8192
    num_prompts: int | None = None  # None = every seed prompt
    samples_per_prompt: int = 1  # the greedy answer, + sampled ones beyond 1
    temperature: float = 0.8
    max_new_tokens: int = 192
    generate_batch_size: int = 32
    soft_label_top_k: int = 16
    max_len: int = 320
    steps: int = 1200
    batch_size: int = 8
    lr: float = 5e-4
    warmup_steps: int = 50
    precision: str = "auto"  # auto | fp32 | bf16 (autocast for training)
    chat: bool = True  # seed prompts wrapped in the target's chat template
    heldout_every: int = 20  # every Nth prompt is held out for evaluation


def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_bf16(precision: str) -> bool:
    if precision not in ("auto", "fp32", "bf16"):
        raise ValueError(f"--precision must be auto, fp32 or bf16, got {precision!r}")
    return precision == "bf16" or (precision == "auto" and cpu_has_native_bf16())


def distill(target: LoadedModel, recipe: DistillRecipe, out: Path, *, progress: bool = True,
            pause_after: int | None = None) -> dict:
    """Build (or resume) the corpus and the training run in `out`; write the draft and recipe.json there.

    pause_after: stop after that many training steps in this call (rerun to continue); the
    result is the same as an unbroken run."""
    if target.tokenizer is None:
        raise ValueError(f"target {target.name!r} has no tokenizer: distillation needs text prompts")
    num_layers = len(target.model.model.layers)
    init_layers = [index % num_layers for index in recipe.init_from_layers][: recipe.num_layers]
    bf16 = resolve_bf16(recipe.precision)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    prompts = seed_prompts(recipe.seed)[: recipe.num_prompts]
    plan = CorpusPlan(prompts=prompts, samples_per_prompt=recipe.samples_per_prompt,
                      max_new_tokens=recipe.max_new_tokens, temperature=recipe.temperature,
                      batch_size=recipe.generate_batch_size, top_k=recipe.soft_label_top_k, seed=recipe.seed,
                      chat=recipe.chat)
    build_corpus(target, plan, out / "corpus", progress=progress)
    corpus_s = time.perf_counter() - started
    records = list(read_corpus(out / "corpus"))
    held_out = [r for r in records if r["prompt_index"] % recipe.heldout_every == 0]
    training = [r for r in records if r["prompt_index"] % recipe.heldout_every != 0]
    keep_ids, coverage = choose_keep_ids(training, recipe.keep_tokens, set(target.eos_token_ids))
    train_examples = make_examples(training, keep_ids, target.vocab_size, recipe.max_len)
    heldout_examples = make_examples(held_out, keep_ids, target.vocab_size, recipe.max_len)
    torch.manual_seed(recipe.seed)
    draft = TrimmedDraft(target.model, num_layers=recipe.num_layers, keep_ids=torch.tensor(keep_ids),
                         init_from_layers=init_layers)
    before = evaluate(draft, heldout_examples, recipe.batch_size)
    train_started = time.perf_counter()
    plan = TrainPlan(steps=recipe.steps, batch_size=recipe.batch_size, lr=recipe.lr, seed=recipe.seed, bf16=bf16,
                     warmup_steps=min(recipe.warmup_steps, recipe.steps // 4), pause_after=pause_after,
                     checkpoint_every=max(1, min(100, recipe.steps // 10)))
    step, curve = train(draft, train_examples, plan, out, progress=progress)
    if step < recipe.steps:
        return {"paused_at_step": step, "steps": recipe.steps, "curve": curve}
    after = evaluate(draft, heldout_examples, recipe.batch_size)
    report = {
        "recipe": asdict(recipe),
        "resolved": {"init_from_layers": init_layers, "bf16_autocast": bf16, "threads": torch.get_num_threads(),
                     "torch": torch.__version__, "machine": platform.machine()},
        "corpus": {"records": len(records), "training_records": len(training), "heldout_records": len(held_out),
                   "answer_tokens": sum(len(r["top_ids"]) for r in records), "seconds": round(corpus_s, 1)},
        "keep": {"tokens": len(keep_ids), "top1_coverage": coverage},
        "heldout_before": before,
        "heldout_after": after,
        "curve": curve,
        "train_seconds": round(time.perf_counter() - train_started, 1),
    }
    save_trimmed_draft(draft, out, meta={"target": target.name, "heldout_top1_agreement": after["top1_agreement"]})
    (out / RECIPE_FILE).write_text(json.dumps(report, indent=1))
    return report
