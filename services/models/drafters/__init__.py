"""Interchangeable drafters: one interface, per-session state, shared weights."""

from services.models.drafters.base import DraftProposal, Drafter
from services.models.drafters.factory import DraftSource, load_draft_source
from services.models.drafters.model import ModelDrafter, SelfDrafter
from services.models.drafters.ngram import NgramDrafter

__all__ = ["DraftProposal", "DraftSource", "Drafter", "ModelDrafter", "NgramDrafter", "SelfDrafter", "load_draft_source"]
