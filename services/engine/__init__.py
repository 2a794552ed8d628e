"""The in-process engine: a target session, a drafter, one round at a time."""

from services.engine.generate import GenerationResult, generate
from services.engine.options import GenerationOptions
from services.engine.session import GenerationSession
from services.engine.target import TargetSession

__all__ = ["GenerationOptions", "GenerationResult", "GenerationSession", "TargetSession", "generate"]
