"""Bearer API keys, stored hashed, each with a priority tier."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from fastapi import Request

from gateway.errors import APIError
from gateway.state import GatewayState
from services.storage import crud

logger = logging.getLogger(__name__)

KEY_CACHE_S = 30.0


@dataclass(frozen=True)
class Caller:
    api_key_id: int | None
    priority: str  # "high" | "normal" | "low"


def _lookup(state: GatewayState, key: str) -> tuple[int, str] | None:
    with state.db() as session:
        row = crud.get_api_key(session=session, key=key)
        return (row.id, row.priority) if row is not None else None


async def authenticate(request: Request) -> Caller:
    state: GatewayState = request.app.state.gateway
    if state.settings.gateway.auth_disabled:
        return Caller(None, "normal")
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
    key = key.strip()
    digest = crud.hash_api_key(key)
    cached = state.key_cache.get(digest)
    if cached is not None and cached[0] > time.monotonic():
        return Caller(cached[1], cached[2])
    found = await asyncio.to_thread(_lookup, state, key)
    if found is None:
        raise APIError(401, "invalid API key", code="invalid_api_key")
    state.key_cache[digest] = (time.monotonic() + KEY_CACHE_S, *found)
    return Caller(*found)
