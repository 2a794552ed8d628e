"""The OpenAI-compatible generation endpoints: admission, the session, and its answer as one body or SSE.

Whatever ends an answer (its last token, a timeout, the client leaving, Redis losing the request) gives the
admission slot back and, unless the session finished, cancels it, or, for a request sharing an identical
one's generation (gateway/sessions/single_flight.py), leaves that flight: the last reader out cancels."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timedelta, timezone

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask

from gateway.api import responses
from gateway.api.choices import choice_params, choices_room, merge_bodies, merge_streams
from gateway.admission.slots import Ticket
from gateway.admission.auth import Caller, authenticate
from gateway.sessions.ending import close_follower_row, close_open_row, end_answer
from gateway.errors import APIError, RequestLost, error_body
from gateway.sessions.recovery import check_stalled
from gateway.admission.front_door import early_ticket
from gateway.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from gateway.state import GatewayState
from gateway.streams.tally import StreamShare, claim_across_gateways
from gateway.streams.reader import AnswerCancelled, RequestTimeout, read_output
from gateway.streams.logprobs import LogprobsCursor, token_strings
from gateway.streams.text import IncrementalText, sd_stats
from gateway.tools import answer_as_call, call_delta, history_message, tools_note
from gateway.sessions.submit import Submitted, admit, check_model, submit
from services.models.tokenization import encode_messages
from services.protocol import OutputEvent, answer_cancel_key, output_stream

logger = logging.getLogger(__name__)

router = APIRouter()


def _state(request: Request) -> GatewayState:
    return request.app.state.gateway


async def _generate(request: Request, params: SamplingFields, caller: Caller, *, chat: bool,
                    encode: Callable[[], list[int]]) -> object:
    """Admission first (a burst is answered before any tokenizing), then the session; the slot is given back
    when the answer ends, however it ends."""
    state = _state(request)
    _check_choices_room(request, state, params, caller)
    ticket = early_ticket(request) or await admit(state, caller)
    if (params.n or 1) > 1:
        return await _generate_choices(request, state, params, caller, chat=chat, encode=encode, ticket=ticket)
    try:
        submitted = await _submit(state, caller, params, encode(), chat=chat)
    except BaseException:
        state.admission.release(ticket)
        raise
    if params.stream:
        include_usage = bool(params.stream_options and params.stream_options.include_usage)
        # the background task covers a client gone before the stream starts (the generator never runs)
        return EventSourceResponse(_stream(request, state, submitted, params, chat, include_usage, ticket), sep="\n",
                                   ping=15, background=BackgroundTask(_after_stream, state, ticket, submitted))
    try:
        return await _collect(request, state, submitted, params, chat)
    finally:
        state.admission.release(ticket)


def _check_choices_room(request: Request, state: GatewayState, params: SamplingFields, caller: Caller) -> None:
    """More choices than the request could ever hold slots for is a 400 naming n (not a wait ending in a 503)."""
    per_key = state.settings.gateway.max_inflight_per_key if caller.api_key_id is not None else 0
    room = choices_room(state.admission.limit(caller.priority), per_key)
    if (params.n or 1) > room:
        early = early_ticket(request)
        if early is not None:
            state.admission.release(early)
        raise APIError(400, f"n must be <= {room} here: each choice is a session with an admission slot of its own, "
                            f"and a {caller.priority}-priority request gets at most {room} (got {params.n})", param="n")


async def _submit(state: GatewayState, caller: Caller, params: SamplingFields, prompt_ids: list[int], *,
                  chat: bool) -> Submitted:
    return await submit(state, caller, endpoint="chat.completions" if chat else "completions",
                        prefix="chatcmpl" if chat else "cmpl", params=params, prompt_ids=prompt_ids,
                        default_max_tokens=None if chat else 16)


async def _generate_choices(request: Request, state: GatewayState, params: SamplingFields, caller: Caller, *,
                            chat: bool, encode: Callable[[], list[int]], ticket: Ticket) -> object:
    """`n` choices (gateway/api/choices.py): a slot and a session each, answered as one body or one stream."""
    tickets, sessions = [ticket], []
    try:
        for _ in range(params.n - 1):
            tickets.append(await admit(state, caller))
        prompt_ids = encode()
        for index in range(params.n):
            sessions.append(await _submit(state, caller, choice_params(params, index), prompt_ids, chat=chat))
    except BaseException:
        for taken in tickets:
            state.admission.release(taken)
        for submitted in sessions:
            await end_answer(state, submitted.flight, submitted.request_id, finished=False)
        raise
    if params.stream:
        include_usage = bool(params.stream_options and params.stream_options.include_usage)
        streams = [_stream(request, state, submitted, params, chat, include_usage, taken)
                   for submitted, taken in zip(sessions, tickets)]

        async def after() -> None:
            for submitted, taken in zip(sessions, tickets):
                await _after_stream(state, taken, submitted)

        return EventSourceResponse(merge_streams(streams), sep="\n", ping=15, background=BackgroundTask(after))
    try:  # every choice to its end (a slot is given back when its session is done), then the first error if any
        answers = await asyncio.gather(*(_collect(request, state, submitted, params, chat) for submitted in sessions),
                                       return_exceptions=True)
    finally:
        for taken in tickets:
            state.admission.release(taken)
    raised = next((answer for answer in answers if isinstance(answer, BaseException)), None)
    if raised is not None:
        raise raised
    failed = next((answer for answer in answers if answer.status_code != 200), None)
    if failed is not None:
        return failed
    return JSONResponse(merge_bodies([json.loads(answer.body) for answer in answers]))


async def _after_stream(state: GatewayState, ticket: Ticket, submitted: Submitted) -> None:
    state.admission.release(ticket)
    if submitted.flight is not None:  # out of the flight even if the stream never ran (leaving twice is harmless)
        await end_answer(state, submitted.flight, submitted.request_id, finished=False)


def _stats(submitted: Submitted, last, synthetic: dict | None = None) -> dict:
    """synthetic: the stack's label (ServedModel.synthetic), carried by every answer it gives."""
    spec = submitted.spec
    return {**sd_stats(last, submitted.request_id), "pool": spec.pool, "route": spec.route,
            "routing_version": spec.routing_version, "merged_into": submitted.merged_into,
            **({"synthetic": synthetic} if synthetic else {})}


