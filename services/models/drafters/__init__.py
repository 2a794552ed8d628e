"""Interchangeable drafters: one interface, per-session state, shared weights. Names load on first use."""

import lazy_loader

__getattr__, __dir__, __all__ = lazy_loader.attach(__name__, submod_attrs={
    "base": ["DraftProposal", "Drafter"],
    "factory": ["DraftSource", "load_draft_source"],
    "model": ["ModelDrafter", "SelfDrafter"],
    "ngram": ["NgramDrafter"],
})
