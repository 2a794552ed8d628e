"""Stop strings: checked on the decoded tail as tokens are committed, cut from the final text."""

from __future__ import annotations

import logging
from collections.abc import Sequence

logger = logging.getLogger(__name__)

MAX_STOP_STRINGS = 16


class StopStrings:
    def __init__(self, tokenizer: object | None, stop: Sequence[str] = ()) -> None:
        stop = [stop] if isinstance(stop, str) else list(stop)
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
