"""The remote draft's last word on the load: whether a session waiting for its next block keeps the draft busy.

On one box the verify worker takes the draft worker's core for a step (worker.wide_threads) only while no
draft drafts for any session it holds (verify_worker/worker.py, _set_threads). A session waiting after
target-only rounds (its opening, or rounds the load asked for) is the uncertain case: its draft decides now,
from the load, whether the next block carries draft tokens (it prefills and drafts: busy) or is more
target-only rounds (nothing to compute: idle).

The draft's decisions come back in the blocks this worker takes. Target-only rounds after round 0 say the
draft found drafting not worth it at the load of the moment (or at the acceptance it had: a session fallen
back); a block with draft tokens says it drafts. So while the last word was target-only rounds and this
worker holds at least as many speculative sessions as it did then, a waiting session's draft is taken to go
target-only too, and the step may run wide. Less load than then, or a drafted block since: the wait keeps the
draft busy, as before.

Wrong either way costs little and ends at the next block: a step narrower than it could have been, or a wide
step beside a draft that drafts after all (the draft's first drafted block says so).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.protocol import DraftBlock


@dataclass
class DraftWord:
    plain_at: int | None = None  # speculative sessions held when the draft last sent target-only rounds; None: it drafts

    def heard(self, block: DraftBlock, sessions: int) -> None:
        """A block from a remote draft, taken while this worker held `sessions` speculative sessions. Round 0
        (an opening: target-only by design, whatever the load) says nothing."""
        if block.round == 0 or block.release:
            return
        self.plain_at = None if block.draft_ids else sessions

    def goes_plain(self, sessions: int) -> bool:
        """A waiting session's draft, with `sessions` speculative sessions held, sends target-only rounds next."""
        return self.plain_at is not None and sessions >= self.plain_at
