"""Model drafts of many sessions stepped together: one packed forward of the draft model per draft position.

A draft worker holds one draft model and many sessions. `EngineDrafter` is a
session's view of a shared `DraftEngine`: the draft model on an engine (the
packed torch forward of services/models/decoder.py, or llama.cpp for GGUF
drafts), each session a sequence in the engine's KV store. `propose_many` drafts a block for every session that needs
one in the same forwards: the rows first catch each sequence up with its
committed context (a crop keeps the agreed prefix, nothing is recomputed),
then one token per row per step. Each call draws from its own generator
under its own sampling warp, so a block is the same whether drafted alone or
with others. Drafters that cannot batch (prompt lookup, synthetic, models
the packed forward does not walk) are asked one by one.

A model draft may read a bounded context (bound_draft_context): the last N
tokens of the prompt and everything after it. A long grounded prompt then
costs the draft N tokens of prefill, not the whole prompt, and each draft
step attends over less. The bound is fixed by the prompt's length alone, so a
session drafts the same blocks wherever it is drafted. Output stays lossless:
the target verifies whatever the draft proposes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.models.engine import TorchEngine
from services.models.decoder import ForwardRow
from services.models.drafters.base import DraftProposal, Drafter, longer_allowed
from services.models.kv_cache import common_prefix_length
from services.models.loading import LoadedModel
from services.speculative.params import SamplingParams
from services.speculative.grammar_state import mask_logits
from services.speculative.processing import DraftProcessing
from services.speculative.sampling import sample_from_probs, warp_logits

logger = logging.getLogger(__name__)


@dataclass
class DraftCall:
    drafter: Drafter
    context_ids: Sequence[int]
    num_draft_tokens: int
    sampling: SamplingParams
    generator: torch.Generator | None
    # the most tokens the block may hold (the request's end): a drafter that extends may propose up to this
    max_draft_tokens: int | None = None


class DraftEngine:
    """One draft model shared by every session of a process, on an engine that offers new sequences and a
    forward over ragged rows: torch (TorchEngine) or llama.cpp (services/models/llamacpp.py)."""

    def __init__(self, engine, *, name: str, max_context: int, chunk_size: int = 512) -> None:
        self.engine = engine
        self.name = name
        self.max_context = max_context
        self.chunk_size = chunk_size
        self.kv_bridges: dict = {}  # target model id -> (model, KVBridge | None): drafters/target_kv.py bridge_for

    @classmethod
    def on_torch(cls, loaded: LoadedModel, *, chunk_size: int = 512) -> "DraftEngine":
        return cls(TorchEngine(loaded), name=loaded.name, max_context=loaded.max_context, chunk_size=chunk_size)

    def new_drafter(self, name: str | None = None) -> "EngineDrafter":
        return EngineDrafter(self, name or self.name)

    def _sync(self, calls: list[DraftCall]) -> list[torch.Tensor]:
        """Bring each call's sequence to its context (the agreed prefix kept); next-token logits [vocab] each.
        A sequence may hold fewer tokens than its drafter last fed it (an engine with a fixed number of
        slots lends a slot to another session): only what it still holds is kept."""
        pending = []
        for call in calls:
            drafter = call.drafter
            drafter.adopt(call.context_ids)
            keep = drafter.kept_prefix(call.context_ids)
            drafter.sequence.crop(keep)
            del drafter.cached_ids[keep:]
            pending.append(list(drafter.view(call.context_ids)[keep:]))
        while any(len(tokens) > self.chunk_size for tokens in pending):  # long prompts: chunks, no logits
            rows, owners = [], []
            for call, tokens in zip(calls, pending):
                if len(tokens) > self.chunk_size:
                    rows.append(ForwardRow(call.drafter.sequence, tokens[: self.chunk_size], 0))
                    owners.append((call, tokens))
            self.engine.forward(rows)
            for call, tokens in owners:
                call.drafter.cached_ids.extend(tokens[: self.chunk_size])
                del tokens[: self.chunk_size]
        logits = self.engine.forward([ForwardRow(call.drafter.sequence, tokens, 1)
                                      for call, tokens in zip(calls, pending)])
        for call, tokens in zip(calls, pending):
            call.drafter.cached_ids.extend(tokens)
        return [row[0] for row in logits]

    def prefill_many(self, items: list[tuple["EngineDrafter", Sequence[int]]], budget: int) -> None:
        """Feed up to `budget` tokens, in one forward, of what the drafters' sequences lack of their contexts
        (all but each context's last token, which the next proposal feeds for its logits): a cold session's
        prompt warmed a piece at a time, off the critical path (services/engine/draft_pipeline.py warm_up)."""
        rows, owners = [], []
        for drafter, context in items:
            drafter.adopt(context)
            keep = drafter.kept_prefix(context)
            take = min(drafter.missing(context), budget, self.chunk_size)
            if take <= 0:
                continue
            drafter.sequence.crop(keep)
            del drafter.cached_ids[keep:]
            tokens = list(drafter.view(context)[keep: keep + take])
            rows.append(ForwardRow(drafter.sequence, tokens, 0))
            owners.append((drafter, tokens))
            budget -= take
        if rows:
            self.engine.forward(rows)
            for drafter, tokens in owners:
                drafter.cached_ids.extend(tokens)

    def propose_many(self, calls: list[DraftCall]) -> list[DraftProposal]:
        """Every call's block, the calls stepped together (at most max(num_draft_tokens) forwards after the
        catch-up one)."""
        wanted = [max(0, min(call.num_draft_tokens, self.max_context - call.drafter.read_length(call.context_ids)))
                  for call in calls]
        active = [index for index, count in enumerate(wanted) if count > 0]
        tokens: list[list[int]] = [[] for _ in calls]
        probs: list[list[torch.Tensor]] = [[] for _ in calls]
        masks = {}
        if active:
            logits = dict(zip(active, self._sync([calls[index] for index in active])))
            processing = {index: DraftProcessing(calls[index].context_ids, calls[index].sampling,
                                                 logits[index].shape[-1])
                          for index in active if DraftProcessing.needed(calls[index].sampling)}
            masks = {index: found for index in active
                     if (found := grammar_masks(calls[index].drafter, calls[index].context_ids)) is not None}
            while active:
                for index in active:
                    call = calls[index]
                    row = logits[index] if index not in processing else processing[index].apply(logits[index])
                    if index in masks:  # the session's grammar: the draft proposes only what it allows
                        row = mask_logits(row[None], masks[index].allowed()[None])[0]
                    if call.sampling.greedy:
                        token_id = int(row.argmax().item())
                    else:
                        row_probs = warp_logits(row[None], call.sampling)  # [1, vocab]
                        token_id = int(sample_from_probs(row_probs, call.generator).item())
                        probs[index].append(row_probs[0])
                    tokens[index].append(token_id)
                    if index in processing:
                        processing[index].add(token_id)
                    if index in masks:
                        masks[index].push(token_id)
                active = [index for index in active if len(tokens[index]) < wanted[index]]
                if not active:
                    break
                rows = [ForwardRow(calls[index].drafter.sequence, [tokens[index][-1]], 1) for index in active]
                for index, row_logits in zip(active, self.engine.forward(rows)):
                    calls[index].drafter.cached_ids.append(tokens[index][-1])
                    logits[index] = row_logits[0]
        for found in masks.values():
            found.close()
        return [DraftProposal(tokens[index], torch.stack(probs[index]) if probs[index] else None)
                for index in range(len(calls))]


def grammar_masks(drafter: "EngineDrafter", context_ids: Sequence[int]):
    """Where the drafter's session decodes under a grammar (its target linked: target_kv.py link_target), the
    masks its proposals follow; else None."""
    target = drafter.grammar_source
    grammar = getattr(target, "grammar", None)
    if grammar is None:
        return None
    committed = target.token_ids
    recent = max(0, len(committed) - 8)  # a context that left the committed tokens is not masked (tail checked)
    if list(context_ids[recent:len(committed)]) != committed[recent:]:
        return None
    return grammar.drafting(context_ids, len(committed))


class EngineDrafter:
    """A session's drafter on a shared DraftEngine: its own sequence in the draft model's KV store."""

    stepwise = True  # propose(ctx, n) == n calls of propose(ctx + drafted, 1): the KV carries over

    def __init__(self, engine: DraftEngine, name: str) -> None:
        self.name = name
        self.draft_engine = engine
        self.sequence = engine.engine.new_sequence()
        self.cached_ids: list[int] = []  # what the sequence holds: view(context)'s tokens, from its start
        self.start = 0  # the first context position the draft reads (bound_draft_context)
        self.target_link = None  # its session's target, where this draft takes the target's KV (target_kv.py)
        self.grammar_source = None  # its session's target (a TargetSession), whose grammar its proposals follow

    def propose(self, context_ids: Sequence[int], num_draft_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> DraftProposal:
        return self.draft_engine.propose_many([DraftCall(self, context_ids, num_draft_tokens, sampling,
                                                         generator)])[0]

    def view(self, context_ids: Sequence[int]) -> Sequence[int]:
        """The part of the context the draft reads: from `start` on (all of it when the context is shorter)."""
        return context_ids[self.start:] if 0 < self.start < len(context_ids) else context_ids

    def read_length(self, context_ids: Sequence[int]) -> int:
        return len(self.view(context_ids))

    def kept_prefix(self, context_ids: Sequence[int]) -> int:
        """How much of the context the draft reads its KV already holds and keeps (short of the last token,
        fed again for its logits)."""
        view = self.view(context_ids)
        return min(common_prefix_length(self.cached_ids, view), len(view) - 1, self.sequence.length)

    def adoptable(self, context_ids: Sequence[int]) -> int:
        """How much of the context the session's target could hand this draft's KV (target_kv.py): 0 unless
        the draft reads the context from its start and the target holds MIN_TOKENS more than the draft."""
        if self.target_link is None or self.start:
            return 0
        return self.target_link.available(context_ids, held=self.kept_prefix(context_ids))

    def adopt(self, context_ids: Sequence[int]) -> None:
        """Take the target's KV of the context where that saves evaluating MIN_TOKENS or more."""
        available = self.adoptable(context_ids)
        if available:
            self.target_link.bridge.copy(self.sequence, self.target_link.target.sequence, available)
            self.cached_ids = list(context_ids[:available])

    def missing(self, context_ids: Sequence[int]) -> int:
        """Tokens to prefill before a proposal from this context costs only its draft steps (what the target's
        KV can give it costs a copy, not a prefill)."""
        computed = max(self.kept_prefix(context_ids), self.adoptable(context_ids))
        return max(0, self.read_length(context_ids) - 1 - computed)

    def release(self) -> None:
        """Free the KV memory; the drafter stays usable (a new, empty sequence)."""
        self.sequence.release()
        self.sequence = self.draft_engine.engine.new_sequence()
        self.cached_ids.clear()


