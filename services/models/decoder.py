"""One forward of a decoder-only LM over many sequences at once, each of its own length (ragged, packed).
(Just over 300 lines: the forward and the one-call attention it runs per layer read best side by side.)

The rows' new tokens are packed into one `[total_tokens, hidden]` stream, so
every weight matrix is read once per step for all rows (that is where
batching pays: on a CPU or a GPU alike the projections dominate).

Attention runs in one call per shelf of the KV store (services/models/
kv_store.py): the sequences of one capacity sit side by side in one tensor,
so the step's short rows on a shelf (single tokens, blocks to verify) are one
batched matmul over their slots, their queries padded to the widest row and
each row masked to its own positions; the keys and values are read in place,
never gathered or copied. A row of many tokens (a prefill chunk) attends
alone, with its own causal mask: its work dwarfs a call's. Every row keeps its
own positions (RoPE) and a causal mask offset by what it already holds.

It walks the model's own modules (norms, projections, MLP, rotary embedding,
head), so precision wrappers (int8, bf16 with fp32 norms, transposed fp32
Linear layers) apply unchanged. Architectures: the Llama family, whose layers
are input norm -> q/k/v projections (+ optional per-head q/k norms, Qwen3)
-> RoPE -> attention -> o projection -> residual -> post-attention norm ->
MLP -> residual: Llama, Mistral without a sliding window, Qwen2, Qwen3,
SmolLM, and Mirror-SD's trimmed drafts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from services.errors import MirrorSDError
from services.models.kv_store import KVShape, SequenceKV, Shelf

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedModelError(MirrorSDError):
    """A model whose layers the packed forward cannot walk."""


@dataclass
class DecoderParts:
    embed: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    rotary: nn.Module
    head: Callable[[torch.Tensor], torch.Tensor]  # [n, hidden] -> [n, vocab] logits
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # attention's arithmetic when not the activations' dtype: float64 for int8 targets, whose every other op
    # gives a token the same bits whatever else a forward carries (services/models/int8_linear.py); scores
    # and sums in double round to the same fp32 however a call groups its queries and keys
    attention_dtype: torch.dtype | None = None

    def kv_shape(self, dtype: torch.dtype, device: torch.device) -> KVShape:
        return KVShape(len(self.layers), self.num_kv_heads, self.head_dim, dtype, device)


def decoder_parts(model: nn.Module) -> DecoderParts:
    """The modules of a supported causal LM, or UnsupportedModelError naming its type."""
    if hasattr(model, "decoder_parts"):  # our own models (trimmed drafts) describe themselves
        return model.decoder_parts()
    config = model.config
    model_type = getattr(config, "model_type", type(model).__name__)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported by the batched engine; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    window = getattr(config, "sliding_window", None)
    if window and window < getattr(config, "max_position_embeddings", window + 1) and (
            getattr(config, "use_sliding_window", True)):
        raise UnsupportedModelError(f"model type {model_type!r} with a sliding window of {window} tokens is not "
                                    "supported by the batched engine")
    body = model.model
    return DecoderParts(
        embed=body.embed_tokens, layers=body.layers, norm=body.norm, rotary=body.rotary_emb, head=model.lm_head,
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
    )


@dataclass
class ForwardRow:
    """One row of a step: `token_ids` are appended to `sequence` at positions sequence.length onwards;
    logits come back for the last `num_logits` of them (0: none, a prefill chunk that ends mid-prompt)."""

    sequence: SequenceKV
    token_ids: list[int]
    num_logits: int

    def __post_init__(self) -> None:
        assert self.token_ids, "a row feeds at least one token"
        assert 0 <= self.num_logits <= len(self.token_ids), f"{self.num_logits} logits of {len(self.token_ids)}"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos, sin: [tokens, 1, head_dim]."""
    return x * cos + _rotate_half(x) * sin


