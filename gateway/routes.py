"""HTTP endpoints: OpenAI-compatible generation, request status and cancellation, health, metrics.

The fleet views (/v1/telemetry, /v1/dashboard, the /dashboard page) are in gateway/dashboard.py."""

from __future__ import annotations

import asyncio
import time

import anyio
import json
import logging
from collections.abc import AsyncIterator
from datetime import datetime, timezone

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette.sse import EventSourceResponse

from gateway import responses
from gateway.auth import Caller, authenticate
from gateway.errors import APIError, error_body
from gateway.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from gateway.state import GatewayState
from gateway.streaming import IncrementalText, RequestTimeout, read_output, sd_stats
from gateway.submit import Submitted, check_model, submit
from services.models.tokenization import encode_messages
from gateway.routing import current_table
from gateway.workers import live_workers
from services.logs import bind_request
from services.protocol import cancel_key
from services.redis_client import REQUEST_TTL_S
from services.storage import crud

logger = logging.getLogger(__name__)

router = APIRouter()


def _state(request: Request) -> GatewayState:
    return request.app.state.gateway


async def cancel_request(state: GatewayState, request_id: str) -> None:
    await state.redis.set(cancel_key(request_id), b"1", ex=REQUEST_TTL_S)

    def mark() -> None:
        with state.db() as session:
            row = crud.get_request(session=session, request_id=request_id)
            if row is not None and row.status == "queued":
                crud.update_request(session=session, request_id=request_id, status="cancelled",
                                    finish_reason="cancelled", finished_at=datetime.now(timezone.utc))

    await asyncio.to_thread(mark)


async def _generate(request: Request, params: SamplingFields, caller: Caller, *, chat: bool,
                    prompt_ids: list[int]) -> object:
    state = _state(request)
    submitted = await submit(
        state, caller,
        endpoint="chat.completions" if chat else "completions",
        prefix="chatcmpl" if chat else "cmpl",
        params=params,
        prompt_ids=prompt_ids,
        default_max_tokens=None if chat else 16,
    )
    if params.stream:
        include_usage = bool(params.stream_options and params.stream_options.include_usage)
        return EventSourceResponse(_stream(request, state, submitted, params, chat, include_usage), sep="\n",
                                   ping=15)
    try:
        return await _collect(request, state, submitted, params, chat)
    finally:
        state.inflight -= 1


def _stats(submitted: Submitted, last) -> dict:
    spec = submitted.spec
    return {**sd_stats(last, submitted.request_id), "pool": spec.pool, "route": spec.route,
            "routing_version": spec.routing_version}


def _observe(state: GatewayState, submitted: Submitted, chat: bool, last, num_tokens: int, started: float,
             first_token_at: float | None) -> None:
    logger.info("request %s finished: %s, %d tokens in %.0f ms", submitted.request_id,
                last.finish_reason if last else "no output", num_tokens, 1000 * (time.monotonic() - started))
    state.metrics.observe_finished(
        endpoint="chat.completions" if chat else "completions",
        finish_reason=last.finish_reason if last else None,
        prompt_tokens=len(submitted.spec.prompt_ids), completion_tokens=num_tokens,
        ttft_s=first_token_at - started if first_token_at else None,
        total_s=time.monotonic() - started, event=last,
    )


async def _collect(request: Request, state: GatewayState, submitted: Submitted, params: SamplingFields,
                   chat: bool) -> JSONResponse:
    text = IncrementalText(state.model.tokenizer, params.stop)
    last = None
    finished = False
    started, first_token_at = time.monotonic(), None
    try:
        async for event in read_output(state, submitted.request_id, state.settings.gateway.request_timeout_s):
            last = event
            if event.token_ids and first_token_at is None:
                first_token_at = time.monotonic()
            text.feed(event.token_ids)
            if event.finished:
                finished = True
            elif await request.is_disconnected():
                break
    except RequestTimeout as exc:
        raise APIError(504, str(exc)) from exc
    finally:
        if not finished:
            await cancel_request(state, submitted.request_id)
        _observe(state, submitted, chat, last, len(text.token_ids), started, first_token_at)
    if last is not None and last.finish_reason == "error":
        return JSONResponse(error_body(500, last.error or "generation failed"), status_code=500)
    build = responses.chat_body if chat else responses.completion_body
    body = build(
        request_id=submitted.request_id, model=state.model.name, text=text.text(),
        finish_reason=last.finish_reason if last else None, prompt_tokens=len(submitted.spec.prompt_ids),
        completion_tokens=len(text.token_ids), stats=_stats(submitted, last),
    )
    if params.return_token_ids:
        body["choices"][0]["token_ids"] = text.token_ids
    return JSONResponse(body)


