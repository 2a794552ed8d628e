"""Model loading (HF id, local directory, GGUF, built-in alias), precision, drafters. Names load on first use:
the model specs and shapes are read by processes that load no model."""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(__name__, submod_attrs={
    "loading": ["LoadedModel", "check_same_tokenizer", "load_model"],
})
