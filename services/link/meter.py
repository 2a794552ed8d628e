"""What a draft worker measures of its link to Redis, on its own clock, and reports in its heartbeat.

- Redis RTT: a PING from the heartbeat thread each beat, smoothed.
- Round trip: a block sent (just before the pipeline that pushes it) ->
  its verdict taken by the driver, both on the draft worker's
  `perf_counter`.
- Transport: round trip - verify - held, where verify is the verify
  worker's own time for the block (taking it -> its verdict, a duration on
  its clock, so no skew between two hosts' clocks enters) and held is the
  time the verdict waited in the process for the driver (from its arrival,
  stamped by the inbox listener's blocking pop: draft_worker/inbox.py, to
  the driver's turn that took it). So transport is the two ways over the
  link plus the queueing in Redis and in the verify worker before it took
  the block.

Earlier, transport subtracted the time "the verdict sat unread while
speculating" as the speculation's end minus the verify worker's wall clock
at its verdict, but that end was read when the verdict was applied, after
it was popped: the subtraction took the whole way back with it, and under
a delayed link the figure read 0.000 ms.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from dataclasses import dataclass, field

from services.protocol import LinkFigures
from services.speculative.stats import percentile

logger = logging.getLogger(__name__)

WINDOW_ROUNDS = 256
# What a draft worker's round trips to Redis for its sessions are for (LinkFigures.round_trips_by_kind): the driver's
TRIP_BLOCKS = "blocks"  # a pipeline of blocks, and the reads riding with them (draft_worker/outbox.py)
TRIP_LOOK = "look"  # the control look at cancellations alone: no block went for LOOK_ALONE_AFTER_S
TRIP_LIVENESS = "liveness"  # suspect verify workers' heartbeats (the pool's queue for untaken blocks), alone
TRIP_RESEND = "resend"  # a block unanswered by a live worker: its queue looked at, then the block sent again
TRIP_FAILOVER = "failover"  # a block sent to the pool again, its worker gone
TRIP_CATCH_UP = "catch_up"  # the streams of sessions bridged while their drafts prefilled
TRIP_CLOSE = "close"  # a cancelled or failed session's stream closed
TRIP_RECOVERY = "recovery"  # every block in flight sent again after Redis was away
# and a session's task thread's (draft_worker/runtime.py): one each at its start and end when nothing goes wrong
TRIP_OPEN = "open"  # the spec, the lease and the output so far in one script (again while another holds the lease)
TRIP_LEASE = "lease"  # the lease renewed, every LEASE_TTL_S / 4
TRIP_FINISH = "finish"  # the lease given back and the figures for the bench
TRIP_KINDS = (TRIP_BLOCKS, TRIP_LOOK, TRIP_LIVENESS, TRIP_RESEND, TRIP_FAILOVER, TRIP_CATCH_UP, TRIP_CLOSE,
              TRIP_RECOVERY, TRIP_OPEN, TRIP_LEASE, TRIP_FINISH)
PING_WEIGHT = 0.3  # the newest PING's weight in the smoothed RTT


def transport_ms(round_trip_s: float, verify_s: float, held_s: float) -> float:
    """One round's transport in ms: round trip - the verify worker's time - the driver's time elsewhere."""
    return 1000.0 * max(0.0, round_trip_s - max(0.0, verify_s) - max(0.0, held_s))


def per_verdict(verdicts: int, counts: dict[str, int]) -> tuple[float | None, dict[str, float]]:
    """Round trips a verdict applied: in all (None: no verdict) and by kind, to 3 decimals."""
    if not verdicts:
        return None, {}
    return (round(sum(counts.values()) / verdicts, 3),
            {kind: round(count / verdicts, 3) for kind, count in sorted(counts.items()) if count > 0})


def smoothed(previous: float | None, sample: float, weight: float = PING_WEIGHT) -> float:
    """Exponential smoothing: the first sample as is, then weight x new + (1 - weight) x old."""
    return sample if previous is None else weight * sample + (1.0 - weight) * previous


@dataclass(frozen=True)
class RoundTrip:
    """One drafted block's trip, in ms (see the module docstring)."""

    round_trip_ms: float
    transport_ms: float
    verify_ms: float


@dataclass
class LinkMeter:
    """Fed by two threads (the heartbeat's PINGs, the driver's rounds), read by the heartbeat."""

    window: int = WINDOW_ROUNDS
    redis_rtt_ms: float | None = None
    rounds: int = 0
    chained_rounds: int = 0  # of those, verified ahead (services/speculative/chaining.py)
    verdicts: int = 0  # every verdict the driver applied (its rounds, measured or not): round trips count per verdict
    resent_blocks: int = 0  # counted by the driver too: blocks sent again to a live worker that had not answered
    failed_over_blocks: int = 0  # and blocks sent to the pool again because the worker holding them died
    _trips: deque = field(init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    # the round trips to Redis by what they were for (TRIP_*), counted by the driver, its outbox and task threads
    _round_trips: Counter = field(default_factory=Counter, init=False)

    def __post_init__(self) -> None:
        self._trips = deque(maxlen=self.window)

    def count_round_trip(self, kind: str) -> None:
        with self._lock:
            self._round_trips[kind] += 1

    def observe_verdict(self) -> None:
        with self._lock:
            self.verdicts += 1

    @property
    def driver_round_trips(self) -> int:
        with self._lock:
            return sum(self._round_trips.values())

    def observe_ping(self, rtt_ms: float) -> None:
        with self._lock:
            self.redis_rtt_ms = smoothed(self.redis_rtt_ms, rtt_ms)

    def observe_round(self, trip: RoundTrip | None, chained: bool = False) -> None:
        """A verified round: its block's trip, or none for a block verified ahead of the verdict before it
        (it made no trip over the link of its own)."""
        with self._lock:
            if trip is not None:
                self._trips.append(trip)
            self.rounds += 1
            self.chained_rounds += chained

    def figures(self, blocks_ahead: int | None = None) -> LinkFigures:
        """blocks_ahead: the depth the driver keeps now (services/speculative/chaining.py)."""
        with self._lock:
            trips = list(self._trips)
            rtt, rounds, chained = self.redis_rtt_ms, self.rounds, self.chained_rounds
            verdicts, by_kind = self.verdicts, dict(self._round_trips)

        def pct(values: list[float], q: float) -> float | None:
            value = percentile(values, q)
            return None if value is None else round(value, 3)

        round_trips = [trip.round_trip_ms for trip in trips]
        per_round, shares = per_verdict(verdicts, by_kind)
        transports = [trip.transport_ms for trip in trips]
        return LinkFigures(redis_rtt_ms=None if rtt is None else round(rtt, 3),
                           round_trip_ms_p50=pct(round_trips, 0.5), round_trip_ms_p99=pct(round_trips, 0.99),
                           transport_ms_p50=pct(transports, 0.5), transport_ms_p99=pct(transports, 0.99),
                           verify_ms_p50=pct([trip.verify_ms for trip in trips], 0.5), rounds=rounds,
                           window=len(trips),
                           round_trips_per_round=per_round, round_trips_by_kind=shares,
                           verdicts=verdicts, round_trip_counts=dict(sorted(by_kind.items())),
                           blocks_ahead=blocks_ahead, verified_ahead=round(chained / rounds, 3) if rounds else None,
                           resent_blocks=self.resent_blocks, failed_over_blocks=self.failed_over_blocks)
