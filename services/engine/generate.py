"""Run a whole request in-process and time it (the CLI and the benchmark's `ar`/`sd` modes)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from services.engine.options import GenerationOptions
from services.engine.session import GenerationSession
from services.models.drafters.factory import DraftSource
from services.models.loading import LoadedModel
from services.speculative.processing import TokenLogprobs
from services.speculative.stats import SpecDecodingStats

logger = logging.getLogger(__name__)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str
    stats: SpecDecodingStats
    draft: str  # "none" for target-only decoding
    ttft_s: float  # prefill + first round
    total_s: float
    draft_s: float = 0.0  # time spent drafting
    verify_s: float = 0.0  # time spent in target forwards
    logprobs: TokenLogprobs | None = None  # of token_ids, when the sampling params ask for them

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        """generated tokens / wall time of the whole request, prefill included."""
        return self.num_tokens / self.total_s if self.total_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.num_tokens,
            "finish_reason": self.finish_reason,
            "draft": self.draft,
            "ttft_s": self.ttft_s,
            "total_s": self.total_s,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "tokens_per_s": self.tokens_per_s,
            "stats": self.stats.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "GenerationResult":
        """Inverse of to_dict (a bench journal line back into a result)."""
        return cls(text=data["text"], token_ids=list(data["token_ids"]), prompt_tokens=data["prompt_tokens"],
                   finish_reason=data["finish_reason"], stats=SpecDecodingStats.from_dict(data["stats"]),
                   draft=data["draft"], ttft_s=data["ttft_s"], total_s=data["total_s"],
                   draft_s=data.get("draft_s", 0.0), verify_s=data.get("verify_s", 0.0))


def generate(
    target: LoadedModel,
    draft_source: DraftSource,
    prompt_ids: Sequence[int],
    options: GenerationOptions | None = None,
) -> GenerationResult:
    started = time.perf_counter()
    session = GenerationSession(target, draft_source.new_drafter(), prompt_ids, options)
    ttft_s = 0.0
    try:
        while not session.finished:
            session.step()
            if not ttft_s:
                ttft_s = time.perf_counter() - started
    finally:
        session.release()
    return GenerationResult(
        text=session.text(),
        token_ids=list(session.output_ids),
        prompt_tokens=len(session.prompt_ids),
        finish_reason=session.finish_reason or "length",
        stats=session.stats,
        draft=draft_source.spec,
        ttft_s=ttft_s,
        total_s=time.perf_counter() - started,
        draft_s=session.draft_s,
        verify_s=session.verify_s,
        logprobs=session.logprobs if session.sampling.logprobs is not None else None,
    )
