"""Distillation text: the target answers seed prompts, batched, written in resumable JSONL shards.

Each record keeps the token ids (prompt + answer), where the answer starts,
and the target's top-k logits at every answer position (sparse soft
labels), so training never runs the target again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from services.models.loading import LoadedModel
from services.models.tokenization import encode_prompt

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CorpusPlan:
    prompts: list[str]
    samples_per_prompt: int  # sample 0 is greedy; the rest are sampled at `temperature`
    max_new_tokens: int
    temperature: float
    batch_size: int
    top_k: int  # soft labels kept per position
    seed: int
    chat: bool = True


def _shard_path(directory: Path, index: int) -> Path:
    return directory / f"shard-{index:05d}.jsonl"


def plan_batches(plan: CorpusPlan) -> list[list[tuple[int, int]]]:
    """(prompt index, sample index) jobs in fixed batches: greedy and sampled jobs never share a batch."""
    greedy = [(p, 0) for p in range(len(plan.prompts))]
    sampled = [(p, s) for s in range(1, plan.samples_per_prompt) for p in range(len(plan.prompts))]
    batches = []
    for jobs in (greedy, sampled):
        batches += [jobs[start : start + plan.batch_size] for start in range(0, len(jobs), plan.batch_size)]
    return batches


@torch.inference_mode()
def _generate_batch(target: LoadedModel, plan: CorpusPlan, jobs: list[tuple[int, int]], batch_index: int) -> list[dict]:
    tokenizer = target.tokenizer
    encoded = [encode_prompt(tokenizer, plan.prompts[p], chat=plan.chat) for p, _ in jobs]
    width = max(len(ids) for ids in encoded)
    eos = sorted(target.eos_token_ids)
    pad = eos[0] if eos else 0
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in encoded])  # left padding
    attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded])
    sampled = jobs[0][1] > 0
    torch.manual_seed(plan.seed * 1_000_003 + batch_index)
    output = target.model.generate(
        input_ids, attention_mask=attention, max_new_tokens=plan.max_new_tokens, do_sample=sampled,
        temperature=plan.temperature if sampled else None, top_p=None, top_k=None,
        eos_token_id=eos or None, pad_token_id=pad, return_dict_in_generate=True, output_logits=True,
    )
    logits = torch.stack(output.logits, dim=1).float()  # [batch, new, vocab], raw (before sampling warpers)
    top_values, top_ids = logits.topk(plan.top_k, dim=-1)
    top_logprobs = top_values - logits.logsumexp(dim=-1, keepdim=True)
    records = []
    for row, ((prompt_index, sample_index), prompt_ids) in enumerate(zip(jobs, encoded)):
        answer = output.sequences[row, width:].tolist()
        length = len(answer)
        for position, token in enumerate(answer):
            if token in target.eos_token_ids:
                length = position + 1  # keep the EOS itself: the draft should learn to predict it
                break
        records.append({
            "prompt_index": prompt_index, "sample": sample_index, "prompt_len": len(prompt_ids),
            "ids": prompt_ids + answer[:length],
            "top_ids": top_ids[row, :length].tolist(),
            "top_logprobs": [[round(v, 3) for v in values] for values in top_logprobs[row, :length].tolist()],
        })
    return records


def build_corpus(target: LoadedModel, plan: CorpusPlan, directory: Path, *, progress: bool = True) -> int:
    """Generate every batch not already on disk (one shard per batch, written whole); return the shard count."""
    directory.mkdir(parents=True, exist_ok=True)
    batches = plan_batches(plan)
    todo = [index for index in range(len(batches)) if not _shard_path(directory, index).is_file()]
    for index in tqdm(todo, desc="target answers seed prompts", disable=not progress):
        records = _generate_batch(target, plan, batches[index], index)
        partial = _shard_path(directory, index).with_suffix(".partial")
        partial.write_text("".join(json.dumps(record) + "\n" for record in records))
        partial.rename(_shard_path(directory, index))  # a shard exists only once complete
    return len(batches)


def read_corpus(directory: Path) -> Iterator[dict]:
    for path in sorted(directory.glob("shard-*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                yield json.loads(line)
