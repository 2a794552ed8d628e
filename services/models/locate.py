"""Where a model spec's files are: a built-in alias, a .gguf file (converted once), a transformers folder or a
Hugging Face id in the local cache. Plain Python: the gateway reads a model's tokenizer from here without
loading any model code."""

from __future__ import annotations

import hashlib
from pathlib import Path

from services.errors import ModelNotFoundError
from services.models.builtin import BUILTIN_MODELS, convert_builtin, convert_gguf


def gguf_cache_dir(gguf_path: Path, cache_dir: Path) -> Path:
    """A converted GGUF's folder, keyed by the file's path, size and mtime (a new file converts anew)."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir / "models" / f"{gguf_path.stem}-{key}"


def resolve_model_dir(spec: str, cache_dir: Path) -> tuple[str, str]:
    """-> (display name, what to pass to from_pretrained). Converts GGUF files on first use."""
    if spec in BUILTIN_MODELS:
        builtin = BUILTIN_MODELS[spec]
        return builtin.display_name, str(convert_builtin(builtin, cache_dir))
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.stem, str(convert_gguf(path, gguf_cache_dir(path, cache_dir), path.stem))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model directory {spec!r} has no config.json")
        return path.name, str(path)
    if path.exists() or spec.startswith((".", "/", "~")):
        raise ModelNotFoundError(f"model path {spec!r} is neither a model directory nor a .gguf file")
    return spec, spec  # a Hugging Face id, looked up in the local cache only
