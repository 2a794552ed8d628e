"""The static-batching reference (`hf-batch`): transformers' `generate` over a left-padded batch of C prompts.

The requests of a level are cut into batches of C, run one batch after the
other, each until its longest output is done (that is static batching's
cost). A logits processor timestamps every decoding step, so each request's
TTFT (from its batch's start) and inter-token gaps come out like the
stack's. Greedy; EOS ends a row's output and is not part of it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from services.bench.load import LevelRun, StreamRecord
from services.bench.prompts import BenchPrompt
from services.models.loading import LoadedModel

logger = logging.getLogger(__name__)


class _StepClock:
    """A logits processor that changes nothing and notes when each step's logits are ready."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


def _cut_at_eos(new_ids: list[int], eos: frozenset[int]) -> tuple[list[int], str]:
    for index, token_id in enumerate(new_ids):
        if token_id in eos:
            return new_ids[:index], "stop"
    return new_ids, "length"


def run_batch(target: LoadedModel, prompts: Sequence[BenchPrompt], prompt_ids: Sequence[list[int]], *,
              max_tokens: int) -> list[StreamRecord]:
    from transformers import LogitsProcessorList

    eos = target.eos_token_ids
    pad = min(eos) if eos else 0
    width = max(len(ids) for ids in prompt_ids)
    input_ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)  # [batch, width], left padded
    attention = torch.zeros_like(input_ids)
    for row, ids in enumerate(prompt_ids):
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        attention[row, width - len(ids):] = 1
    clock = _StepClock()
    started = time.perf_counter()
    with torch.inference_mode():
        output = target.model.generate(input_ids.to(target.device), attention_mask=attention.to(target.device),
                                       max_new_tokens=max_tokens, do_sample=False,
                                       eos_token_id=sorted(eos) or None, pad_token_id=pad,
                                       logits_processor=LogitsProcessorList([clock]))
    e2e = time.perf_counter() - started
    records = []
    for row, prompt in enumerate(prompts):
        token_ids, finish_reason = _cut_at_eos(output[row, width:].tolist(), eos)
        steps = clock.times[: max(1, len(token_ids))]
        ttft = steps[0] - started if steps else None
        gaps = [later - earlier for earlier, later in zip(steps, steps[1:])]
        done = steps[-1] - started if steps else e2e
        records.append(StreamRecord(prompt.id, token_ids, len(token_ids), ttft, done, gaps, finish_reason))
    return records


def run_hf_batch_level(target: LoadedModel, prompts: list[BenchPrompt], prompt_ids: list[list[int]],
                       concurrency: int, *, max_tokens: int) -> LevelRun:
    records: list[StreamRecord] = []
    started = time.perf_counter()
    for first in range(0, len(prompts), concurrency):
        records += run_batch(target, prompts[first : first + concurrency], prompt_ids[first : first + concurrency],
                             max_tokens=max_tokens)
    return LevelRun("hf-batch", concurrency, records, time.perf_counter() - started)
