"""`mirror-sd bench --draft-link 0,20,50`: the same bench once per link level, side by side.

The stack's draft workers must sit behind a draft link (`mirror-sd up
--draft-link 0`, or `mirror-sd link` with draft workers pointed at it); the
bench sets the link to each level in turn through Redis (services/link/
control.py), runs into `<out>/link-<level>/`, and reads what the draft
workers measured meanwhile: the transport and round trip of every round of
that level's sessions, their Redis RTT, and their Redis round trips per
verdict (the differences of their heartbeats' counts over the level). The
link goes back to what it was at the end. `links.md` and `links.json` hold
the levels side by side.
With `--link-turns N` the levels are taken in turn N times, so the box's
drift falls on all of them alike (services/bench/turns.py).
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from services.bench.stack_client import new_samples, sample_list
from services.bench.turns import median_headline, rate_keys, turn_ratios, turns_markdown
from services.link.control import read_link, set_link, wait_link
from services.link.meter import per_verdict
from services.link.spec import LinkSpec
from services.protocol import DRAFT_LINK, ROUND_TRIP_SAMPLES_KEY, TRANSPORT_SAMPLES_KEY, LinkFigures
from services.redis_client import read_heartbeats
from services.redis_conn import connect
from services.speculative.stats import percentile

logger = logging.getLogger(__name__)

SETTLE_TIMEOUT_S = 15.0
SAMPLE_KEYS = (TRANSPORT_SAMPLES_KEY, ROUND_TRIP_SAMPLES_KEY)  # what the draft workers measured, per round


@dataclass
class LinkLevel:
    link: str  # as written: 20, 20:5
    headline: dict  # the bench's own figures for the level (tok/s, speedup, ...)
    rounds: int = 0
    transport_ms_p50: float | None = None
    transport_ms_p99: float | None = None
    round_trip_ms_p50: float | None = None
    round_trip_ms_p99: float | None = None
    redis_rtt_ms: float | None = None  # the draft workers' smoothed PING at the level's end, averaged
    # the draft workers' Redis round trips for their sessions per verdict applied during the level, in all and by
    # kind (services/link/meter.py), over all its turns
    round_trips_per_verdict: float | None = None
    round_trips_by_kind: dict = field(default_factory=dict)
    out: str = ""
    extra: dict = field(default_factory=dict)


def find_draft_link(redis_url: str) -> LinkSpec:
    """The running draft link's setting; RuntimeError naming what to do when there is none."""
    import redis

    try:
        status = read_link(connect(redis_url), DRAFT_LINK)
    except redis.RedisError as exc:
        raise RuntimeError(f"--draft-link: cannot read the stack's Redis at {redis_url} ({exc}); name it with "
                           "--redis-url") from None
    if status is None:
        raise RuntimeError(f"--draft-link: no draft link runs on the stack whose Redis is {redis_url}: start the "
                           "stack with `mirror-sd up --draft-link 0` (or run `mirror-sd link` and point the draft "
                           "workers at it), or name its Redis with --redis-url")
    return LinkSpec(status.rtt_ms, status.jitter_ms)


def run_link_levels(levels: list[LinkSpec], *, redis_url: str, out_dir: Path, run_level: Callable[[Path], dict],
                    progress=print, turns: int = 1) -> tuple[list[LinkLevel], list[Path]]:
    """run_level(folder) runs the bench once into folder and returns its headline figures. turns > 1: the
    levels taken in turn that many times (0, 20, 0, 20, ...; services/bench/turns.py), each turn into
    link-<level>/turn-<n>/; a level's figures are the median of its turns, its samples those of all its turns."""
    client = connect(redis_url)
    original = find_draft_link(redis_url)
    headlines: dict[LinkSpec, list[dict]] = {level: [] for level in levels}
    samples: dict[LinkSpec, tuple[list[float], list[float]]] = {level: ([], []) for level in levels}
    rtts: dict[LinkSpec, float | None] = {}
    verdicts: dict[LinkSpec, int] = {level: 0 for level in levels}
    trips: dict[LinkSpec, Counter] = {level: Counter() for level in levels}
    try:
        for turn in range(turns):
            for level in levels:
                set_link(client, DRAFT_LINK, level, set_by="bench")
                wait_link(client, DRAFT_LINK, level)
                progress(f"draft link {level.label()} ({level.describe()})"
                         + (f", turn {turn + 1} of {turns}" if turns > 1 else ""))
                folder = _folder(out_dir, level)
                before = {key: len(sample_list(client, key)) for key in SAMPLE_KEYS}
                links_before = _draft_links(client)
                headlines[level].append(run_level(folder / f"turn-{turn + 1}" if turns > 1 else folder))
                _settle(client, level)
                applied, counted = trips_between(links_before, _draft_links(client))
                verdicts[level] += applied
                trips[level].update(counted)
                for pooled, key in zip(samples[level], SAMPLE_KEYS):
                    pooled.extend(new_samples(before[key], sample_list(client, key)))
                rtts[level] = _draft_rtt_ms(client)
    finally:
        _put_back(client, original)
    rows = []
    for level in levels:
        transport, round_trip = samples[level]
        extra = {}
        if turns > 1:
            first = headlines[levels[0]]
            extra = {"turns": headlines[level], "ratios": {
                key: turn_ratios(first, headlines[level], key) for key in rate_keys([first, headlines[level]])}}
        per_round, by_kind = per_verdict(verdicts[level], trips[level])
        rows.append(LinkLevel(link=level.label(), headline=median_headline(headlines[level]), rounds=len(transport),
                              transport_ms_p50=percentile(transport, 0.5),
                              transport_ms_p99=percentile(transport, 0.99),
                              round_trip_ms_p50=percentile(round_trip, 0.5),
                              round_trip_ms_p99=percentile(round_trip, 0.99),
                              redis_rtt_ms=rtts.get(level), round_trips_per_verdict=per_round,
                              round_trips_by_kind=by_kind, out=str(_folder(out_dir, level)), extra=extra))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "links.json").write_text(json.dumps({"turns": turns, "levels": [asdict(row) for row in rows]},
                                                   indent=1))
    table = links_markdown(rows, turns)
    if turns > 1:
        table += turns_markdown([level.label() for level in levels], [headlines[level] for level in levels])
    (out_dir / "links.md").write_text(table)
    return rows, [out_dir / "links.json", out_dir / "links.md"]


