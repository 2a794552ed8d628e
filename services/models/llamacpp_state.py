"""A sequence's KV in llama.cpp's own sequence-state format: written here, read by `llama_state_seq_set_data`.

This lets a llama.cpp draft take the keys and values of a prompt the target has already read, instead of
reading it again (services/models/drafters/target_kv.py). The format is llama.cpp's (llama-context.cpp
state_seq_get_data, llama-kv-cache.cpp state_write), little-endian:

    u32 magic (0xaf143cd8), i32 sequence id,
    u32 number of KV streams; per stream: u32 cell count, and where it is not 0:
        per cell: i32 position, u32 1 (one sequence), i32 sequence id
        u32 v_trans, u32 layers
        per layer: i32 key type, u64 key row bytes, cells x row (a row: every KV head's keys, head after head)
        per layer, v_trans 0: i32 value type, u64 value row bytes, cells x row
        per layer, v_trans 1: i32 value type, u32 element bytes, u32 row width, then row-major [width, cells]

It is not a stable interface, so nothing here trusts it: `check_format` asks the loaded build for a real
sequence's state, reads it with `parse`, writes it again with `write`, and requires the same bytes. A
build whose format differs fails that check, and its drafts read prompts themselves, as before.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

MAGIC = 0xAF143CD8
F16 = 1  # ggml's type id of float16, the KV cache's default type


class StateFormatError(ValueError):
    """A sequence state this module cannot read (another llama.cpp format, or not a sequence state)."""


@dataclass
class SequenceState:
    """One sequence's KV as llama.cpp holds it: per layer [cells, kv_heads * head_dim] float16."""

    sequence_id: int
    num_streams: int
    stream: int  # the stream whose cells these are
    positions: np.ndarray  # [cells] int32
    keys: list[np.ndarray]
    values: list[np.ndarray]
    v_trans: bool = False


class _Reader:
    def __init__(self, blob: bytes) -> None:
        self.blob, self.offset = blob, 0

    def take(self, fmt: str):
        try:
            values = struct.unpack_from(fmt, self.blob, self.offset)
        except struct.error as exc:
            raise StateFormatError(f"sequence state ends early at byte {self.offset}") from exc
        self.offset += struct.calcsize(fmt)
        return values[0] if len(values) == 1 else values

    def array(self, dtype, count: int) -> np.ndarray:
        size = np.dtype(dtype).itemsize * count
        if self.offset + size > len(self.blob):
            raise StateFormatError(f"sequence state ends early at byte {self.offset}")
        out = np.frombuffer(self.blob, dtype=dtype, count=count, offset=self.offset)
        self.offset += size
        return out


def parse(blob: bytes) -> SequenceState:
    """A single sequence's state (one stream with cells, float16 keys and values), or StateFormatError."""
    reader = _Reader(blob)
    magic, sequence_id, num_streams = reader.take("<IiI")
    if magic != MAGIC:
        raise StateFormatError(f"not a llama.cpp sequence state (magic {magic:#x})")
    found: SequenceState | None = None
    for stream in range(num_streams):
        cells = reader.take("<I")
        if cells == 0:
            continue
        if found is not None:
            raise StateFormatError("a sequence state with cells in two streams")
        meta = reader.array(np.int32, 3 * cells).reshape(cells, 3)
        if not (meta[:, 1] == 1).all():
            raise StateFormatError("a cell shared by several sequences")
        v_trans, num_layers = reader.take("<II")
        keys, values = [], []
        for _ in range(num_layers):
            kind, row_bytes = reader.take("<iQ")
            if kind != F16:
                raise StateFormatError(f"key type {kind}, not float16")
            keys.append(reader.array(np.float16, cells * row_bytes // 2).reshape(cells, row_bytes // 2))
        for _ in range(num_layers):
            if v_trans:
                kind, element, width = reader.take("<iII")
                if kind != F16 or element != 2:
                    raise StateFormatError(f"value type {kind}, not float16")
                values.append(reader.array(np.float16, cells * width).reshape(width, cells).T)
            else:
                kind, row_bytes = reader.take("<iQ")
                if kind != F16:
                    raise StateFormatError(f"value type {kind}, not float16")
                values.append(reader.array(np.float16, cells * row_bytes // 2).reshape(cells, row_bytes // 2))
        found = SequenceState(sequence_id, num_streams, stream, meta[:, 0].copy(), keys, values, bool(v_trans))
    if found is None:
        raise StateFormatError("a sequence state with no cells")
    if reader.offset != len(blob):
        raise StateFormatError(f"{len(blob) - reader.offset} bytes left over after the sequence state")
    return found


def write(state: SequenceState) -> bytes:
    """The bytes `llama_state_seq_set_data` reads for this state (parse's inverse)."""
    cells = len(state.positions)
    parts = [struct.pack("<IiI", MAGIC, state.sequence_id, state.num_streams)]
    parts += [struct.pack("<I", 0)] * state.stream
    meta = np.empty((cells, 3), dtype="<i4")
    meta[:, 0], meta[:, 1], meta[:, 2] = state.positions, 1, state.sequence_id
    parts += [struct.pack("<I", cells), meta.tobytes(), struct.pack("<II", int(state.v_trans), len(state.keys))]
    for keys in state.keys:
        parts += [struct.pack("<iQ", F16, keys.shape[1] * 2), np.ascontiguousarray(keys, dtype="<f2").tobytes()]
    for values in state.values:
        if state.v_trans:
            parts += [struct.pack("<iII", F16, 2, values.shape[1]),
                      np.ascontiguousarray(values.T, dtype="<f2").tobytes()]
        else:
            parts += [struct.pack("<iQ", F16, values.shape[1] * 2),
                      np.ascontiguousarray(values, dtype="<f2").tobytes()]
    parts += [struct.pack("<I", 0)] * (state.num_streams - state.stream - 1)
    return b"".join(parts)


def check_format(blob: bytes) -> SequenceState:
    """Parse a state the loaded build wrote and require `write` to give back the same bytes; the parsed
    state (its stream, v_trans, layer widths: what a written state must match). StateFormatError if not."""
    state = parse(blob)
    if write(state) != blob:
        raise StateFormatError("this llama.cpp build's sequence state is not the format this module writes")
    return state
