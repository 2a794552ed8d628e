"""llama.cpp as an engine: a GGUF model run by llama.cpp through llama-cpp-python's C bindings.

It has the face of TorchEngine (services/models/engine.py): new sequences and
one forward over ragged rows, so the draft engine (drafters/batched.py) steps
its sessions on it unchanged. llama.cpp is the engine made for quantized
models on CPUs and edge boxes: the built-in model's own Q4_1 GGUF drafts a
token in a few ms on one core.

One llama_context holds up to `num_sequences` sessions as llama.cpp
sequences. Each sequence has its own KV stream (`kv_unified` off), so a row
attends over its own tokens, not over every session's cells. A sequence
takes a slot when it first runs; when all are taken, the least recently run
sequence outside the step gives its slot up (its length drops to 0, and it
is prefilled again when next asked). A crop removes the KV past the agreed
prefix (llama_memory_seq_rm): nothing before it is evaluated again.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from services.errors import MirrorSDError
from services.models import llamacpp_state
from services.models.decoder import ForwardRow
from services.models.llamacpp_build import DISTRIBUTION, LLAMA_CPP_PYTHON_VERSION

logger = logging.getLogger(__name__)

LLAMA_CPP_PACKAGE = f"{DISTRIBUTION}=={LLAMA_CPP_PYTHON_VERSION}"  # what `make install` builds (services/models/llamacpp_build.py)


class LlamaCppMissingError(MirrorSDError):
    """llama.cpp drafts asked for where llama-cpp-python is not installed."""


class LlamaCppError(MirrorSDError):
    """llama.cpp refused a model, a context or a step."""


def import_llama_cpp():
    """The bindings, or an error that says what to install."""
    try:
        module = importlib.import_module("llama_cpp")
    except ImportError as exc:
        raise LlamaCppMissingError(
            f"llama.cpp drafts need the {DISTRIBUTION!r} package: `mirror-sd llamacpp build` builds {LLAMA_CPP_PACKAGE} "
            f"with portable flags and installs it (`make install` does it; about 4-9 minutes on 2 cores)"
        ) from exc
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # its log callback prints below that level
    return module


def llama_cpp_available() -> bool:
    """Installed (without loading its shared library)."""
    try:
        return importlib.util.find_spec("llama_cpp") is not None
    except (ImportError, ValueError):  # a module entry of None (import blocked) or without a spec
        return False


_BACKEND = threading.Lock()
_backend_ready = False


class GgufModel:
    """A GGUF file loaded by llama.cpp (weights mapped once, shared by every context on it)."""

    def __init__(self, path: Path) -> None:
        global _backend_ready
        self.lib = import_llama_cpp()
        self.path = Path(path)
        if not self.path.is_file():
            raise LlamaCppError(f"GGUF file {str(self.path)!r} not found")
        with _BACKEND:
            if not _backend_ready:
                self.lib.llama_backend_init()
                _backend_ready = True
        params = self.lib.llama_model_default_params()
        self.handle = self.lib.llama_model_load_from_file(str(self.path).encode(), params)
        if not self.handle:
            raise LlamaCppError(f"llama.cpp could not load {str(self.path)!r} (not a GGUF model it supports?)")
        self.vocab = self.lib.llama_model_get_vocab(self.handle)
        self.vocab_size = int(self.lib.llama_vocab_n_tokens(self.vocab))
        self.train_context = int(self.lib.llama_model_n_ctx_train(self.handle))

    def token_texts(self) -> list[str]:
        """Every token's text as the GGUF stores it (byte-level BPE keeps them as the tokenizer's own)."""
        return [self.lib.llama_vocab_get_text(self.vocab, index).decode("utf-8", errors="replace")
                for index in range(self.vocab_size)]

    def close(self) -> None:
        if self.handle:
            self.lib.llama_model_free(self.handle)
            self.handle = None


class LlamaSequence:
    """One session's tokens in a LlamaCppEngine; `length` is how many of them its KV holds."""

    def __init__(self, engine: "LlamaCppEngine") -> None:
        self.engine = engine
        self.length = 0
        self.slot: int | None = None  # llama.cpp sequence id while it holds one
        self.last_used = 0

    def crop(self, length: int) -> None:
        assert 0 <= length, f"crop to {length}"
        if length < self.length:
            if self.slot is not None:
                self.engine.remove(self.slot, length)
            self.length = length

    def release(self) -> None:
        self.crop(0)
        self.engine.free_slot(self)


