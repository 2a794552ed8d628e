"""Turn a validated HTTP request into a session (checks, SQL row, Redis spec, Celery task), or into a follower of an
identical one in flight."""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, replace
from datetime import datetime, timezone

import redis
from kombu.exceptions import OperationalError as BrokerError

from gateway.admission.slots import Rejected, Ticket
from gateway.admission.auth import Caller
from gateway.sessions.ending import end_answer
from gateway.errors import APIError
from gateway.schemas import SamplingFields
from gateway.state import GatewayState
from gateway.fleet.routing import affinity_route, route_request
from gateway.sessions.single_flight import Flight, flight_key
from gateway.fleet.workers import drafts_locally, live_workers, missing_roles, opens_sessions
from services.celery_app import PRIORITY_LEVELS
from services.engine.stopping import StopStrings
from services.engine.context import check_request_fits
from services.errors import ContextLengthError
from services.logs import bind_request
from services.speculative.grammar import GrammarError, check_grammar
from services.protocol import (
    TASK_RUN_SESSION,
    DraftBlock,
    SessionSpec,
    draft_queue,
    opening_block,
    request_key,
    tenant_of,
    verify_pool_queue,
    verify_worker_queue,
)
from services.redis_client import REQUEST_TTL_S
from services.storage import crud

logger = logging.getLogger(__name__)


JOIN_ATTEMPTS = 3  # a follower whose leader gave up joins again (and may lead); then it goes alone


@dataclass
class Submitted:
    request_id: str  # this client's: its response id and its SQL row
    spec: SessionSpec  # the generation's (a follower's is its leader's)
    flight: Flight | None = None

    @property
    def source_id(self) -> str:
        """The request whose output stream holds this answer."""
        return self.flight.leader_id if self.flight is not None else self.request_id

    @property
    def merged_into(self) -> str | None:
        return self.flight.merged_into if self.flight is not None else None


@dataclass(frozen=True)
class Ask:
    """A validated request about to be submitted."""

    request_id: str
    endpoint: str
    params: SamplingFields
    prompt_ids: list[int]
    max_new_tokens: int
    caller: Caller


def check_model(state: GatewayState, requested: str) -> None:
    if requested not in state.model.aliases:
        raise APIError(404, f"model {requested!r} does not exist; this server serves {state.model.name!r}",
                       param="model", code="model_not_found")


def resolve_max_tokens(state: GatewayState, params: SamplingFields, num_prompt_tokens: int, default: int | None) -> int:
    limit = state.settings.max_new_tokens_limit
    if params.max_tokens is not None:
        if params.max_tokens > limit:
            raise APIError(400, f"max_tokens must be <= {limit}, got {params.max_tokens}", param="max_tokens")
        return params.max_tokens
    room = state.model.max_context - num_prompt_tokens
    return max(1, min(default or limit, limit, room))


def _validate(state: GatewayState, params: SamplingFields, prompt_ids: list[int], max_new_tokens: int) -> None:
    try:
        check_request_fits(state.model.name, state.model.max_context, len(prompt_ids), max_new_tokens)
        params.sampling()
        StopStrings(state.model.tokenizer, params.stop)
    except ContextLengthError as exc:
        raise APIError(400, str(exc), param="prompt", code="context_length_exceeded") from exc
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc
    vocab = len(state.model.tokenizer)
    bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})", param="prompt")
    _check_format(state, params, vocab)
    bad = next((key for key in params.logit_bias or {} if int(key) >= vocab), None)
    if bad is not None:
        raise APIError(400, f"logit_bias: token id {bad} is outside the vocabulary (0..{vocab - 1})",
                       param="logit_bias")


def _create_row(state: GatewayState, **fields) -> None:
    with state.db() as session:
        crud.create_request(session=session, **fields)


