"""A model draft that is a copy of the target takes the target's keys and values of the context, instead of
reading it again.

The built-in pair's draft is the target's own weights quantized for llama.cpp (`gguf:smollm2-135m`). On a CPU
it reads a prompt about as fast as the target does (2.2-2.9 ms a token on 2 cores, whatever the GGUF type),
so a long prompt cost the draft more than its drafts saved: the session's target had just read the same
prompt. Where the draft is such a copy, its llama.cpp sequence is written from the target's KV of the
committed context instead (llama.cpp's sequence state, services/models/llamacpp_state.py): 769 prompt tokens
in about 25 ms against 1.76 s of prefill, and the draft then follows the target more closely (it attends
over the fp32 target's keys, not its quantized copy's).

Whether a draft is such a copy is measured, never assumed: a probe of token ids goes through both models and
the draft's keys and values are compared with the target's, cosine >= MIN_COSINE at every layer. GGUF
conversion reorders each head's query and key rows for llama.cpp's rotary embedding (a head's two halves
interleaved), so the keys are compared as they are and interleaved, and the form that matches is the one
written. A draft that is another model, a llama.cpp build whose state format this project does not write, or
an engine other than llama.cpp, prefills as before. Output stays lossless whatever the draft's KV holds: the
target verifies every draft.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from services.models.decoder import ForwardRow
from services.models.llamacpp_state import SequenceState, StateFormatError

logger = logging.getLogger(__name__)

MIN_COSINE = 0.99  # a quantized copy of the target measures 0.998-1.0 per layer; another model, far less
MIN_TOKENS = 32  # fewer tokens to catch up are cheaper to evaluate than to copy the whole sequence over
PROBE_TOKENS = 32
ROOM_TOKENS = 256  # a bounded draft reads the whole prompt when this much room to draft is left after it


def probe_ids(vocab_size: int, count: int = PROBE_TOKENS) -> list[int]:
    """Fixed token ids spread over the vocabulary (no tokenizer needed)."""
    return [(index * 7919 + 13) % vocab_size for index in range(1, count + 1)]


def target_rows(kv: torch.Tensor, interleave: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """A target sequence's kv [layers, 2, kv_heads, n, head_dim] as llama.cpp's rows: per layer keys and values
    [n, kv_heads * head_dim] float16; interleave: each head's two key halves interleaved (GGUF's order)."""
    layers, _, heads, count, head_dim = kv.shape
    keys = kv[:, 0].float().cpu()
    if interleave:
        keys = keys.reshape(layers, heads, count, 2, head_dim // 2).transpose(-1, -2).reshape(
            layers, heads, count, head_dim)
    keys = keys.permute(0, 2, 1, 3).reshape(layers, count, heads * head_dim).to(torch.float16).numpy()
    values = kv[:, 1].float().cpu().permute(0, 2, 1, 3).reshape(layers, count, heads * head_dim)
    values = values.to(torch.float16).numpy()
    return list(keys), list(values)


def min_cosine(ours: list[np.ndarray], theirs: list[np.ndarray]) -> float:
    """The lowest per-layer cosine between two models' KV rows (-1 where the shapes differ)."""
    if len(ours) != len(theirs) or any(a.shape != b.shape for a, b in zip(ours, theirs)):
        return -1.0
    lowest = 1.0
    for a, b in zip(ours, theirs):
        a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
        norm = np.linalg.norm(a) * np.linalg.norm(b)
        lowest = min(lowest, float(a @ b / norm) if norm > 0 else -1.0)
    return lowest


@dataclass
class KVBridge:
    """Writes a target sequence's KV into a llama.cpp draft sequence."""

    draft: object  # LlamaCppEngine
    interleave: bool
    layout: SequenceState  # the probe's state: streams and value layout a written state must match
    num_copies: int = 0
    num_tokens: int = 0

    def copy(self, sequence, source, length: int) -> None:
        """The draft `sequence` holds the first `length` positions of the target's `source` (SequenceKV)."""
        keys, values = target_rows(source.kv[:, :, :, :length], self.interleave)
        state = SequenceState(sequence_id=0, num_streams=self.layout.num_streams, stream=0,
                              positions=np.arange(length, dtype=np.int32), keys=keys, values=values,
                              v_trans=self.layout.v_trans)
        self.draft.load_state(sequence, state)
        self.num_copies += 1
        self.num_tokens += length


def measure_bridge(draft_engine, target_engine) -> KVBridge | None:
    """A bridge where the draft engine is llama.cpp and its model a copy of the target's; None otherwise."""
    if not hasattr(draft_engine, "probe_state") or not hasattr(target_engine, "new_sequence"):
        return None
    ids = probe_ids(min(draft_engine.vocab_size, target_engine.target.vocab_size))
    try:
        state = draft_engine.probe_state(ids)
    except StateFormatError as exc:
        logger.info("draft KV from the target: off (%s)", exc)
        return None
    sequence = target_engine.new_sequence()
    try:
        target_engine.forward([ForwardRow(sequence, ids, 1)])
        kv = sequence.kv[:, :, :, :len(ids)]
        scores = {}
        for interleave in (False, True):
            keys, values = target_rows(kv, interleave)
            scores[interleave] = min(min_cosine(keys, state.keys), min_cosine(values, state.values))
    finally:
        sequence.release()
    interleave = max(scores, key=scores.get)
    if scores[interleave] < MIN_COSINE:
        logger.info("draft KV from the target: off (the draft is not a copy of the target: KV cosine %.3f)",
                    scores[interleave])
        return None
    logger.info("draft KV from the target: on (KV cosine %.4f%s)", scores[interleave],
                ", keys interleaved" if interleave else "")
    return KVBridge(draft_engine, interleave, state)


def bridge_for(draft_engine, target_engine) -> KVBridge | None:
    """The bridge between a DraftEngine's engine and a target engine's model, measured once per pair (an
    in-process session makes an engine of its own on the same model)."""
    bridges = draft_engine.kv_bridges
    model = target_engine.target
    if id(model) not in bridges:  # the model is kept beside its verdict, so its id stays its own
        bridges[id(model)] = (model, measure_bridge(draft_engine.engine, target_engine))
    return bridges[id(model)][1]


@dataclass
class TargetLink:
    """A draft sequence's source of KV: its session's target (a TargetSession: token_ids, sequence)."""

    bridge: KVBridge
    target: object

    def available(self, context_ids, held: int = 0) -> int:
        """How many leading positions of context_ids the target's KV holds (0 where they are not its tokens, or
        not MIN_TOKENS more than the `held` the draft already has: then the tokens are not even compared)."""
        target = self.target
        length = min(target.sequence.length, len(context_ids) - 1)
        if length - held < MIN_TOKENS or list(target.token_ids[:length]) != list(context_ids[:length]):
            return 0
        return length


def link_target(drafter, target) -> bool:
    """Let a session's model draft take its KV from the session's target (a TargetSession) where the draft is
    a copy of the target; whether it was linked. A draft that could read only the prompt's tail
    (bound_draft_context) reads it whole when it fits: the prompt costs it a copy, not a prefill."""
    from services.models.drafters.batched import engine_drafter

    model = engine_drafter(drafter)
    if model is None or target is None:
        return False
    model.grammar_source = target  # its proposals follow the session's grammar, if it has one
    kv_bridge = bridge_for(model.draft_engine, target.engine)
    if kv_bridge is None:
        return False
    model.target_link = TargetLink(kv_bridge, target)
    if model.start and len(target.token_ids) + ROOM_TOKENS <= model.draft_engine.max_context:
        model.start = 0
    return True
