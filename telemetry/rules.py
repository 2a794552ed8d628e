"""Heartbeats in, routing table and events out: the fallback rules as one pure function.

Rules (thresholds in `telemetry:` of the YAML config):
- live: a verify worker whose heartbeat is older than heartbeat_timeout_s is dropped;
- thermal: an accelerator above hot_temperature_c sends thermal_shift of its pool's
  share to fallback_pool, until it cools below cool_temperature_c (hysteresis);
- utilization: pools whose mean utilization differs by more than utilization_gap
  move rebalance_step of weight from the busier to the idler one;
- rejection: 1 - acceptance above rejection_alert raises an alert (event on entry);
- latency: p99 per-token latency of steps shared by two sessions or more above latency_p99_ms, and above
  latency_over_unloaded times the worker's own 1-token forward (its profile), marks the pool degraded: the load
  made it slow. A target whose every token takes longer than latency_p99_ms unloaded (a 1B model on a CPU:
  200-300 ms) is not degraded by that alone, nor a lone stream by its own slow steps (a long block rejected
  early, its draft behind a slow link, a pause of the box): capping their blocks would only make each token
  slower;
- acceptance: below acceptance_floor the pool's new sessions use plain target decoding.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field

from services.config import TelemetrySettings
from services.pools import ACCELERATORS
from services.protocol import Heartbeat, RoutingTable

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuleEvent:
    kind: str  # worker_dropped, worker_joined, thermal_on, thermal_off, rejection_alert, routing_changed, ...
    worker_id: str | None = None
    pool: str | None = None
    detail: dict = field(default_factory=dict)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _hot(beat: Heartbeat, was_hot: bool, config: TelemetrySettings) -> bool:
    if beat.device_kind not in ACCELERATORS or beat.temperature_c is None:
        return False
    limit = config.cool_temperature_c if was_hot else config.hot_temperature_c
    return beat.temperature_c > limit


def plain_capacity(profile: dict) -> float | None:
    """Tokens per second a verify worker decodes at its best measured batch: max over rows of
    rows x 1000 / (ms of a step of that many one-token rows); None without a profile."""
    rates = [1000.0 / profile["verify_ms_1"]] if profile.get("verify_ms_1") else []
    for key, ms in profile.items():
        if key.startswith("step_ms_") and key.endswith("x1") and ms:
            rates.append(int(key.removeprefix("step_ms_").removesuffix("x1")) * 1000.0 / ms)
    return max(rates) if rates else None


def base_weights(by_pool: dict[str, list[Heartbeat]]) -> dict[str, float]:
    """Share of new sessions per pool from measured capacity (tokens per second at the best measured batch,
    from each worker's start-up profile), else worker count."""
    capacity = {}
    for pool, beats in by_pool.items():
        capacity[pool] = sum(plain_capacity(b.profile) or 1.0 for b in beats)
    total = sum(capacity.values())
    return {pool: value / total for pool, value in capacity.items()} if total else {}


def _shift(weights: dict[str, float], source: str, target: str, amount: float) -> None:
    amount = min(amount, weights.get(source, 0.0))
    weights[source] = weights.get(source, 0.0) - amount
    weights[target] = weights.get(target, 0.0) + amount


def evaluate(beats: list[Heartbeat], previous: RoutingTable | None, config: TelemetrySettings,
             now: float) -> tuple[RoutingTable, list[RuleEvent]]:
    previous = previous or RoutingTable()
    events: list[RuleEvent] = []
    live = sorted((b for b in beats if b.role == "verify" and now - b.sent_at <= config.heartbeat_timeout_s),
                  key=lambda b: b.worker_id)
    by_pool: dict[str, list[Heartbeat]] = defaultdict(list)
    for beat in live:
        by_pool[beat.pool].append(beat)
    workers = [b.worker_id for b in live]
    events += [RuleEvent("worker_dropped", w) for w in previous.workers if w not in workers]
    events += [RuleEvent("worker_joined", w) for w in workers if w not in previous.workers]

    weights = base_weights(by_pool)
    hot = [b.worker_id for b in live if _hot(b, b.worker_id in previous.hot_workers, config)]
    events += [RuleEvent("thermal_on", w) for w in hot if w not in previous.hot_workers]
    events += [RuleEvent("thermal_off", w) for w in previous.hot_workers if w not in hot and w in workers]
    if config.fallback_pool in weights:
        for pool, members in by_pool.items():
            hot_share = sum(1 for b in members if b.worker_id in hot) / len(members)
            if pool != config.fallback_pool and hot_share:
                _shift(weights, pool, config.fallback_pool, weights[pool] * hot_share * config.thermal_shift)

    utilization = {pool: _mean([b.utilization for b in members]) for pool, members in by_pool.items()}
    if len(utilization) >= 2:
        busiest = max(utilization, key=utilization.get)
        idlest = min(utilization, key=utilization.get)
        if utilization[busiest] - utilization[idlest] > config.utilization_gap:
            _shift(weights, busiest, idlest, config.rebalance_step)

    alerts, ar_pools, degraded = [], [], []
    for pool, members in sorted(by_pool.items()):
        drafted = sum(b.num_draft_tokens for b in members)
        accepted = sum(b.num_accepted_tokens for b in members)
        if drafted >= config.min_drafted_for_acceptance:
            if accepted / drafted < config.acceptance_floor:
                ar_pools.append(pool)
            alerts += [b.worker_id for b in members if b.num_draft_tokens >= config.min_drafted_for_acceptance
                       and 1 - b.num_accepted_tokens / b.num_draft_tokens > config.rejection_alert]
        if any(_over_latency_budget(b, config) for b in members):
            degraded.append(pool)
    events += [RuleEvent("rejection_alert", w) for w in alerts if w not in previous.alerts]

    table = RoutingTable(
        version=previous.version,
        pool_weights={pool: round(weight, 6) for pool, weight in sorted(weights.items())},
        ar_pools=ar_pools, degraded_pools=degraded, hot_workers=hot, workers=workers, alerts=sorted(alerts),
        updated_at=now,
    )
    if _content(table) != _content(previous):
        table.version = previous.version + 1
        events.append(RuleEvent("routing_changed", detail={"version": table.version,
                                                            "pool_weights": table.pool_weights}))
    return table, events


def _over_latency_budget(beat: Heartbeat, config: TelemetrySettings) -> bool:
    """p99 per-token latency of shared steps over the budget, and over what the worker's own unloaded forward
    allows."""
    p99 = beat.latency_p99_shared_ms or 0.0
    unloaded = beat.profile.get("verify_ms_1") or 0.0
    return p99 > max(config.latency_p99_ms, config.latency_over_unloaded * unloaded)


def _content(table: RoutingTable) -> tuple:
    return (table.pool_weights, table.ar_pools, table.degraded_pools, table.hot_workers, table.workers, table.alerts)
