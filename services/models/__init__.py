"""Model loading (HF id, local directory, GGUF, built-in alias), precision, drafters."""

from services.models.loading import LoadedModel, check_same_tokenizer, load_model

__all__ = ["LoadedModel", "check_same_tokenizer", "load_model"]
