"""The peers: transformers' own assisted generation and prompt lookup, timed like our modes.

`hf-assisted[:<draft>]` is `generate(assistant_model=...)` with a draft
built by our draft factory (default `bf16`, a bf16 copy of the target);
`hf-lookup[:<n>]` is `generate(prompt_lookup_num_tokens=n)` (default 10).
Both run on the same loaded target, prompts and token limit as `ar`; EOS
ends the output and is not part of it, as in our engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.generation.streamers import BaseStreamer

from services.engine import GenerationOptions, GenerationResult
from services.models.loading import LoadedModel
from services.speculative.stats import SpecDecodingStats

logger = logging.getLogger(__name__)

DEFAULT_ASSISTANT = "bf16"
DEFAULT_LOOKUP_TOKENS = 10


@dataclass(frozen=True)
class PeerMode:
    kind: str  # "hf-assisted" | "hf-lookup"
    draft: str | None = None  # hf-assisted: a --draft spec
    lookup_tokens: int | None = None  # hf-lookup


def parse_peer_mode(mode: str) -> PeerMode:
    kind, _, arg = mode.partition(":")
    if kind == "hf-assisted":
        return PeerMode(kind, draft=arg or DEFAULT_ASSISTANT)
    if kind == "hf-lookup":
        try:
            tokens = int(arg) if arg else DEFAULT_LOOKUP_TOKENS
        except ValueError:
            raise ValueError(f"mode {mode!r}: {arg!r} is not a token count (e.g. hf-lookup:10)") from None
        if tokens < 1:
            raise ValueError(f"mode {mode!r}: prompt_lookup_num_tokens must be >= 1")
        return PeerMode(kind, lookup_tokens=tokens)
    raise ValueError(f"{mode!r} is not a transformers peer mode")


class _FirstTokenClock(BaseStreamer):
    """generate() hands the streamer the prompt first, then new tokens: time the first of those."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_token_at: float | None = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def hf_generate(
    target: LoadedModel,
    prompt_ids: Sequence[int],
    options: GenerationOptions,
    peer: PeerMode,
    assistant: LoadedModel | None = None,
) -> GenerationResult:
    sampling = options.sampling
    eos = sorted(target.eos_token_ids)
    kwargs: dict = {"max_new_tokens": options.max_new_tokens, "do_sample": not sampling.greedy,
                    "eos_token_id": eos or None, "pad_token_id": eos[0] if eos else 0}
    if not sampling.greedy:
        kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None)
        torch.manual_seed(sampling.seed if sampling.seed is not None else 0)
    if peer.kind == "hf-assisted":
        assert assistant is not None, "hf-assisted needs an assistant model"
        kwargs["assistant_model"] = assistant.model
    else:
        kwargs["prompt_lookup_num_tokens"] = peer.lookup_tokens
    input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=target.device)
    clock = _FirstTokenClock()
    started = time.perf_counter()
    with torch.inference_mode():
        output = target.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), streamer=clock,
                                       **kwargs)
    total_s = time.perf_counter() - started
    new_ids = output[0, input_ids.shape[1]:].tolist()
    token_ids, finish_reason = new_ids, "length"
    for index, token_id in enumerate(new_ids):
        if token_id in target.eos_token_ids:
            token_ids, finish_reason = new_ids[:index], "stop"
            break
    text = target.tokenizer.decode(token_ids, skip_special_tokens=True) if target.tokenizer is not None else ""
    ttft_s = (clock.first_token_at - started) if clock.first_token_at else total_s
    return GenerationResult(
        text=text, token_ids=token_ids, prompt_tokens=len(prompt_ids), finish_reason=finish_reason,
        stats=SpecDecodingStats(), draft=peer.kind, ttft_s=ttft_s, total_s=total_s,
    )
