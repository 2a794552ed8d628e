"""The OpenAI-compatible generation endpoints: admission, the session, and its answer as one body or SSE.

Whatever ends an answer (its last token, a timeout, the client leaving, Redis losing the request) gives the
admission slot back and, unless the session finished, cancels it."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone

import anyio
import redis
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask

from gateway import responses
from gateway.admission import Ticket
from gateway.auth import Caller, authenticate
from gateway.errors import APIError, error_body
from gateway.recovery import RequestLost
from gateway.refusal import early_ticket
from gateway.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from gateway.state import GatewayState
from gateway.streaming import IncrementalText, RequestTimeout, read_output, sd_stats
from gateway.submit import Submitted, admit, check_model, submit
from services.models.tokenization import encode_messages
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


async def _cancel_quietly(state: GatewayState, request_id: str) -> None:
    """Cleanup after an answer ended early: best effort (Redis may be the reason it ended)."""
    try:
        await cancel_request(state, request_id)
    except (redis.RedisError, OSError) as exc:
        logger.warning("request %s: could not mark it cancelled (%s)", request_id, exc)


async def _generate(request: Request, params: SamplingFields, caller: Caller, *, chat: bool,
                    encode: Callable[[], list[int]]) -> object:
    """Admission first (a burst is answered before any tokenizing), then the session; the slot is given back
    when the answer ends, however it ends."""
    state = _state(request)
    ticket = early_ticket(request) or await admit(state, caller)
    try:
        submitted = await submit(
            state, caller,
            endpoint="chat.completions" if chat else "completions",
            prefix="chatcmpl" if chat else "cmpl",
            params=params,
            prompt_ids=encode(),
            default_max_tokens=None if chat else 16,
        )
    except BaseException:
        state.admission.release(ticket)
        raise
    if params.stream:
        include_usage = bool(params.stream_options and params.stream_options.include_usage)
        # the background task covers a client gone before the stream starts (the generator never runs)
        return EventSourceResponse(_stream(request, state, submitted, params, chat, include_usage, ticket), sep="\n",
                                   ping=15, background=BackgroundTask(state.admission.release, ticket))
    try:
        return await _collect(request, state, submitted, params, chat)
    finally:
        state.admission.release(ticket)


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
        async for event in read_output(state, submitted.request_id, state.settings.gateway.request_timeout_s,
                                     submitted.spec.priority):
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
    except RequestLost as exc:
        state.metrics.lost.inc()
        raise APIError(503, str(exc), code="request_lost", headers={"Retry-After": "2"}) from exc
    finally:
        if not finished:
            await _cancel_quietly(state, submitted.request_id)
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
                  include_usage: bool, ticket: Ticket) -> AsyncIterator[dict]:
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
        async for event in read_output(state, request_id, state.settings.gateway.request_timeout_s,
                                     submitted.spec.priority):
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
    except RequestTimeout as exc:  # an OpenAI-shaped error event, then the end of the stream
        yield {"data": json.dumps(error_body(504, str(exc)))}
        yield {"data": "[DONE]"}
    except RequestLost as exc:
        state.metrics.lost.inc()
        yield {"data": json.dumps(error_body(503, str(exc), code="request_lost"))}
        yield {"data": "[DONE]"}
    finally:
        state.admission.release(ticket)
        _observe(state, submitted, chat, last, len(text.token_ids), started, first_token_at)
        if not finished:  # client went away (or timeout): stop the session within a round
            # The disconnect cancelled this task; shield the cleanup so it still runs.
            with anyio.CancelScope(shield=True):
                await _cancel_quietly(state, request_id)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, caller: Caller = Depends(authenticate)):
    state = _state(request)
    check_model(state, body.model)
    tokenizer = state.model.tokenizer
    prompt = body.prompt
    return await _generate(request, body, caller, chat=False,
                           encode=lambda: tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt))


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, caller: Caller = Depends(authenticate)):
    state = _state(request)
    check_model(state, body.model)
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]

    def encode() -> list[int]:
        try:
            return encode_messages(state.model.tokenizer, messages)
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from exc

    return await _generate(request, body, caller, chat=True, encode=encode)
