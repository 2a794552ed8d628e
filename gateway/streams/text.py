"""A session's tokens as text: deltas that never split a character nor leak a stop string, and its
speculative-decoding stats as the API shows them."""

from __future__ import annotations

from services.engine.stopping import StopStrings
from services.protocol import OutputEvent
from services.speculative.stats import SpecDecodingStats


class IncrementalText:
    """Token ids -> text deltas that never split a character and never leak part of a stop string."""

    def __init__(self, tokenizer: object, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = StopStrings(tokenizer, stop)
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.sent = ""

    def text(self) -> str:
        """The whole text so far, stop strings cut."""
        return self.stop_strings.truncate(self.tokenizer.decode(self.token_ids, skip_special_tokens=True))

    def feed(self, token_ids: list[int]) -> str:
        self.token_ids.extend(token_ids)
        text = self.text()
        safe = text[: len(text) - self._holdback] if self._holdback else text
        safe = safe.rstrip("\ufffd")  # an incomplete multi-byte character
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent):], safe
        return delta

    def finish(self) -> str:
        text = self.text()
        delta = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sent = text
        return delta


def sd_stats(event: OutputEvent | None, request_id: str) -> dict:
    """Per-request speculative-decoding stats, vLLM-style counters plus the derived rates."""
    stats = event.stats if event else SpecDecodingStats()
    return {
        "request_id": request_id,
        "num_rounds": event.seq + 1 if event else 0,  # one output event per verified round
        "num_cached_tokens": event.num_cached_tokens if event else 0,  # prompt tokens reused, not prefilled
        "verify_worker": event.worker_id or None if event else None,  # where the request's KV is
        "num_drafts": stats.num_drafts,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "acceptance_rate": stats.acceptance_rate,
        "mean_acceptance_length": stats.mean_acceptance_length,
        "num_draft_tokens_per_pos": list(stats.num_draft_tokens_per_pos),
        "num_accepted_tokens_per_pos": list(stats.num_accepted_tokens_per_pos),
        # who drafted: suffix drafts (of them, from the tenant's history) and their tokens; the rest the model's
        "num_suffix_drafts": stats.num_suffix_drafts,
        "num_history_drafts": stats.num_history_drafts,
        "num_suffix_draft_tokens": stats.num_suffix_draft_tokens,
        "num_suffix_accepted_tokens": stats.num_suffix_accepted_tokens,
    }
