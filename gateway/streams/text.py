"""A session's tokens as text: deltas that never split a character nor leak a stop string, and its
speculative-decoding stats as the API shows them."""

from __future__ import annotations

from services.engine.stopping import StopStrings
from services.protocol import OutputEvent
from services.speculative.stats import SpecDecodingStats


class IncrementalText:
    """Token ids -> text deltas that never split a character and never leak part of a stop string.

    Each feed decodes only a window (the last tokens already settled, for their context, and the new ones), not
    the whole output: a token's text is the window's text past the part the settled tokens give, as vLLM's
    incremental detokenizer does. Where a tokenizer's decoding is not local (the window's text does not start with
    what its settled part decodes to, e.g. a clean-up that merges across the seam), the whole output is decoded
    once and the window starts again from there, so the text is always the whole output's decoding."""

    CONTEXT_TOKENS = 5  # settled tokens decoded again before the new ones: a token decodes as it does mid-text

    def __init__(self, tokenizer: object, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = StopStrings(tokenizer, stop)
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.sent = ""
        self._settled = ""  # the text of token_ids[:self._read]
        self._read = 0  # tokens whose text is settled (it ends on a whole character)
        self._context = 0  # the window's first token: CONTEXT_TOKENS before _read

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def text(self) -> str:
        """The whole text so far, stop strings cut."""
        return self.stop_strings.truncate(self._decode(self.token_ids))

    def _current(self) -> str:
        """The whole output's decoding (stop strings not cut): the settled text and the window's new part."""
        context = self.token_ids[self._context:self._read]
        before = self._decode(context) if context else ""
        window = self._decode(self.token_ids[self._context:])
        if window.startswith(before):
            fresh = window[len(before):]
            text = self._settled + fresh
            settle = bool(fresh)
        else:  # not local at this seam: the whole output, once
            text = self._decode(self.token_ids)
            settle = True
        if settle and not text.endswith("\ufffd"):  # ends on a whole character: settled
            self._settled, self._read = text, len(self.token_ids)
            self._context = max(0, self._read - self.CONTEXT_TOKENS)
        return text

    def feed(self, token_ids: list[int]) -> str:
        self.token_ids.extend(token_ids)
        text = self.stop_strings.truncate(self._current())
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
        # tokens a grammar forced (structured output): drafted for free, and of them accepted
        "num_forced_draft_tokens": stats.num_forced_draft_tokens,
        "num_forced_accepted_tokens": stats.num_forced_accepted_tokens,
    }
