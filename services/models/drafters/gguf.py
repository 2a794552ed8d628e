"""GGUF drafts on llama.cpp: `--draft gguf:PATH`, or `gguf:<built-in alias>` for a built-in model's own GGUF.

The draft is a DraftEngine (drafters/batched.py) on a LlamaCppEngine
(services/models/llamacpp.py): every session of a draft worker process is a
sequence of one llama.cpp context, the drafts of all sessions answered in a
turn go into one llama_decode per draft position, and each session's KV is
trimmed to the agreed prefix after a verdict. Proposals carry their
probabilities under the request's own warp (temperature, top-k, top-p;
drafters/batched.py applies it to llama.cpp's logits), so rejection
sampling stays exact.

The draft must speak the target's token ids: its vocabulary is compared
token by token with the target's tokenizer, and a mismatch is refused
naming both.

Before llama.cpp is loaded into this process, it decodes the GGUF once in a
child process (services/models/llamacpp_check.py, cached per GGUF, build and
CPU): a build that faults on this CPU raises LlamaCppFaultError, which the
draft worker answers by drafting with suffix drafts alone, instead of dying.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

from services.config import LlamaCppSettings, default_cache_dir
from services.errors import ModelNotFoundError, TokenizerMismatchError
from services.models.builtin import BUILTIN_MODELS, package_dir
from services.models.drafters.batched import DraftEngine
from services.models.llamacpp import GgufModel, LlamaCppEngine, import_llama_cpp, llama_cpp_available
from services.models.llamacpp_check import EngineParams, LlamaCppFaultError, cached_engine_check
from services.models.loading import TargetVocab

logger = logging.getLogger(__name__)

GGUF_PREFIX = "gguf:"


def is_gguf_spec(spec: str) -> bool:
    return spec.startswith(GGUF_PREFIX)


DRAFT_QUANT = "q8_0"
# Requantizes a GGUF in a child process (a llama.cpp build that faults here takes down only the child).
_QUANTIZE = """
import ctypes, sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype, params.allow_requantize, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, True, 2
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))
"""


def prepared_draft(builtin, cache_dir: Path) -> Path | None:
    """The built-in model's GGUF requantized to Q8_0 for drafting, made once in cache_dir (under a second).

    The shipped file is Q4_1, for which llama.cpp has no fast CPU kernels; its Q8_0 copy holds the same
    values nearly exactly and runs on llama.cpp's Q8_0 kernels. Measured on a 2-core AMD EPYC, 2 threads:
    decode 8.4 against 9.1 ms per token, a 16-session step 60 against 80 ms, a 256-token prefill 560 against
    900 ms; in-process speculation over 12 dev prompts 1.76x against 1.58x, acceptance 0.90 against 0.88
    (docs/bench/llamacpp-build-2026-12-02). None when llama.cpp cannot make it here (the shipped file is used)."""
    source = package_dir(builtin) / builtin.gguf_file
    path = Path(cache_dir) / "models" / builtin.alias / f"draft-{DRAFT_QUANT}.gguf"
    if path.is_file() and path.stat().st_mtime_ns >= source.stat().st_mtime_ns:
        return path
    if not llama_cpp_available():
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        done = subprocess.run([sys.executable, "-c", _QUANTIZE, str(source), str(staging)], capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0 or not staging.is_file():
            logger.warning("could not requantize %s to %s (exit %s): drafting with the shipped file", source.name,
                           DRAFT_QUANT, done.returncode)
            return None
        staging.replace(path)  # atomic: a process starting beside this one finds a whole file or none
    finally:
        staging.unlink(missing_ok=True)
    logger.info("prepared the draft %s from %s (one time)", path, source.name)
    return path


def gguf_path(spec: str, cache_dir: Path | None = None) -> Path:
    """The file a `gguf:` spec names: a built-in alias's GGUF (its Q8_0 copy in cache_dir when there is one),
    else a path."""
    name = spec.removeprefix(GGUF_PREFIX)
    if name in BUILTIN_MODELS:
        builtin = BUILTIN_MODELS[name]
        prepared = prepared_draft(builtin, cache_dir) if cache_dir is not None else None
        return prepared or package_dir(builtin) / builtin.gguf_file
    path = Path(name).expanduser()
    if not name or not path.is_file():
        known = ", ".join(f"gguf:{alias}" for alias in sorted(BUILTIN_MODELS))
        raise ModelNotFoundError(f"draft {spec!r}: no GGUF file at {name!r} (give a path, or one of {known})")
    return path


def check_gguf_vocab(model: GgufModel, target: TargetVocab, spec: str) -> None:
    """Refuse a GGUF whose token ids are not the target's: same count, same text for every id."""
    if model.vocab_size != target.vocab_size:
        raise TokenizerMismatchError(
            f"draft {spec!r} (vocab size {model.vocab_size}) does not share the tokenizer of target "
            f"{target.name!r} (vocab size {target.vocab_size}); speculative decoding needs the same token ids")
    if target.tokenizer is None:
        return
    by_id = {index: text for text, index in target.tokenizer.get_vocab().items()}
    for index, text in enumerate(model.token_texts()):
        if index in by_id and by_id[index] != text:
            raise TokenizerMismatchError(
                f"draft {spec!r} does not share the tokenizer of target {target.name!r}: token {index} is "
                f"{text!r} in the draft and {by_id[index]!r} in the target")


def default_threads(settings: LlamaCppSettings, num_threads: int | None) -> int:
    """llama.cpp threads: its own setting, else the process's thread count, else the cores it may run on
    (a pinned draft worker gets its own cores)."""
    if settings.threads:
        return settings.threads
    if num_threads:
        return num_threads
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def check_params(path: Path, settings: LlamaCppSettings, threads: int) -> EngineParams:
    """The engine a draft runs, for its check: the same threads and batch (they choose llama.cpp's code paths);
    8 sequences of 256 tokens whatever the settings (the same kernels on a small KV, and one verdict for them
    all)."""
    return EngineParams(str(path), threads=threads, num_sequences=8, context_tokens=256,
                        batch_tokens=settings.batch_tokens)


def load_gguf_engine(spec: str, target: TargetVocab, settings: LlamaCppSettings | None = None, *,
                     num_threads: int | None = None, chunk_size: int = 512,
                     cache_dir: Path | None = None) -> DraftEngine:
    """cache_dir: where the engine check's verdict is kept (default: the platform's user cache); raises
    LlamaCppFaultError when llama.cpp faults, hangs or fails on this GGUF here."""
    settings = settings or LlamaCppSettings()
    cache_dir = cache_dir or default_cache_dir()
    path = gguf_path(spec, cache_dir)
    threads = default_threads(settings, num_threads)
    if settings.check_engine:
        if not llama_cpp_available():
            import_llama_cpp()  # a missing package is a configuration error: LlamaCppMissingError says what to do
        check = cached_engine_check(check_params(path, settings, threads), cache_dir)
        if not check.ok:
            raise LlamaCppFaultError(check, spec)
    model = GgufModel(path)
    check_gguf_vocab(model, target, spec)
    engine = LlamaCppEngine(model, num_sequences=settings.num_sequences, context_tokens=settings.context_tokens,
                            threads=threads, batch_tokens=settings.batch_tokens)
    logger.info("draft %s: llama.cpp, %s, %d threads, %d sessions x %d tokens of KV", spec, path.name, threads,
                settings.num_sequences, engine.context_tokens)
    return DraftEngine(engine, name=spec, max_context=min(engine.context_tokens, model.train_context),
                       chunk_size=min(chunk_size, settings.batch_tokens))
