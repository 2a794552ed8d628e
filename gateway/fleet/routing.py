"""Per-request routing from the telemetry service's table: which verify pool, sd or plain target decoding."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from gateway.errors import APIError
from gateway.fleet.similarity import Similar
from gateway.state import GatewayState
from gateway.fleet.workers import live_workers
from services.config import TelemetrySettings
from services.protocol import ROUTING_TABLE_KEY, RoutingTable

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class Route:
    pool: str  # verify pool
    route: str  # "sd" | "ar"
    max_draft_tokens: int | None  # shorter blocks on a degraded pool
    table_version: int


def smooth_weighted_pick(weights: dict[str, float], current: dict[str, float]) -> str:
    """Smooth weighted round-robin (nginx): deterministic, and every window of requests
    follows the weights closely. `current` carries the state between calls."""
    total = sum(weights.values())
    for pool, weight in weights.items():
        current[pool] = current.get(pool, 0.0) + weight
    for stale in [pool for pool in current if pool not in weights]:
        del current[stale]
    chosen = max(sorted(weights), key=lambda pool: current[pool])
    current[chosen] -= total
    return chosen


def choose_route(table: RoutingTable | None, *, default_pool: str, num_prompt_tokens: int, priority: str,
                 config: TelemetrySettings, wrr_state: dict[str, float]) -> Route:
    if table is None or not table.pool_weights or sum(table.pool_weights.values()) <= 0:
        return Route(default_pool, "sd", None, table.version if table else 0)
    pool = None
    if config.short_prompt_pool and num_prompt_tokens < config.short_prompt_tokens \
            and table.pool_weights.get(config.short_prompt_pool, 0) > 0:
        pool = config.short_prompt_pool
    if pool is None:
        pool = smooth_weighted_pick({p: w for p, w in table.pool_weights.items() if w > 0}, wrr_state)
    degraded = pool in table.degraded_pools
    if degraded and priority == "low":
        raise APIError(503, f"pool {pool!r} is over its latency budget; low-priority requests are shed",
                       headers={"Retry-After": "5"})
    return _route_in(table, pool)


def _route_in(table: RoutingTable, pool: str) -> Route:
    degraded = pool in table.degraded_pools
    return Route(pool, "ar" if pool in table.ar_pools else "sd", 2 if degraded else None, table.version)


def choose_affinity(route: Route, similar: list[Similar], *, table: RoutingTable | None,
                    verify_pools: dict[str, str]) -> tuple[Route, Similar | None]:
    """The most similar recent request whose verify worker may take this one: alive (verify_pools: live
    worker -> its pool), not hot, and in the chosen pool or another the table gives traffic and does not
    degrade. The route moves to that worker's pool; without one, the route stays as it was."""
    hot = set(table.hot_workers) if table is not None else set()
    for item in similar:
        pool = verify_pools.get(item.worker_id)
        if pool is None or item.worker_id in hot:
            continue
        if pool == route.pool:
            return route, item
        if table is not None and table.pool_weights.get(pool, 0) > 0 and pool not in table.degraded_pools:
            return _route_in(table, pool), item
    return route, None


async def affinity_route(state: GatewayState, route: Route, sketch, salt: str | None = None
                         ) -> tuple[Route, Similar | None]:
    """Cache affinity for a request whose prompt sketch is `sketch` (gateway/fleet/similarity.py)."""
    similar = state.similarity.most_similar(sketch, salt=salt) if state.similarity is not None else []
    if not similar:
        return route, None
    verify_pools = {beat.worker_id: beat.pool for beat in await live_workers(state) if beat.role == "verify"}
    return choose_affinity(route, similar, table=await current_table(state), verify_pools=verify_pools)


async def current_table(state: GatewayState) -> RoutingTable | None:
    return await state.routing_cache.get(lambda: _read_table(state))


async def _read_table(state: GatewayState) -> RoutingTable | None:
    raw = await state.redis.get(ROUTING_TABLE_KEY)
    return RoutingTable.decode(raw) if raw is not None else None


async def route_request(state: GatewayState, *, num_prompt_tokens: int, priority: str) -> Route:
    return choose_route(await current_table(state), default_pool=state.settings.worker.pool,
                        num_prompt_tokens=num_prompt_tokens, priority=priority,
                        config=state.settings.telemetry, wrr_state=state.wrr_state)
