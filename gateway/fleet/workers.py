"""Which workers are alive, from their heartbeats in Redis (cached briefly: the gateway asks per request)."""

from __future__ import annotations

from gateway.state import GatewayState
from services.protocol import Heartbeat
from services.redis_client import read_heartbeats_async


async def live_workers(state: GatewayState, *, fresh: bool = False) -> list[Heartbeat]:
    return await state.worker_cache.get(lambda: read_heartbeats_async(state.redis), fresh=fresh)


def opens_sessions(beats: list[Heartbeat], *, draft_pool: str, route: str, num_prompt_tokens: int) -> bool:
    """Whether a remote session's round 0 is target-only wherever it lands, so the gateway may send it itself
    (SessionSpec.opened): on the plain route, or when every live draft worker of the pool opens plain at this
    prompt length (a model draft, which prefills the prompt meanwhile)."""
    if route == "ar":
        return True
    drafts = [b for b in beats if b.role == "draft" and b.pool == draft_pool]
    return bool(drafts) and all(0 < b.plain_opening_tokens <= num_prompt_tokens for b in drafts)


def drafts_locally(beats: list[Heartbeat], pool: str) -> bool:
    """Whether the pool's verify workers draft for their own sessions (placement local): all live ones do. A
    pool of remote-placement workers (or a mix, while a fleet changes over) waits for draft workers."""
    verify = [b for b in beats if b.role == "verify" and b.pool == pool]
    return bool(verify) and all(b.local_draft for b in verify)


async def missing_roles(state: GatewayState, *, draft_pool: str, verify_pool: str) -> list[str]:
    """Roles with no live worker for this request: sent now, it would only wait. A pool that drafts locally
    needs no draft worker."""
    beats = await live_workers(state)
    wanted = {"verify": verify_pool} if drafts_locally(beats, verify_pool) else {"draft": draft_pool,
                                                                                 "verify": verify_pool}
    return [f"{role} ({pool})" for role, pool in wanted.items()
            if not any(b.role == role and b.pool == pool for b in beats)]
