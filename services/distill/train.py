"""Train a trimmed draft on the corpus by knowledge distillation (sparse soft labels), resumably.

Loss at every answer position: cross-entropy of the draft's distribution
over the kept tokens against the target's top-k distribution (renormalized
over the top-k tokens the draft can express). Checkpoints hold the draft's
own weights, the optimizer, the step and the RNG state, so an interrupted
run resumes to the same result as an unbroken one.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from services.models.trimmed_draft import TrimmedDraft

logger = logging.getLogger(__name__)

CHECKPOINT_WEIGHTS = "checkpoint.safetensors"  # draft weights + optimizer tensors
CHECKPOINT_STATE = "checkpoint.json"  # step, curve, RNG state, batch order, optimizer hyper-parameters


@dataclass
class Example:
    input_ids: torch.Tensor  # [seq]
    positions: torch.Tensor  # [n]: input positions whose next token is an answer token
    teacher_ids: torch.Tensor  # [n, k]: kept-token indices, -1 where the draft cannot express the token
    teacher_probs: torch.Tensor  # [n, k]: renormalized over the expressible ones
    greedy_ids: torch.Tensor  # [n]: the target's top-1 as a kept-token index (-1 if not kept)


def choose_keep_ids(records: list[dict], keep_tokens: int, always: set[int]) -> tuple[list[int], float]:
    """The `keep_tokens` most frequent target top-1 tokens (plus `always`), and their top-1 coverage."""
    counts = Counter(record["top_ids"][position][0] for record in records
                     for position in range(len(record["top_ids"])))
    kept = [token for token in sorted(always)]
    for token, _ in counts.most_common():
        if len(kept) >= keep_tokens:
            break
        if token not in always:
            kept.append(token)
    kept_set = set(kept)
    total = sum(counts.values())
    coverage = sum(count for token, count in counts.items() if token in kept_set) / total if total else 0.0
    return sorted(kept), coverage


def make_examples(records: list[dict], keep_ids: list[int], vocab_size: int, max_len: int) -> list[Example]:
    index_of = torch.full((vocab_size,), -1, dtype=torch.long)
    index_of[torch.tensor(keep_ids)] = torch.arange(len(keep_ids))
    examples = []
    for record in records:
        ids = record["ids"][:max_len]
        start = record["prompt_len"] - 1  # input position that predicts the first answer token
        count = min(len(record["top_ids"]), len(ids) - 1 - start)
        if count <= 0:
            continue
        teacher = index_of[torch.tensor(record["top_ids"][:count])]  # [n, k]
        logprobs = torch.tensor(record["top_logprobs"][:count], dtype=torch.float32)
        probs = torch.where(teacher >= 0, logprobs.exp(), torch.zeros_like(logprobs))
        probs = probs / probs.sum(dim=-1, keepdim=True).clamp_min(1e-9)
        examples.append(Example(torch.tensor(ids), torch.arange(start, start + count), teacher, probs, teacher[:, 0]))
    return examples


def _collate(batch: list[Example]) -> tuple[torch.Tensor, list[Example]]:
    width = max(example.input_ids.numel() for example in batch)
    input_ids = torch.zeros((len(batch), width), dtype=torch.long)
    for row, example in enumerate(batch):
        input_ids[row, : example.input_ids.numel()] = example.input_ids  # right padding: causal, masked out
    return input_ids, batch


def distill_loss(draft: TrimmedDraft, batch: list[Example]) -> tuple[torch.Tensor, float]:
    """Mean soft cross-entropy over answer positions, and the top-1 agreement with the target."""
    input_ids, _ = _collate(batch)
    logits, _ = draft.trimmed_logits(input_ids)  # [batch, seq, keep]
    losses, agree, total = [], 0, 0
    for row, example in enumerate(batch):
        logprobs = logits[row, example.positions].float().log_softmax(dim=-1)  # [n, keep]
        gathered = logprobs.gather(-1, example.teacher_ids.clamp_min(0))  # [n, k]
        losses.append(-(gathered * example.teacher_probs).sum(dim=-1))
        agree += int((logprobs.argmax(dim=-1) == example.greedy_ids).sum())
        total += example.positions.numel()
    return torch.cat(losses).mean(), agree / max(total, 1)


@torch.no_grad()
def evaluate(draft: TrimmedDraft, examples: list[Example], batch_size: int) -> dict[str, float]:
    draft.eval()
    loss_sum, agree_sum, count = 0.0, 0.0, 0
    for start in range(0, len(examples), batch_size):
        batch = examples[start : start + batch_size]
        positions = sum(example.positions.numel() for example in batch)
        loss, agreement = distill_loss(draft, batch)
        loss_sum += float(loss) * positions
        agree_sum += agreement * positions
        count += positions
    draft.train()
    return {"loss": loss_sum / max(count, 1), "top1_agreement": agree_sum / max(count, 1), "positions": count}


@dataclass
class TrainPlan:
    steps: int
    batch_size: int
    lr: float
    warmup_steps: int
    seed: int
    bf16: bool
    checkpoint_every: int = 100
    pause_after: int | None = None  # stop after this many steps in this run (checkpointed; rerun resumes)


def _lr_at(step: int, plan: TrainPlan) -> float:
    if step < plan.warmup_steps:
        return plan.lr * (step + 1) / plan.warmup_steps
    progress = (step - plan.warmup_steps) / max(1, plan.steps - plan.warmup_steps)
    return plan.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def save_checkpoint(directory: Path, draft: TrimmedDraft, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Weights and optimizer tensors as safetensors, the rest as JSON (no pickle); the JSON is the
    commit point, written last."""
    optimizer_state = optimizer.state_dict()
    tensors = {f"draft/{name}": tensor.contiguous() for name, tensor in draft.own_state().items()}
    for index, slots in optimizer_state["state"].items():
        for slot, tensor in slots.items():
            tensors[f"optimizer/{index}/{slot}"] = torch.as_tensor(tensor).contiguous()
    save_file(tensors, str(directory / CHECKPOINT_WEIGHTS))
    partial = directory / (CHECKPOINT_STATE + ".partial")
    partial.write_text(json.dumps({**state, "param_groups": optimizer_state["param_groups"]}))
    partial.rename(directory / CHECKPOINT_STATE)


