"""A stage progress bar for model loading and conversion (stderr; off for --json)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from tqdm import tqdm


class _Stages:
    def __init__(self, bar: tqdm | None) -> None:
        self._bar = bar
        self._started = False

    def stage(self, description: str) -> None:
        if self._bar is None:
            return
        if self._started:
            self._bar.update(1)
        self._started = True
        self._bar.set_description(description)


@contextlib.contextmanager
def loading_progress(*, enabled: bool, num_stages: int = 2) -> Iterator[_Stages]:
    bar = tqdm(total=num_stages, unit="step", leave=False) if enabled else None
    stages = _Stages(bar)
    try:
        yield stages
    finally:
        if bar is not None:
            bar.update(bar.total - bar.n)
            bar.close()