def engine_drafter(drafter: Drafter | None) -> EngineDrafter | None:
    """The model drafter that steps with others on a DraftEngine: the drafter itself or a hybrid's model half."""
    model = getattr(drafter, "model", drafter)
    return model if isinstance(model, EngineDrafter) else None


def bound_draft_context(drafter: Drafter | None, num_prompt_tokens: int, window: int) -> None:
    """Let a model draft read only the last `window` tokens of a prompt (0: all of it) and what follows:
    set once per session, from the prompt alone. Prompt lookup (a hybrid's other half) still reads it all."""
    model = engine_drafter(drafter)
    if model is not None and window > 0:
        model.start = max(0, num_prompt_tokens - window)


def propose_many(calls: list[DraftCall]) -> list[DraftProposal]:
    """Each call's proposal; calls whose drafter is (or falls back to) an EngineDrafter of the same engine
    are stepped together, the others asked one by one. A hybrid asks prompt lookup first, as alone."""
    results: list[DraftProposal | None] = [None] * len(calls)
    batched: dict[int, list[tuple[int, DraftCall]]] = {}
    for index, call in enumerate(calls):
        drafter = call.drafter
        lookup = getattr(drafter, "lookup", None)
        if lookup is not None:  # HybridDrafter, SuffixModelDrafter: the lookup's draft when it has (or pays)
            proposal = drafter.propose_lookup(call.context_ids, call.num_draft_tokens, call.sampling,
                                              call.generator, **longer_allowed(drafter, call.max_draft_tokens))
            if proposal is not None:
                results[index] = proposal
                continue
            drafter = drafter.model
        if isinstance(drafter, EngineDrafter):
            model_call = DraftCall(drafter, call.context_ids, call.num_draft_tokens, call.sampling, call.generator)
            batched.setdefault(id(drafter.draft_engine), []).append((index, model_call))
        else:
            results[index] = drafter.propose(call.context_ids, call.num_draft_tokens, call.sampling,
                                             call.generator, **longer_allowed(drafter, call.max_draft_tokens))
            if drafter is not call.drafter and hasattr(call.drafter, "model_proposed"):
                call.drafter.model_proposed(call.context_ids, results[index])
    for group in batched.values():
        engine = group[0][1].drafter.draft_engine
        for (index, _), proposal in zip(group, engine.propose_many([call for _, call in group])):
            results[index] = proposal
            chooser = calls[index].drafter
            if hasattr(chooser, "model_proposed"):  # a per-round choice measures its model draft's acceptance
                chooser.model_proposed(calls[index].context_ids, proposal)
    return results
