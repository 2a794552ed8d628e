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


def bearer_key(header: str) -> str | None:
    scheme, _, key = header.partition(" ")
    return key.strip() if scheme.lower() == "bearer" and key.strip() else None


def known_caller(state: GatewayState, header: str) -> Caller | None:
    """The caller, from settings or the key cache alone (no SQL); None when that does not tell."""
    if state.settings.gateway.auth_disabled:
        return Caller(None, "normal")
    key = bearer_key(header)
    cached = state.key_cache.get(crud.hash_api_key(key)) if key else None
    if cached is not None and cached[0] > time.monotonic():
        return Caller(cached[1], cached[2])
    return None


async def authenticate(request: Request) -> Caller:
    state: GatewayState = request.app.state.gateway
    header = request.headers.get("authorization", "")
    caller = known_caller(state, header)
    if caller is not None:
        return caller
    key = bearer_key(header)
    if key is None:
        raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
    digest = crud.hash_api_key(key)
    found = await asyncio.to_thread(_lookup, state, key)
    if found is None:
        raise APIError(401, "invalid API key", code="invalid_api_key")
    state.key_cache[digest] = (time.monotonic() + KEY_CACHE_S, *found)
    return Caller(*found)
