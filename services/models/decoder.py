"""One forward of a decoder-only LM over many sequences at once, each of its own length (ragged, packed).

The rows' new tokens are packed into one `[total_tokens, hidden]` stream, so
every weight matrix is read once per step for all rows (that is where
batching pays: on a CPU or a GPU alike the projections dominate). Attention
is per row, against that row's own keys and values in the KV store, with
its own positions (RoPE) and a causal mask offset by what the row already
holds. Nothing is padded and no cache is copied.

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
from services.models.kv_store import KVShape, SequenceKV

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


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """One row's attention, grouped-query without repeating keys: the query heads that share a kv head are
    stacked along the query axis, so each kv head is read once.

    query [kv_heads, groups * n, head_dim], already scaled; keys, values [kv_heads, length, head_dim] (views
    of the store); mask [groups * n, length] additive, or None (a single token sees everything).
    -> [kv_heads, groups * n, head_dim]."""
    if mask is None:
        scores = torch.bmm(query, keys.transpose(1, 2))  # [kv_heads, g*n, length]
    else:
        scores = torch.baddbmm(mask, query, keys.transpose(1, 2))
    if scores.dtype == torch.float32:
        probs = scores.softmax(dim=-1)
    else:  # low precision: the normalisation in fp32
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(values.dtype)
    return torch.bmm(probs, values)


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
    # masks for rows of more than one token, with the query heads of a kv head stacked: [g*n, past + n]
    masks = [causal_mask(count, start, hidden.dtype, device).repeat(groups, 1) if count > 1 else None
             for start, count in zip(starts, counts)]
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
        new_kv = torch.stack((_apply_rope(keys, cos, sin), values)).permute(0, 2, 1, 3)  # [2, kv_heads, T, d]
        # [kv_heads, groups, T, d]: the query heads of each kv head together
        stacked = query.view(total, parts.num_kv_heads, groups, parts.head_dim).permute(1, 2, 0, 3)
        output = torch.empty_like(stacked)
        for index, row in enumerate(rows):
            low, high, start = offsets[index], offsets[index + 1], starts[index]
            row.sequence.write(layer_index, start, new_kv[:, :, low:high])
            row_keys, row_values = row.sequence.view(layer_index, start + counts[index])
            row_query = stacked[:, :, low:high].reshape(parts.num_kv_heads, groups * counts[index], parts.head_dim)
            output[:, :, low:high] = attend(row_query, row_keys, row_values, masks[index]).view(
                parts.num_kv_heads, groups, counts[index], parts.head_dim)
        merged = output.permute(2, 0, 1, 3).reshape(total, parts.num_heads * parts.head_dim)  # [T, heads * d]
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