def _folder(out_dir: Path, level: LinkSpec) -> Path:
    return out_dir / f"link-{level.label().replace(':', 'j')}"


def _put_back(client, original: LinkSpec) -> None:
    """The link as it was before the bench, once the link applies it (a bench right after runs at its setting);
    a link that does not say so in time is logged, not raised over what the bench found."""
    set_link(client, DRAFT_LINK, original, set_by="bench")
    try:
        wait_link(client, DRAFT_LINK, original)
    except RuntimeError as exc:
        logger.warning("draft link not put back: %s", exc)


def _settle(client, level: LinkSpec) -> None:
    """Until the draft workers drive no session (a level's last sessions record their samples when they end,
    a link's delay after the client got its answer), then two more one-way trips."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    since = time.time()
    while time.monotonic() < deadline:
        beats = [beat for beat in read_heartbeats(client) if beat.role == "draft"]
        if all(beat.sent_at > since and beat.num_sessions == 0 for beat in beats):  # none: nothing to wait for
            break
        time.sleep(0.2)
    time.sleep((level.rtt_ms + level.jitter_ms) / 1000 + 0.2)


def _draft_rtt_ms(client) -> float | None:
    values = [beat.link.redis_rtt_ms for beat in read_heartbeats(client)
              if beat.role == "draft" and beat.link is not None and beat.link.redis_rtt_ms is not None]
    return round(sum(values) / len(values), 3) if values else None


def _draft_links(client) -> dict[str, LinkFigures]:
    """Each draft worker's link figures, from its last heartbeat."""
    return {beat.worker_id: beat.link for beat in read_heartbeats(client)
            if beat.role == "draft" and beat.link is not None}


def trips_between(before: dict[str, LinkFigures], after: dict[str, LinkFigures]) -> tuple[int, Counter]:
    """The verdicts the draft workers applied and their Redis round trips by kind between two reads of their
    heartbeats (worker id -> figures): the differences of the counts they keep since start. A worker that was
    not there at the first read, or has restarted since (fewer verdicts), counts from zero."""
    verdicts, trips = 0, Counter()
    for worker, figures in after.items():
        base = before.get(worker)
        if base is None or figures.verdicts < base.verdicts:
            base = LinkFigures()
        verdicts += figures.verdicts - base.verdicts
        for kind, count in figures.round_trip_counts.items():
            if count > base.round_trip_counts.get(kind, 0):
                trips[kind] += count - base.round_trip_counts.get(kind, 0)
    return verdicts, trips


def links_markdown(rows: list[LinkLevel], turns: int = 1) -> str:
    keys = list(dict.fromkeys(key for row in rows for key in row.headline))

    def cell(value) -> str:
        return "–" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)

    lines = ["| draft link (RTT[:jitter] ms) | " + " | ".join(keys) + " | draft Redis RTT ms | round trip p50 / p99 "
             "ms | transport p50 / p99 ms | Redis round trips a verdict | rounds |", "|" + "---|" * (len(keys) + 6)]
    for row in rows:
        lines.append("| " + " | ".join([
            row.link, *(cell(row.headline.get(key)) for key in keys), cell(row.redis_rtt_ms),
            f"{cell(row.round_trip_ms_p50)} / {cell(row.round_trip_ms_p99)}",
            f"{cell(row.transport_ms_p50)} / {cell(row.transport_ms_p99)}", cell(row.round_trips_per_verdict),
            str(row.rounds)]) + " |")
    lines.append("\nround trip: block sent -> verdict seen, on the draft worker's clock; transport: round trip less "
                 "the verify worker's own time for the block and the draft driver's time on other work (a lower "
                 "bound); Redis round trips a verdict: the draft workers' round trips to Redis for their sessions "
                 "per verdict applied during the level (by what they were for in links.json). Each level's own "
                 "report is in its folder"
                 + (f" (one per turn; the figures above are the median of the {turns} turns)." if turns > 1 else "."))
    return "\n".join(lines) + "\n"