async def start(state: GatewayState, spec: SessionSpec, *, revive: bool = False) -> None:
    """Set the session going (again, for one whose driver died: it resumes from its committed output). Placement
    remote: its one Celery task, for a draft worker of this gateway's pool, and for an opened session
    (SessionSpec.opened) its round 0 to the verify pool, so the target prefills while the task travels. Local:
    a start block on its verify pool's queue."""
    if spec.draft_placement != "local":
        if spec.opened and not revive:  # a revived session's new driver finds round 0 committed, or sends it
            await _to_verify(state, spec, opening_block(spec), revive=False)
        # ignore_result: the outcome is read from the stream and SQL, never from Celery's result store, so no
        # subscription to it per request (a round trip, and a store that must be up for a request to start)
        try:
            await asyncio.to_thread(state.celery.send_task, TASK_RUN_SESSION, args=[spec.request_id],
                                    queue=draft_queue(state.settings.worker.pool), priority=spec.priority,
                                    task_id=spec.request_id, ignore_result=True)
        except BrokerError as exc:  # Redis away past the publish retries: an outage like any other Redis error
            if spec.opened and not revive:  # its round 0 is at the verify pool already: no draft will follow it
                await end_answer(state, None, spec.request_id, finished=False)
            raise redis.ConnectionError(f"sending the session's task: {exc}") from exc
        return
    block = DraftBlock(request_id=spec.request_id, round=0, num_committed=len(spec.prompt_ids), draft_ids=[],
                       draft_here=True)
    await _to_verify(state, spec, block, revive=revive)


async def _to_verify(state: GatewayState, spec: SessionSpec, block: DraftBlock, *, revive: bool) -> None:
    """A session's first block: to the verify worker holding a similar request's KV (unless reviving), else to
    the pool's queue; high priority in front."""
    queue = verify_worker_queue(spec.verify_worker) if spec.verify_worker and not revive else \
        verify_pool_queue(spec.pool)
    push = state.redis.lpush if spec.priority == PRIORITY_LEVELS["high"] else state.redis.rpush
    await push(queue, block.encode())


def _check_format(state: GatewayState, params: SamplingFields, vocab: int) -> None:
    """A grammar the served tokenizer cannot follow (an unsupported schema keyword, a bad regex) is a 400 naming
    the field it came from, before any worker sees it."""
    grammar = params.sampling().grammar
    if grammar is None:
        return
    tokenizer = state.model.tokenizer
    eos = getattr(tokenizer, "eos_token_id", None)
    try:
        check_grammar(grammar, tokenizer, vocab, [eos] if isinstance(eos, int) else [])
    except GrammarError as exc:
        field = "structured_outputs" if params.structured_outputs else "response_format"
        raise APIError(400, f"{field}: {exc}", param=field) from exc


async def admit(state: GatewayState, caller: Caller) -> Ticket:
    """A slot before any other work (the caller gives it back when the request ends, or fails)."""
    try:
        return await state.admission.acquire(caller.priority, caller.api_key_id)
    except Rejected as exc:
        raise APIError(exc.status_code, exc.message, headers={"Retry-After": str(exc.retry_after_s)},
                       code="rate_limit_exceeded" if exc.status_code == 429 else "overloaded") from None


async def submit(state: GatewayState, caller: Caller, *, endpoint: str, prefix: str, params: SamplingFields,
                 prompt_ids: list[int], default_max_tokens: int | None) -> Submitted:
    """Validate; then follow an identical generation in flight (gateway/sessions/single_flight.py), or start a session:
    route, write the request row and spec, send the session task. The caller holds a slot."""
    max_new_tokens = resolve_max_tokens(state, params, len(prompt_ids), default_max_tokens)
    _validate(state, params, prompt_ids, max_new_tokens)
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    bind_request(request_id)  # this request's task: every later line of it (and uvicorn's access line) names it
    ask = Ask(request_id, endpoint, params, prompt_ids, max_new_tokens, caller)
    key = flight_key(model=state.model.name, prompt_ids=prompt_ids, max_new_tokens=max_new_tokens, params=params,
                     priority=caller.priority) if state.settings.merging.single_flight else None
    if key is None:
        return await _start_session(state, ask, None)
    for _ in range(JOIN_ATTEMPTS):
        flight = await state.flights.join(key, request_id)
        try:
            if flight.leading:
                return await _start_session(state, ask, flight)
            spec = await state.flights.leader_spec(flight)
            if spec is not None:
                return await _follow(state, ask, flight, spec)
        except BaseException:  # no answer to read: out of the flight (the last one out cancels the generation)
            await end_answer(state, flight, request_id, finished=flight.leading)
            raise
    logger.warning("request %s: leaders of flight %s kept giving up; starting its own session", request_id, key)
    return await _start_session(state, ask, None)


def _row_params(ask: Ask, flight: Flight | None) -> dict:
    params = ask.params
    row = {"max_tokens": ask.max_new_tokens, **params.sampling().to_wire(), "stop": list(params.stop),
           "stream": params.stream}
    if flight is not None:  # JSON, so no migration; a DELETE reads the flight from here
        row.update(single_flight=flight.key, merged_into=flight.merged_into)
    return row


