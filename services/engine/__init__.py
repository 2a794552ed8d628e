"""The in-process engine: a target session, a drafter, one round at a time. Names load on first use, so that
the engine's light parts (stop strings, context checks) are read without loading a model's code."""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(__name__, submod_attrs={
    "generate": ["GenerationResult", "generate"],
    "options": ["GenerationOptions"],
    "session": ["GenerationSession"],
    "target": ["TargetSession"],
})
