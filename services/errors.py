"""Errors raised at the edges of the core, each naming the bad value.

Callers (CLI, gateway) map them to exit codes and HTTP 4xx; anything else
is a bug and surfaces as a 500 / traceback.
"""


class MirrorSDError(Exception):
    """Base class for errors caused by the caller's input or environment."""


class ModelNotFoundError(MirrorSDError):
    """A model spec that is neither built in, a local path, nor in the local HF cache."""


class TokenizerMismatchError(MirrorSDError):
    """A draft whose tokenizer differs from the target's."""


class ContextLengthError(MirrorSDError):
    """A prompt (plus requested tokens) longer than the model's context window."""


class PrecisionError(MirrorSDError):
    """A precision that the device cannot run."""
