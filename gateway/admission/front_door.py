"""Admission before any request work: an ASGI layer in front of the application takes a generation request's
admission slot (gateway/admission/slots.py) as soon as its headers are in, when its caller is known from the
headers alone (auth off, or a key in the cache). A refusal (503 full or draining, 429 a key over its limit) goes
out then: the body is never read, nothing is parsed or validated, no route runs. Admitted requests start their
own work one per loop pass, once requests stop arriving (gateway/admission/turns.py), so a refusal never waits
behind the parsing and tokenizing of a burst's admissions.

The route finds the slot in the request's state (`early_ticket`); a request this layer cannot place (a key not
cached yet) is admitted by the route the same way. The slot is given back when the response has been sent (or
the client left), whichever path took it; release is idempotent."""

from __future__ import annotations

import json
from functools import lru_cache

from fastapi import Request

from gateway.observability.access_log import REFUSED, RefusalSummary
from gateway.admission.slots import Rejected, Ticket
from gateway.admission.auth import known_caller
from gateway.errors import error_body
from gateway.admission.turns import Turns

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
TICKET = "admission_ticket"


def early_ticket(request: Request) -> Ticket | None:
    return request.scope.get("state", {}).get(TICKET)


class EarlyAdmission:
    def __init__(self, app) -> None:
        self.app = app
        self.turns = Turns()
        self.refusals = RefusalSummary()
        self._counters: dict[int, object] = {}

    def _rejected_counter(self, state, status_code: int):
        counter = self._counters.get(status_code)
        if counter is None:  # prometheus' labels() lookup costs more than the rest of a refusal
            counter = self._counters[status_code] = state.metrics.rejected.labels(str(status_code))
        return counter

    async def __call__(self, scope, receive, send) -> None:
        state = None
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in GENERATION_PATHS \
                and "app" in scope:
            state = getattr(scope["app"].state, "gateway", None)
        caller = known_caller(state, _header(scope, b"authorization")) if state is not None else None
        if caller is None:
            await self.app(scope, receive, send)
            return
        self.turns.arrived()
        refused = state.admission.refusal(caller.priority, caller.api_key_id)  # the burst's common case, no await
        if refused is None:
            try:
                ticket = await state.admission.acquire(caller.priority, caller.api_key_id)
            except Rejected as exc:  # a wait in the queue that ran out
                refused = exc
        if refused is not None:
            if state.metrics is not None:
                self._rejected_counter(state, refused.status_code).inc()
            scope.setdefault("state", {})[REFUSED] = True  # counted in one line a second, not an access line each
            self.refusals.count(refused.status_code)
            start, body = _answer(refused)
            await send(start)
            await send(body)
            return
        scope.setdefault("state", {})[TICKET] = ticket
        try:
            await self.turns.take()  # one admitted request's first stretch per loop pass (gateway/admission/turns.py)
            await self.app(scope, receive, send)
        finally:
            state.admission.release(ticket)


def _header(scope, name: bytes) -> str:
    return next((value.decode("latin-1") for key, value in scope["headers"] if key == name), "")


@lru_cache(maxsize=64)  # a handful of distinct refusals: each is built once
def _refusal_messages(status_code: int, message: str, retry_after_s: int) -> tuple[dict, dict]:
    code = "rate_limit_exceeded" if status_code == 429 else "overloaded"
    body = json.dumps(error_body(status_code, message, code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"retry-after", str(retry_after_s).encode())]
    return {"type": "http.response.start", "status": status_code, "headers": headers}, \
        {"type": "http.response.body", "body": body}


def _answer(refused: Rejected) -> tuple[dict, dict]:
    """The refusal's two ASGI messages (new dicts: a server may keep what it is sent)."""
    start, body = _refusal_messages(refused.status_code, refused.message, refused.retry_after_s)
    return dict(start), dict(body)
