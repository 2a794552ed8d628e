"""A model folder's tokenizer and context window, without the model's code.

transformers' `AutoTokenizer` reads the model's config to pick a tokenizer class, and its config module imports
torch: about 2 s and 240 MB in a process that never runs a model (the gateway). A folder that transformers 5
saved (the built-in model's, as `mirror-sd models prepare` converts it) names its class in tokenizer_config.json;
when that class is the generic `TokenizersBackend` and no custom code is mapped, `AutoTokenizer` itself ends in
`TokenizersBackend.from_pretrained` for that folder, so the same call is made here directly. Every other folder
(an older save, a class of its own, remote code, a Hub id) goes through `AutoTokenizer` as before."""

from __future__ import annotations

import json
import os
from pathlib import Path

DIRECT_CLASS = "TokenizersBackend"
DEFAULT_CONTEXT = 2048  # what the gateway assumed before for a config without max_position_embeddings


def _read_json(path: Path) -> dict | None:
    try:
        with path.open(encoding="utf-8") as handle:
            value = json.load(handle)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def loads_directly(source: str) -> bool:
    """The folder's own tokenizer_config.json names the generic class and maps no custom code."""
    folder = Path(source)
    config = _read_json(folder / "tokenizer_config.json") if folder.is_dir() else None
    return (config is not None and config.get("tokenizer_class") == DIRECT_CLASS and "auto_map" not in config
            and (folder / "tokenizer.json").is_file())


def load_tokenizer(source: str):
    """The tokenizer `AutoTokenizer.from_pretrained(source, local_files_only=True)` gives, loaded without
    importing model code where the folder allows it. Raises what transformers raises for a folder without one."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # run-time loads never touch the network
    if loads_directly(source):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(source, local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source, local_files_only=True)


def max_context(source: str) -> int:
    """The model's context window (max_position_embeddings), read from its config.json when it states one,
    else from transformers' config class (which maps other names for it, such as GPT-2's n_positions)."""
    config = _read_json(Path(source) / "config.json")
    if config is not None and isinstance(config.get("max_position_embeddings"), int):
        return int(config["max_position_embeddings"])
    from transformers import AutoConfig

    loaded = AutoConfig.from_pretrained(source, local_files_only=True)
    return int(getattr(loaded, "max_position_embeddings", DEFAULT_CONTEXT))