async def _start_session(state: GatewayState, ask: Ask, flight: Flight | None) -> Submitted:
    caller, params, request_id = ask.caller, ask.params, ask.request_id
    draft_pool = state.settings.worker.pool
    route = await route_request(state, num_prompt_tokens=len(ask.prompt_ids), priority=caller.priority)
    sketch = state.similarity.sketch(ask.prompt_ids) if state.similarity is not None else None
    similar = None
    if sketch is not None:
        route, similar = await affinity_route(state, route, sketch, params.cache_salt)
    if params.route == "ar":
        route = replace(route, route="ar")
    pool = route.pool
    missing = await missing_roles(state, draft_pool=draft_pool, verify_pool=pool)
    if missing:
        raise APIError(503, f"no {' or '.join(missing)} worker is serving; retry shortly",
                       headers={"Retry-After": "5"})
    beats = await live_workers(state)
    placement = "local" if drafts_locally(beats, pool) else "remote"
    opened = placement == "remote" and state.settings.gateway.open_sessions and opens_sessions(
        beats, draft_pool=draft_pool, route=route.route, num_prompt_tokens=len(ask.prompt_ids))
    spec = SessionSpec(
        request_id=request_id,
        prompt_ids=ask.prompt_ids,
        max_new_tokens=ask.max_new_tokens,
        sampling=params.sampling(),
        stop=list(params.stop),
        ignore_eos=params.ignore_eos,
        priority=PRIORITY_LEVELS[caller.priority],
        pool=pool,
        route=route.route,
        max_draft_tokens=route.max_draft_tokens,
        routing_version=route.table_version,
        verify_worker=similar.worker_id if similar is not None else None,
        cache_salt=params.cache_salt,
        tenant=tenant_of(caller.api_key_id, params.cache_salt),
        draft_placement=placement,
        opened=opened,
    )
    await asyncio.to_thread(
        _create_row,
        state,
        request_id=request_id,
        model=state.model.name,
        endpoint=ask.endpoint,
        prompt_tokens=len(ask.prompt_ids),
        params=_row_params(ask, flight),
        priority=caller.priority,
        route=spec.route,
        pool=pool,
        api_key_id=caller.api_key_id,
    )
    await state.redis.set(request_key(request_id), spec.encode(), ex=REQUEST_TTL_S)
    await start(state, spec)
    if sketch is not None:
        state.similarity.add(request_id, sketch, params.cache_salt)
        if state.similarity_log is not None:
            await state.similarity_log.added(request_id, sketch, params.cache_salt)
    if similar is not None and state.metrics is not None:
        state.metrics.affinity_routed.inc()
    logger.info("request %s: %s, %d prompt tokens, max %d new, pool %s (drafts %s), route %s, priority %s%s",
                request_id, ask.endpoint, len(ask.prompt_ids), ask.max_new_tokens, pool, placement, spec.route,
                caller.priority,
                f", similar to {similar.request_id} ({similar.similarity:.2f}): verify worker {similar.worker_id}"
                if similar is not None else "")
    return Submitted(request_id, spec, flight)

async def _follow(state: GatewayState, ask: Ask, flight: Flight, spec: SessionSpec) -> Submitted:
    """No session of its own: its row (the leader's route and pool), a "merged" event, the leader's spec."""
    def record() -> None:
        with state.db() as session:
            crud.create_request(session=session, request_id=ask.request_id, model=state.model.name,
                                endpoint=ask.endpoint, prompt_tokens=len(ask.prompt_ids),
                                params=_row_params(ask, flight), priority=ask.caller.priority, route=spec.route,
                                pool=spec.pool, api_key_id=ask.caller.api_key_id)
            crud.update_request(session=session, request_id=ask.request_id, status="running",
                                started_at=datetime.now(timezone.utc))
            crud.record_event(session=session, kind="merged", request_id=ask.request_id,
                              detail={"leader": flight.leader_id, "single_flight": flight.key})

    await asyncio.to_thread(record)
    if state.metrics is not None:
        state.metrics.single_flight_merged.inc()
    logger.info("request %s: %s, merged into %s (identical request in flight)", ask.request_id, ask.endpoint,
                flight.leader_id)
    return Submitted(ask.request_id, spec, flight)