def causal_mask(num_new: int, num_past: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask [num_new, num_past + num_new]: new token i sees positions 0 .. num_past + i."""
    total = num_past + num_new
    blocked = torch.ones(num_new, total, dtype=torch.bool, device=device).triu(num_past + 1)
    return torch.zeros(num_new, total, dtype=dtype, device=device).masked_fill_(blocked, float("-inf"))


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
           compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """One row's attention, grouped-query without repeating keys: the query heads that share a kv head are
    stacked along the query axis, so each kv head is read once.

    query [kv_heads, groups * n, head_dim], already scaled; keys, values [kv_heads, length, head_dim] (views
    of the store); mask [groups * n, length] additive, or None (a single token sees everything);
    compute_dtype: DecoderParts.attention_dtype. -> [kv_heads, groups * n, head_dim], query's dtype."""
    if compute_dtype is not None and compute_dtype != query.dtype:
        wide = attend(query.to(compute_dtype), keys.to(compute_dtype), values.to(compute_dtype),
                      None if mask is None else mask.to(compute_dtype))
        return wide.to(query.dtype)
    if mask is None:
        scores = torch.bmm(query, keys.transpose(1, 2))  # [kv_heads, g*n, length]
    else:
        scores = torch.baddbmm(mask, query, keys.transpose(1, 2))
    if scores.dtype in (torch.float32, torch.float64):
        probs = scores.softmax(dim=-1)
    else:  # low precision: the normalisation in fp32
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(values.dtype)
    return torch.bmm(probs, values)


GROUP_MAX_TOKENS = 16  # rows of more tokens (prefill chunks) attend one by one: their own work dwarfs a call's
MAX_SLOT_GAP = 2  # a run of slots breaks where more than this many slots outside the step lie between two rows


@dataclass
class _ShelfGroup:
    """The short rows of a step whose sequences share a shelf, attended in one call over the shelf's slots
    `low .. low + slots - 1`, each row's queries padded to `width`; every index and the mask are built once
    per step, not per layer."""

    shelf: Shelf
    low: int
    slots: int
    width: int
    length: int  # keys read per slot: the longest row's positions after this step
    members: torch.Tensor  # [n] the rows' tokens in the packed stream
    padded: torch.Tensor  # [n] where each token sits in the padded query [slots * width]
    write_slots: torch.Tensor  # [n] the slot each token's keys and values go to
    write_positions: torch.Tensor  # [n] and the position
    mask: torch.Tensor | None  # [slots, 1, 1, width, length] additive, None when no key is hidden


def _shelf_groups(rows: Sequence[ForwardRow], starts: list[int], counts: list[int], offsets: list[int],
                  dtype: torch.dtype, device: torch.device) -> tuple[list[_ShelfGroup], list[int]]:
    """The step's short rows grouped by shelf and run of slots, and the indices of the rows that attend one by
    one (long rows, and a run's lone row). Reading a slot outside the step costs what a call costs, so a run
    breaks at a wider gap."""
    by_shelf: dict[int, list[int]] = {}
    alone = []
    for index, row in enumerate(rows):
        if counts[index] > GROUP_MAX_TOKENS:
            alone.append(index)
        else:
            by_shelf.setdefault(id(row.sequence.shelf), []).append(index)
    runs: list[list[int]] = []
    for indices in by_shelf.values():
        indices.sort(key=lambda index: rows[index].sequence.slot)
        runs.append([indices[0]])
        for previous, index in zip(indices, indices[1:]):
            if rows[index].sequence.slot - rows[previous].sequence.slot > MAX_SLOT_GAP + 1:
                runs.append([])
            runs[-1].append(index)
    alone.extend(run[0] for run in runs if len(run) == 1)  # a lone row saves no call by padding
    groups = []
    for indices in (run for run in runs if len(run) > 1):
        shelf = rows[indices[0]].sequence.shelf
        slots = [rows[index].sequence.slot for index in indices]
        low = min(slots)
        num_slots = max(slots) - low + 1
        width = max(counts[index] for index in indices)
        length = max(starts[index] + counts[index] for index in indices)
        members, padded, write_slots, write_positions = [], [], [], []
        # the last position each padded query sees; padding and slots outside the step see every key
        limits = torch.full((num_slots, width), length - 1, dtype=torch.long)
        for index, slot in zip(indices, slots):
            start, count = starts[index], counts[index]
            members.extend(range(offsets[index], offsets[index] + count))
            padded.extend((slot - low) * width + k for k in range(count))
            write_slots.extend([slot] * count)
            write_positions.extend(range(start, start + count))
            limits[slot - low, :count] = torch.arange(start, start + count)
        mask = None
        if bool((limits < length - 1).any()):
            hidden = torch.arange(length)[None, None, :] > limits[:, :, None]  # [slots, width, length]
            mask = torch.zeros(hidden.shape, dtype=dtype).masked_fill_(hidden, float("-inf"))
            mask = mask.to(device)[:, None, None]

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        groups.append(_ShelfGroup(shelf, low, num_slots, width, length, tensor(members), tensor(padded),
                                  tensor(write_slots), tensor(write_positions), mask))
    return groups, alone


def _attend_group(group: _ShelfGroup, layer_index: int, query: torch.Tensor, new_kv: torch.Tensor,
                  merged: torch.Tensor, compute_dtype: torch.dtype | None = None) -> None:
    """Write the group's new keys and values into its shelf and attend all its rows in one call:
    query [T, kv_heads, groups, d] (scaled), new_kv [T, 2, kv_heads, d]; the result goes into the group's
    tokens of merged [T, heads * d]."""
    shelf_kv = group.shelf.tensor[layer_index]  # [2, slots, kv_heads, capacity, d]
    shelf_kv[:, group.write_slots, :, group.write_positions] = new_kv.index_select(0, group.members)
    _, kv_heads, groups, head_dim = query.shape
    padded = query.new_zeros(group.slots * group.width, kv_heads, groups, head_dim)
    padded.index_copy_(0, group.padded, query.index_select(0, group.members))
    # [slots * kv_heads, groups * width, d]: each kv head's query heads stacked, as in attend()
    stacked = padded.view(group.slots, group.width, kv_heads, groups, head_dim).permute(0, 2, 3, 1, 4).reshape(
        group.slots * kv_heads, groups * group.width, head_dim)
    window = slice(group.low, group.low + group.slots)
    keys = shelf_kv[0, window, :, : group.length].reshape(group.slots * kv_heads, group.length, head_dim)
    values = shelf_kv[1, window, :, : group.length].reshape(group.slots * kv_heads, group.length, head_dim)
    mask = group.mask
    if compute_dtype is not None and compute_dtype != query.dtype:
        stacked, keys, values = stacked.to(compute_dtype), keys.to(compute_dtype), values.to(compute_dtype)
        mask = None if mask is None else mask.to(compute_dtype)
    scores = torch.bmm(stacked, keys.transpose(1, 2))
    if mask is not None:
        scores.view(group.slots, kv_heads, groups, group.width, group.length).add_(mask)
    if scores.dtype in (torch.float32, torch.float64):
        probs = scores.softmax(dim=-1)
    else:  # low precision: the normalisation in fp32
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(values.dtype)
    output = torch.bmm(probs, values).to(query.dtype).view(group.slots, kv_heads, groups, group.width, head_dim)
    output = output.permute(0, 3, 1, 2, 4).reshape(group.slots * group.width, kv_heads * groups * head_dim)
    merged.index_copy_(0, group.members, output.index_select(0, group.padded))


@torch.inference_mode()
def packed_forward(parts: DecoderParts, rows: Sequence[ForwardRow]) -> list[torch.Tensor | None]:
    """Append every row's tokens to its sequence and return float32 logits [num_logits, vocab] per row
    (None where num_logits is 0). Rows must belong to distinct sequences."""
    assert len({id(row.sequence) for row in rows}) == len(rows), "two rows of one sequence in a step"
    sample = parts.embed.weight
    device = sample.device
    starts = [row.sequence.length for row in rows]
    counts = [len(row.token_ids) for row in rows]
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)
    for row, start, count in zip(rows, starts, counts):
        row.sequence.reserve(start + count)
    token_ids = torch.tensor([t for row in rows for t in row.token_ids], dtype=torch.long, device=device)  # [T]
    positions = torch.tensor([p for start, count in zip(starts, counts) for p in range(start, start + count)],
                             dtype=torch.long, device=device)  # [T]
    hidden = parts.embed(token_ids)  # [T, hidden]
    cos, sin = parts.rotary(hidden, positions[None])  # [1, T, head_dim] each
    cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # [T, 1, head_dim]
    groups = parts.num_heads // parts.num_kv_heads
    shelf_groups, alone = _shelf_groups(rows, starts, counts, offsets, hidden.dtype, device)
    # masks of the rows that attend alone, the query heads of a kv head stacked: [g*n, past + n]
    masks = {index: causal_mask(counts[index], starts[index], hidden.dtype, device).repeat(groups, 1)
             if counts[index] > 1 else None for index in alone}  # a single token sees everything
    total = offsets[-1]
    for layer_index, layer in enumerate(parts.layers):
        attention = layer.self_attn
        normed = layer.input_layernorm(hidden)
        query = attention.q_proj(normed).view(total, parts.num_heads, parts.head_dim)
        keys = attention.k_proj(normed).view(total, parts.num_kv_heads, parts.head_dim)
        values = attention.v_proj(normed).view(total, parts.num_kv_heads, parts.head_dim)
        if hasattr(attention, "q_norm"):  # Qwen3: RMSNorm per head before RoPE
            query, keys = attention.q_norm(query), attention.k_norm(keys)
        query = _apply_rope(query, cos, sin).mul_(attention.scaling)
        # [T, kv_heads, groups, d]: the query heads of each kv head together
        query = query.view(total, parts.num_kv_heads, groups, parts.head_dim)
        new_kv = torch.stack((_apply_rope(keys, cos, sin), values), dim=1)  # [T, 2, kv_heads, d]
        merged = torch.empty(total, parts.num_heads * parts.head_dim, dtype=hidden.dtype, device=device)
        for group in shelf_groups:
            _attend_group(group, layer_index, query, new_kv, merged, parts.attention_dtype)
        for index in alone:
            low, high, start, count = offsets[index], offsets[index + 1], starts[index], counts[index]
            sequence = rows[index].sequence
            sequence.write(layer_index, start, new_kv[low:high].permute(1, 2, 0, 3))
            row_keys, row_values = sequence.view(layer_index, start + count)
            row_query = query[low:high].permute(1, 2, 0, 3).reshape(parts.num_kv_heads, groups * count,
                                                                    parts.head_dim)
            merged[low:high] = attend(row_query, row_keys, row_values, masks[index], parts.attention_dtype).view(
                parts.num_kv_heads, groups, count, parts.head_dim).permute(2, 0, 1, 3).reshape(count, -1)
        hidden = hidden + attention.o_proj(merged)
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    for row, count in zip(rows, counts):
        row.sequence.length += count
    wanted = [offsets[index + 1] - row.num_logits + k for index, row in enumerate(rows) for k in range(row.num_logits)]
    if not wanted:
        return [None] * len(rows)
    selected = parts.norm(hidden[torch.tensor(wanted, dtype=torch.long, device=device)])  # [num_logits, hidden]
    logits = parts.head(selected).float()  # [sum num_logits, vocab]
    results: list[torch.Tensor | None] = []
    cursor = 0
    for row in rows:
        results.append(logits[cursor : cursor + row.num_logits] if row.num_logits else None)
        cursor += row.num_logits
    return results