def _observe(state: GatewayState, submitted: Submitted, chat: bool, last, num_tokens: int, started: float,
             first_token_at: float | None, count_work: bool) -> None:
    """Per request: its finish, tokens and latency. The generation's drafting stats only with count_work
    (once per generation, whoever of its readers ends it: gateway/streams/tally.py)."""
    logger.info("request %s finished: %s, %d tokens in %.0f ms", submitted.request_id,
                last.finish_reason if last else "no output", num_tokens, 1000 * (time.monotonic() - started))
    state.metrics.observe_finished(
        endpoint="chat.completions" if chat else "completions",
        finish_reason=last.finish_reason if last else None,
        prompt_tokens=len(submitted.spec.prompt_ids), completion_tokens=num_tokens,
        ttft_s=first_token_at - started if first_token_at else None,
        total_s=time.monotonic() - started, event=last if count_work else None,
    )


def _read(state: GatewayState, submitted: Submitted, share: StreamShare) -> AsyncIterator[OutputEvent]:
    """The generation's events (a follower's are its leader's); in a flight, this answer can be cancelled alone."""
    cancel = answer_cancel_key(submitted.request_id) if submitted.flight is not None else None
    source, priority = submitted.source_id, submitted.spec.priority

    async def on_stall(stalled_s: float) -> None:  # the reader reports; sessions/recovery.py acts
        await check_stalled(state, source, priority, stalled_s)

    return read_output(state, source, state.settings.gateway.request_timeout_s, on_stall=on_stall, share=share,
                       cancel_key=cancel)


async def _end(state: GatewayState, submitted: Submitted, chat: bool, share: StreamShare, *, last, finished: bool,
               num_tokens: int, started: float, first_token_at: float | None) -> None:
    """However the answer ended: the session cancelled or the flight left, metrics, a follower's row."""
    ended_it = await end_answer(state, submitted.flight, submitted.request_id, finished=finished)
    count_work = (finished or ended_it) and share.claim_end()
    if count_work and state.shared and submitted.flight is not None:  # its readers may be on other gateways
        count_work = await claim_across_gateways(state.redis, submitted.source_id)
    _observe(state, submitted, chat, last, num_tokens, started, first_token_at, count_work=count_work)
    now = time.monotonic()
    first_at = datetime.now(timezone.utc) - timedelta(seconds=now - first_token_at) if first_token_at else None
    if submitted.merged_into is not None:
        await close_follower_row(state, submitted.request_id, last=last, finished=finished, num_tokens=num_tokens,
                                 first_token_at=first_at)
    elif finished and last is not None:
        await close_open_row(state, submitted.request_id, last=last, first_token_at=first_at)


def _logprobs(state: GatewayState, params: SamplingFields, chat: bool) -> LogprobsCursor:
    asked = params.num_logprobs() is not None
    return LogprobsCursor(token_strings(state.model.tokenizer) if asked else None, chat)