async def _stream(request: Request, state: GatewayState, submitted: Submitted, params: SamplingFields, chat: bool,
                  include_usage: bool) -> AsyncIterator[dict]:
    request_id, model = submitted.request_id, state.model.name
    text = IncrementalText(state.model.tokenizer, params.stop)

    def chunk(delta: str, finish_reason: str | None = None, first: bool = False) -> dict:
        if chat:
            body = {"role": "assistant", "content": delta} if first else ({"content": delta} if delta else {})
            payload = responses.chat_chunk(request_id=request_id, model=model, delta=body,
                                           finish_reason=finish_reason)
        else:
            payload = responses.completion_chunk(request_id=request_id, model=model, text=delta,
                                                 finish_reason=finish_reason)
        if params.return_token_ids and finish_reason is not None:
            payload["choices"][0]["token_ids"] = text.token_ids
        return {"data": json.dumps(payload)}

    finished = False
    last = None
    started, first_token_at = time.monotonic(), None
    try:
        if chat:
            yield chunk("", first=True)
        async for event in read_output(state, request_id, state.settings.gateway.request_timeout_s):
            last = event
            if event.token_ids and first_token_at is None:
                first_token_at = time.monotonic()
            if event.finished:
                finished = True
                if event.finish_reason == "error":
                    yield {"data": json.dumps(error_body(500, event.error or "generation failed"))}
                    break
                yield chunk(text.feed(event.token_ids) + text.finish(), event.finish_reason)
            else:
                delta = text.feed(event.token_ids)
                if delta:
                    yield chunk(delta)
        if include_usage:
            yield {"data": json.dumps(responses.usage_chunk(
                request_id=request_id, model=model, chat=chat, prompt_tokens=len(submitted.spec.prompt_ids),
                completion_tokens=len(text.token_ids), stats=_stats(submitted, last)))}
        yield {"data": "[DONE]"}
    except RequestTimeout as exc:
        yield {"data": json.dumps(error_body(504, str(exc)))}
    finally:
        state.inflight -= 1
        _observe(state, submitted, chat, last, len(text.token_ids), started, first_token_at)
        if not finished:  # client went away (or timeout): stop the session within a round
            # The disconnect cancelled this task; shield the cleanup so it still runs.
            with anyio.CancelScope(shield=True):
                await cancel_request(state, request_id)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, caller: Caller = Depends(authenticate)):
    state = _state(request)
    check_model(state, body.model)
    if isinstance(body.prompt, str):
        prompt_ids = state.model.tokenizer.encode(body.prompt)
    else:
        prompt_ids = list(body.prompt)
    return await _generate(request, body, caller, chat=False, prompt_ids=prompt_ids)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, caller: Caller = Depends(authenticate)):
    state = _state(request)
    check_model(state, body.model)
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
    try:
        prompt_ids = encode_messages(state.model.tokenizer, messages)
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from exc
    return await _generate(request, body, caller, chat=True, prompt_ids=prompt_ids)


@router.get("/v1/models")
async def list_models(request: Request, caller: Caller = Depends(authenticate)) -> dict:
    model = _state(request).model
    return {"object": "list", "data": [{"id": model.name, "object": "model", "created": model.created,
                                         "owned_by": "mirror-sd", "max_model_len": model.max_context}]}


def _request_view(row) -> dict:
    def iso(value):
        return value.isoformat() if value else None

    drafts, accepted = row.num_drafts, row.num_accepted_tokens
    return {
        "id": row.id, "object": "request", "status": row.status, "model": row.model, "endpoint": row.endpoint,
        "priority": row.priority, "route": row.route, "pool": row.pool, "prompt_tokens": row.prompt_tokens,
        "completion_tokens": row.completion_tokens, "finish_reason": row.finish_reason, "params": row.params,
        "queued_at": iso(row.queued_at), "started_at": iso(row.started_at),
        "first_token_at": iso(row.first_token_at), "finished_at": iso(row.finished_at), "error": row.error,
        "mirror_sd": {
            "num_drafts": drafts, "num_draft_tokens": row.num_draft_tokens, "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / row.num_draft_tokens if row.num_draft_tokens else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
            "transport_ms_p50": row.transport_ms_p50,
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
    await cancel_request(_state(request), request_id)
    return {"id": request_id, "object": "request", "cancelled": True, "status": "cancelling"}


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    state = _state(request)
    checks = {"redis": False, "draft_workers": 0, "verify_workers": 0, "model": state.model.name}
    try:
        checks["redis"] = bool(await state.redis.ping())
        beats = await live_workers(state, fresh=True)
        checks["draft_workers"] = sum(1 for b in beats if b.role == "draft")
        checks["verify_workers"] = sum(1 for b in beats if b.role == "verify")
    except Exception as exc:  # readiness reports, it does not crash
        checks["error"] = f"{type(exc).__name__}: {exc}"
    ready = checks["redis"] and checks["draft_workers"] >= 1 and checks["verify_workers"] >= 1
    return JSONResponse({"ready": ready, **checks}, status_code=200 if ready else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = _state(request)
    state.metrics.fleet.beats = await live_workers(state, fresh=True)
    state.metrics.fleet.table = await current_table(state)
    state.metrics.inflight.set(state.inflight)
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
