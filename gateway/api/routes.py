"""HTTP endpoints: models, request status and cancellation, health, version, metrics.

Generation (/v1/completions, /v1/chat/completions) is in gateway/api/generation.py; the fleet views
(/v1/telemetry, /v1/dashboard, the /dashboard page) are in gateway/api/dashboard.py."""

from __future__ import annotations

import asyncio
import logging

import redis
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.admission.auth import Caller, authenticate
from gateway.errors import APIError
from gateway.sessions.ending import cancel_answer
from gateway.fleet.routing import current_table
from gateway.state import GatewayState
from gateway.fleet.workers import drafts_locally, live_workers
from services import __version__
from services.logs import bind_request
from services.protocol import CHILDREN_KEY
from services.redis_client import decode_children
from services.speculative.stats import SpecDecodingStats
from services.storage import crud

logger = logging.getLogger(__name__)

router = APIRouter()


def _state(request: Request) -> GatewayState:
    return request.app.state.gateway


@router.get("/v1/models")
async def list_models(request: Request, caller: Caller = Depends(authenticate)) -> dict:
    model = _state(request).model
    entry = {"id": model.name, "object": "model", "created": model.created, "owned_by": "mirror-sd",
             "max_model_len": model.max_context}
    return {"object": "list", "data": [{**entry, **({"mirror_sd_synthetic": model.synthetic} if model.synthetic
                                                    else {})}]}


def _request_view(row) -> dict:
    def iso(value):
        return value.isoformat() if value else None

    stats = SpecDecodingStats.from_row_counters(row)
    return {
        "id": row.id, "object": "request", "status": row.status, "model": row.model, "endpoint": row.endpoint,
        "priority": row.priority, "route": row.route, "pool": row.pool, "prompt_tokens": row.prompt_tokens,
        "completion_tokens": row.completion_tokens, "finish_reason": row.finish_reason, "params": row.params,
        "queued_at": iso(row.queued_at), "started_at": iso(row.started_at),
        "first_token_at": iso(row.first_token_at), "finished_at": iso(row.finished_at), "error": row.error,
        "mirror_sd": {
            **stats.row_counters(),
            "acceptance_rate": stats.acceptance_rate, "mean_acceptance_length": stats.mean_acceptance_length,
            "transport_ms_p50": row.transport_ms_p50,
            "plain_reason": row.plain_reason,
            "recorded_by": row.recorded_by,
        },
    }


async def _owned_request(request: Request, caller: Caller, request_id: str):
    bind_request(request_id)
    state = _state(request)

    def load():
        with state.db() as session:
            return crud.get_request(session=session, request_id=request_id)

    row = await asyncio.to_thread(load)
    if row is None or (caller.api_key_id is not None and row.api_key_id != caller.api_key_id):
        raise APIError(404, f"request {request_id!r} not found", code="request_not_found")
    return row


@router.get("/v1/requests/{request_id}")
async def get_request(request_id: str, request: Request, caller: Caller = Depends(authenticate)) -> dict:
    return _request_view(await _owned_request(request, caller, request_id))


@router.delete("/v1/requests/{request_id}")
async def delete_request(request_id: str, request: Request, caller: Caller = Depends(authenticate)) -> dict:
    row = await _owned_request(request, caller, request_id)
    if row.status in ("finished", "failed", "cancelled"):
        return {"id": request_id, "object": "request", "cancelled": False, "status": row.status}
    await cancel_answer(_state(request), request_id, row.params or {})
    return {"id": request_id, "object": "request", "cancelled": True, "status": "cancelling"}


@router.get("/healthz")
async def healthz() -> dict:
    """Alive (the process answers), whatever the fleet behind it."""
    return {"status": "ok"}


async def readiness(state: GatewayState) -> dict:
    """Whether this gateway can serve now, and what it rests on: Redis, live draft and verify workers; draft
    workers serving with a fallback draft, and children of `mirror-sd up` that failed, named."""
    if state.draining:  # SIGTERM: load balancers stop sending here while in-flight streams finish
        return {"ready": False, "draining": True, "inflight": state.inflight}
    checks: dict = {"redis": False, "draft_workers": 0, "verify_workers": 0, "model": state.model.name}
    if state.shared:  # which of several gateways answered, and how many share the limits
        checks.update(gateway=state.gateway_id, gateways=state.admission.live_gateways)
    try:
        checks["redis"] = bool(await state.redis.ping())
        beats = await live_workers(state, fresh=True)
        checks["draft_workers"] = sum(1 for b in beats if b.role == "draft")
        checks["verify_workers"] = sum(1 for b in beats if b.role == "verify")
        checks["local_drafting"] = drafts_locally(beats, state.settings.worker.pool)
        checks["draft_fallbacks"] = [{"worker": b.worker_id, **b.draft_fallback.to_wire()}
                                     for b in beats if b.draft_fallback is not None]
        children = decode_children(await state.redis.hgetall(CHILDREN_KEY))
        checks["failed_children"] = [{"name": c.name, "last_exit": c.last_exit, "detail": c.detail}
                                     for c in children if c.state == "failed"]
    except Exception as exc:  # readiness reports, it does not crash
        checks["error"] = f"{type(exc).__name__}: {exc}"
    # drafted for by draft workers, or by the verify workers themselves (placement local)
    drafting = checks["draft_workers"] >= 1 or (checks["verify_workers"] >= 1 and checks.get("local_drafting"))
    return {"ready": bool(checks["redis"] and drafting and checks["verify_workers"] >= 1), **checks}


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    body = await readiness(_state(request))
    return JSONResponse(body, status_code=200 if body["ready"] else 503)


@router.get("/health")
async def health(request: Request) -> Response:
    """vLLM's, SGLang's, TGI's and llama.cpp server's probe (load-test clients such as guidellm call it first):
    200 while this gateway can serve a request, else 503 with the reason."""
    body = await readiness(_state(request))
    if body["ready"]:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "unavailable", **body}, status_code=503)


@router.get("/version")
async def version() -> dict:
    return {"version": __version__}


def set_gauges(state: GatewayState) -> None:
    state.metrics.inflight.set(state.inflight)
    state.metrics.queued.set(state.admission.queued)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = _state(request)
    set_gauges(state)
    try:  # the fleet's part comes from Redis; without it the gateway's own figures are still served
        state.metrics.fleet.beats = await live_workers(state, fresh=True)
        state.metrics.fleet.table = await current_table(state)
        state.metrics.fleet.children = decode_children(await state.redis.hgetall(CHILDREN_KEY))
    except redis.RedisError as exc:
        logger.warning("/metrics without the fleet's figures: %s", exc)
    return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