def load_checkpoint(directory: Path, draft: TrimmedDraft, optimizer: torch.optim.Optimizer) -> dict | None:
    if not (directory / CHECKPOINT_STATE).is_file():
        return None
    state = json.loads((directory / CHECKPOINT_STATE).read_text())
    tensors = load_file(str(directory / CHECKPOINT_WEIGHTS))
    draft.load_state_dict({name[len("draft/"):]: t for name, t in tensors.items() if name.startswith("draft/")},
                          strict=False)
    slots: dict[int, dict] = {}
    for name, tensor in tensors.items():
        if name.startswith("optimizer/"):
            _, index, slot = name.split("/")
            slots.setdefault(int(index), {})[slot] = tensor
    optimizer.load_state_dict({"state": slots, "param_groups": state.pop("param_groups")})
    return state


def _rng_state(rng: random.Random) -> list:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def train(draft: TrimmedDraft, examples: list[Example], plan: TrainPlan, directory: Path,
          *, progress: bool = True) -> tuple[int, list[dict]]:
    """Run (or resume) training towards plan.steps; returns the step reached and the logged curve."""
    parameters = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=plan.lr, weight_decay=0.0)
    step, curve, order = 0, [], []
    rng = random.Random(plan.seed)
    resumed = load_checkpoint(directory, draft, optimizer)
    if resumed is not None:
        step, curve, order = resumed["step"], resumed["curve"], resumed["order"]
        version, internal, gauss = resumed["rng"]
        rng.setstate((version, tuple(internal), gauss))
        logger.info("resuming distillation at step %d", step)
    draft.train()
    bar = tqdm(total=plan.steps, initial=step, desc="distilling", disable=not progress)
    stop_at = plan.steps if plan.pause_after is None else min(plan.steps, step + plan.pause_after)
    window_loss, window_agree, window_n, started = 0.0, 0.0, 0, time.perf_counter()
    while step < stop_at:
        if len(order) < plan.batch_size:
            order = list(range(len(examples)))
            rng.shuffle(order)
        batch = [examples[index] for index in order[: plan.batch_size]]
        del order[: plan.batch_size]
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, plan)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=plan.bf16):
            loss, agreement = distill_loss(draft, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        step += 1
        loss_value = loss.item()
        window_loss, window_agree, window_n = window_loss + loss_value, window_agree + agreement, window_n + 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss_value:.3f}", agree=f"{agreement:.2f}")
        if step % plan.checkpoint_every == 0 or step == stop_at:
            curve.append({"step": step, "loss": window_loss / window_n, "top1_agreement": window_agree / window_n,
                          "seconds": time.perf_counter() - started})
            window_loss, window_agree, window_n = 0.0, 0.0, 0
            save_checkpoint(directory, draft, optimizer,
                            {"step": step, "curve": curve, "rng": _rng_state(rng), "order": order})
    bar.close()
    draft.eval()
    return step, curve