@dataclass
class _Piece:
    """Part of one row that goes into one llama_decode (a row longer than the batch is split)."""

    row: int
    sequence: LlamaSequence
    token_ids: list[int]
    start: int  # position of token_ids[0]
    logits_from: int  # index in token_ids from which logits are wanted (len = none)


class LlamaCppEngine:
    """Many sessions on one GGUF model in one llama.cpp context: new_sequence() and forward(rows)."""

    def __init__(self, model: GgufModel, *, num_sequences: int = 32, context_tokens: int = 2048,
                 threads: int = 1, batch_tokens: int = 512) -> None:
        lib = self.lib = model.lib
        self.model = model
        if not 1 <= num_sequences <= lib.llama_max_parallel_sequences():
            raise LlamaCppError(f"llama.cpp runs 1 to {lib.llama_max_parallel_sequences()} sequences in a "
                                f"context, not {num_sequences}")
        params = lib.llama_context_default_params()
        params.n_ctx = num_sequences * context_tokens
        params.n_batch = params.n_ubatch = batch_tokens
        params.n_seq_max = num_sequences
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = False  # a stream per sequence: attention over its own cells only
        params.no_perf = True
        self.context = lib.llama_init_from_model(model.handle, params)
        if not self.context:
            raise LlamaCppError(f"llama.cpp could not make a context of {num_sequences} x {context_tokens} "
                                f"tokens for {str(model.path)!r} (out of memory?)")
        self.memory = lib.llama_get_memory(self.context)
        self.context_tokens = int(lib.llama_n_ctx_seq(self.context))
        self.batch_tokens = int(lib.llama_n_batch(self.context))  # llama.cpp may lower it (to a small n_ctx)
        self.threads = threads
        self.num_sequences = num_sequences
        self.vocab_size = model.vocab_size
        self._batch = lib.llama_batch_init(batch_tokens, 0, 1)
        self._free_slots = list(range(num_sequences - 1, -1, -1))
        self._holders: dict[int, LlamaSequence] = {}
        self._clock = 0
        self.num_evictions = 0
        self.num_decoded_tokens = 0  # every token llama.cpp evaluated: a re-evaluated prefix shows up here

    def profile_facts(self) -> dict:
        """What changes this engine's speed, for a cached draft profile (services/engine/profile.py)."""
        stat = self.model.path.stat()
        return {"gguf": str(self.model.path), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                "threads": self.threads, "sequences": self.num_sequences, "context": self.context_tokens,
                "batch": self.batch_tokens, "llama_cpp": getattr(self.lib, "__version__", None)}

    # --- sequences --------------------------------------------------------------------------------
    def new_sequence(self) -> LlamaSequence:
        return LlamaSequence(self)

    def remove(self, slot: int, start: int) -> None:
        self.lib.llama_memory_seq_rm(self.memory, slot, start, -1)

    def free_slot(self, sequence: LlamaSequence) -> None:
        if sequence.slot is not None:
            self.remove(sequence.slot, 0)
            del self._holders[sequence.slot]
            self._free_slots.append(sequence.slot)
            sequence.slot = None
            sequence.length = 0

    def _bind(self, sequences: Sequence[LlamaSequence]) -> None:
        """Give each sequence of a step a slot, taking those of the least recently run others."""
        self._clock += 1
        needed = [sequence for sequence in sequences if sequence.slot is None]
        in_step = {id(sequence) for sequence in sequences}
        if len(needed) > len(self._free_slots):
            idle = sorted((held for held in self._holders.values() if id(held) not in in_step),
                          key=lambda held: held.last_used)
            for victim in idle[: len(needed) - len(self._free_slots)]:
                self.free_slot(victim)
                self.num_evictions += 1
        if len(needed) > len(self._free_slots):
            raise LlamaCppError(f"a step of {len(sequences)} sequences: this context holds "
                                f"{len(self._holders) + len(self._free_slots)}")
        for sequence in needed:
            sequence.slot = self._free_slots.pop()
            self._holders[sequence.slot] = sequence
        for sequence in sequences:
            sequence.last_used = self._clock

    # --- the step ---------------------------------------------------------------------------------
    def forward(self, rows) -> list[torch.Tensor | None]:
        """Append each row's tokens to its sequence (ForwardRow: sequence, token_ids, num_logits); float32
        logits [num_logits, vocab] per row (None for num_logits 0). Rows longer than the batch go in pieces."""
        for row in rows:
            if row.sequence.length + len(row.token_ids) > self.context_tokens:
                raise LlamaCppError(f"a sequence of {row.sequence.length + len(row.token_ids)} tokens: the "
                                    f"llama.cpp context holds {self.context_tokens} per session")
        self._bind([row.sequence for row in rows])
        outputs: list[list[np.ndarray]] = [[] for _ in rows]
        for pieces in self._plan(rows):
            self._decode(pieces, outputs)
        return [torch.from_numpy(np.stack(out)) if out else None for out in outputs]

    def _plan(self, rows) -> list[list[_Piece]]:
        """Rows cut into decodes of at most batch_tokens tokens, in order."""
        decodes: list[list[_Piece]] = [[]]
        room = self.batch_tokens
        for index, row in enumerate(rows):
            start, done, total = row.sequence.length, 0, len(row.token_ids)
            while done < total:
                if room == 0:
                    decodes.append([])
                    room = self.batch_tokens
                take = min(room, total - done)
                logits_from = max(0, total - row.num_logits - done)
                decodes[-1].append(_Piece(index, row.sequence, row.token_ids[done: done + take], start + done,
                                          min(take, logits_from)))
                room -= take
                done += take
        return [pieces for pieces in decodes if pieces]

    def _decode(self, pieces: list[_Piece], outputs: list[list[np.ndarray]]) -> None:
        batch = self._batch
        count = 0
        for piece in pieces:
            for offset, token_id in enumerate(piece.token_ids):
                batch.token[count] = token_id
                batch.pos[count] = piece.start + offset
                batch.n_seq_id[count] = 1
                batch.seq_id[count][0] = piece.sequence.slot
                batch.logits[count] = 1 if offset >= piece.logits_from else 0
                count += 1
        batch.n_tokens = count
        status = self.lib.llama_decode(self.context, batch)
        if status != 0:
            raise LlamaCppError(f"llama_decode failed ({status}) on a step of {count} tokens")
        self.num_decoded_tokens += count
        index = 0
        for piece in pieces:
            for offset in range(len(piece.token_ids)):
                if offset >= piece.logits_from:
                    pointer = self.lib.llama_get_logits_ith(self.context, index)
                    outputs[piece.row].append(np.ctypeslib.as_array(pointer, shape=(self.vocab_size,)).copy())
                index += 1
            piece.sequence.length = piece.start + len(piece.token_ids)

    # --- sequence state: a prompt's KV written from outside (services/models/drafters/target_kv.py) ---------
    def probe_state(self, token_ids: Sequence[int]) -> "llamacpp_state.SequenceState":
        """Evaluate token_ids in a sequence of its own and return its KV as llama.cpp writes it, read back
        by llamacpp_state (StateFormatError where this build's format is not the one written there)."""
        sequence = self.new_sequence()
        try:
            self.forward([ForwardRow(sequence, list(token_ids), 1)])
            size = int(self.lib.llama_state_seq_get_size(self.context, sequence.slot))
            buffer = (ctypes.c_uint8 * size)()
            written = int(self.lib.llama_state_seq_get_data(self.context, buffer, size, sequence.slot))
            return llamacpp_state.check_format(bytes(buffer[:written]))
        finally:
            sequence.release()

    def load_state(self, sequence: LlamaSequence, state: "llamacpp_state.SequenceState") -> None:
        """Replace the sequence's KV with `state`'s cells (positions 0 .. n - 1)."""
        if len(state.positions) > self.context_tokens:
            raise LlamaCppError(f"a sequence state of {len(state.positions)} tokens: the llama.cpp context holds "
                                f"{self.context_tokens} per session")
        self._bind([sequence])
        blob = llamacpp_state.write(state)
        buffer = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        read = int(self.lib.llama_state_seq_set_data(self.context, buffer, len(blob), sequence.slot))
        if read != len(blob):  # llama.cpp cleared the sequence
            sequence.length = 0
            raise LlamaCppError(f"llama.cpp refused a sequence state of {len(state.positions)} tokens")
        sequence.length = len(state.positions)

    def set_threads(self, threads: int) -> None:
        self.lib.llama_set_n_threads(self.context, threads, threads)
        self.threads = threads

    def close(self) -> None:
        if self.context:
            self.lib.llama_batch_free(self._batch)
            self.lib.llama_free(self.context)
            self.context = None