async def _collect(request: Request, state: GatewayState, submitted: Submitted, params: SamplingFields,
                   chat: bool) -> JSONResponse:
    text = IncrementalText(state.model.tokenizer, params.stop)
    logprobs = _logprobs(state, params, chat)
    last = None
    finished = cancelled = False
    started, first_token_at = time.monotonic(), None
    with state.tally.reading(output_stream(submitted.source_id)) as share:
        try:
            async for event in _read(state, submitted, share):
                last = event
                if event.token_ids and first_token_at is None:
                    first_token_at = time.monotonic()
                text.feed(event.token_ids)
                logprobs.feed(event)
                if event.finished:
                    finished = True
                elif await request.is_disconnected():
                    break
        except AnswerCancelled:
            cancelled = True
        except RequestTimeout as exc:
            raise APIError(504, str(exc)) from exc
        except RequestLost as exc:
            state.metrics.lost.inc()
            raise APIError(503, str(exc), code="request_lost", headers={"Retry-After": "2"}) from exc
        finally:
            await _end(state, submitted, chat, share, last=last, finished=finished, num_tokens=len(text.token_ids),
                       started=started, first_token_at=first_token_at)
    if last is not None and last.finish_reason == "error":
        return JSONResponse(error_body(500, last.error or "generation failed"), status_code=500)
    build = responses.chat_body if chat else responses.completion_body
    body = build(
        request_id=submitted.request_id, model=state.model.name, text=text.text(),
        finish_reason="cancelled" if cancelled else (last.finish_reason if last else None),
        prompt_tokens=len(submitted.spec.prompt_ids), completion_tokens=len(text.token_ids),
        stats=_stats(submitted, last, state.model.synthetic),
    )
    if params.return_token_ids:
        body["choices"][0]["token_ids"] = text.token_ids
    body["choices"][0]["logprobs"] = logprobs.take(everything=True)
    answer_as_call(body["choices"][0], getattr(params, "tool_plan", None), text.text())
    return JSONResponse(body)


async def _stream(request: Request, state: GatewayState, submitted: Submitted, params: SamplingFields, chat: bool,
                  include_usage: bool, ticket: Ticket) -> AsyncIterator[dict]:
    request_id, model = submitted.request_id, state.model.name
    text = IncrementalText(state.model.tokenizer, params.stop)
    logprobs = _logprobs(state, params, chat)
    plan = getattr(params, "tool_plan", None)  # a tool call: its arguments come whole, with the last chunk

    def chunk(delta: str, finish_reason: str | None = None, first: bool = False) -> dict:
        if plan is not None and not first:
            body, finish_reason = call_delta(plan, text.text(), finish_reason)
            payload = responses.chat_chunk(request_id=request_id, model=model, delta=body,
                                           finish_reason=finish_reason)
        elif chat:
            body = {"role": "assistant", "content": delta} if first else ({"content": delta} if delta else {})
            payload = responses.chat_chunk(request_id=request_id, model=model, delta=body,
                                           finish_reason=finish_reason)
        else:
            payload = responses.completion_chunk(request_id=request_id, model=model, text=delta,
                                                 finish_reason=finish_reason)
        if params.return_token_ids and finish_reason is not None:
            payload["choices"][0]["token_ids"] = text.token_ids
        if not first:  # the tokens since the last chunk (a held-back token's come with the text that shows it)
            payload["choices"][0]["logprobs"] = logprobs.take()
        return {"data": json.dumps(payload)}

    finished = False
    last = None
    started, first_token_at = time.monotonic(), None
    with state.tally.reading(output_stream(submitted.source_id)) as share:
        try:
            if chat:
                yield chunk("", first=True)
            try:
                async for event in _read(state, submitted, share):
                    last = event
                    if event.token_ids and first_token_at is None:
                        first_token_at = time.monotonic()
                    logprobs.feed(event)
                    if event.finished:
                        finished = True
                        if event.finish_reason == "error":
                            yield {"data": json.dumps(error_body(500, event.error or "generation failed"))}
                            break
                        yield chunk(text.feed(event.token_ids) + text.finish(), event.finish_reason)
                    else:
                        delta = text.feed(event.token_ids)
                        if delta and plan is None:  # a tool call's arguments come whole, at the end
                            yield chunk(delta)
            except AnswerCancelled:  # this client's DELETE; the generation goes on for the others
                yield chunk(text.finish(), "cancelled")
            if include_usage:
                yield {"data": json.dumps(responses.usage_chunk(
                    request_id=request_id, model=model, chat=chat, prompt_tokens=len(submitted.spec.prompt_ids),
                    completion_tokens=len(text.token_ids), stats=_stats(submitted, last, state.model.synthetic)))}
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
            # A client gone cancelled this task; shield the cleanup so it still runs (and, unless the
            # session finished, stops it within a round when nobody else reads it).
            with anyio.CancelScope(shield=True):
                await _end(state, submitted, chat, share, last=last, finished=finished,
                           num_tokens=len(text.token_ids), started=started, first_token_at=first_token_at)


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
    messages = [history_message({"role": "system" if m.role == "developer" else m.role, "content": m.text(),
                                 "tool_calls": m.tool_calls}) for m in body.messages]
    if body.tool_plan is not None:  # what the model calls, said in words (its answer is held to the schema)
        messages.insert(0, {"role": "system", "content": tools_note(body.tool_plan)})

    def encode() -> list[int]:
        try:
            return encode_messages(state.model.tokenizer, messages)
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from exc

    return await _generate(request, body, caller, chat=True, encode=encode)
