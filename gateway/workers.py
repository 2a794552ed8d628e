"""Which workers are alive, from their heartbeats in Redis (cached briefly: the gateway asks per request)."""

from __future__ import annotations

import logging

from gateway.state import GatewayState
from services.protocol import HEARTBEAT_PATTERN, Heartbeat, ProtocolError

logger = logging.getLogger(__name__)



async def live_workers(state: GatewayState, *, fresh: bool = False) -> list[Heartbeat]:
    return await state.worker_cache.get(lambda: _read_heartbeats(state), fresh=fresh)


async def _read_heartbeats(state: GatewayState) -> list[Heartbeat]:
    keys = [key async for key in state.redis.scan_iter(match=HEARTBEAT_PATTERN, count=100)]
    beats = []
    for raw in await state.redis.mget(keys) if keys else []:
        if raw is None:
            continue
        try:
            beats.append(Heartbeat.decode(raw))
        except ProtocolError:
            logger.warning("ignoring a bad heartbeat")
    return beats


async def missing_roles(state: GatewayState, *, draft_pool: str, verify_pool: str) -> list[str]:
    """Roles with no live worker for this request: sent now, it would only wait."""
    beats = await live_workers(state)
    wanted = {"draft": draft_pool, "verify": verify_pool}
    return [f"{role} ({pool})" for role, pool in wanted.items()
            if not any(b.role == role and b.pool == pool for b in beats)]
