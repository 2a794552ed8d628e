"""Stop strings: checked on the decoded tail as tokens are committed, cut from the final text."""

from __future__ import annotations

import logging
from collections.abc import Sequence

logger = logging.getLogger(__name__)

MAX_STOP_STRINGS = 16


class StopStrings:
    def __init__(self, tokenizer: object | None, stop: Sequence[str] | str | None = ()) -> None:
        stop = [stop] if isinstance(stop, str) else list(stop or ())
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        for value in stop:
            if not isinstance(value, str) or not value:
                raise ValueError(f"stop strings must be non-empty strings, got {value!r}")
        if stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none")
        self.tokenizer = tokenizer
        self.stop = stop
        # Every token decodes to at least one character (rare byte pieces aside),
        # so this many trailing tokens always cover a whole stop string.
        self._window = max((len(value) for value in stop), default=0) + 2

    def hit(self, output_ids: Sequence[int]) -> bool:
        if not self.stop:
            return False
        tail = self.tokenizer.decode(list(output_ids[-self._window :]), skip_special_tokens=True)
        return any(value in tail for value in self.stop)

    def truncate(self, text: str) -> str:
        cut = min((index for index in (text.find(value) for value in self.stop) if index >= 0), default=-1)
        return text if cut < 0 else text[:cut]


class OutputState:
    """The output so far and the rules that end it: EOS, stop strings, max_new_tokens.

    Shared by the in-process session and the verify worker, so a request
    stops at the same token wherever it runs.
    """

    def __init__(
        self,
        *,
        tokenizer: object | None,
        eos_token_ids: frozenset[int],
        max_new_tokens: int,
        stop: Sequence[str] = (),
        output_ids: Sequence[int] = (),
    ) -> None:
        self.stop_strings = StopStrings(tokenizer, stop)
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_new_tokens = max_new_tokens
        self.output_ids: list[int] = list(output_ids)
        self.finish_reason: str | None = None

    @classmethod
    def for_request(cls, target, *, max_new_tokens: int, stop: Sequence[str] = (), ignore_eos: bool = False,
                    output_ids: Sequence[int] = ()) -> "OutputState":
        """A request's rules on `target` (a LoadedModel): its tokenizer and EOS ids unless ignore_eos."""
        return cls(tokenizer=target.tokenizer, eos_token_ids=frozenset() if ignore_eos else target.eos_token_ids,
                   max_new_tokens=max_new_tokens, stop=stop, output_ids=output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.output_ids)

    def accept(self, committed: Sequence[int]) -> list[int]:
        """Add a round's committed tokens; return those that reach the output (stops cut the rest)."""
        assert not self.finished, "output already finished"
        emitted: list[int] = []
        for token_id in committed:
            if token_id in self.eos_token_ids:
                self.finish_reason = "stop"
                break
            self.output_ids.append(token_id)
            emitted.append(token_id)
            if self.stop_strings.hit(self.output_ids):
                self.finish_reason = "stop"
                break
            if len(self.output_ids) >= self.max_new_tokens:
                self.finish_reason = "length"
                break
        return emitted

    def text(self) -> str:
        if self.tokenizer is None:
            return ""
        return self.stop_strings.truncate(self.tokenizer.decode(self.output_ids, skip_special_tokens=True))
