"""Admission before any request work: an ASGI layer in front of the application takes a generation request's
admission slot (gateway/admission.py) as soon as its headers are in, when its caller is known from the headers
alone (auth off, or a key in the cache). A refusal (503 full or draining, 429 a key over its limit) goes out
then: the body is never read, nothing is parsed or validated, no route runs. An admitted request yields once
before its own work starts, so the requests of the same burst behind it are answered first, and a refusal never
waits behind the parsing and tokenizing of the requests let in.

The route finds the slot in the request's state (`early_ticket`); a request this layer cannot place (a key not
cached yet) is admitted by the route the same way. The slot is given back when the response has been sent (or
the client left), whichever path took it; release is idempotent."""

from __future__ import annotations

import asyncio
import json

from fastapi import Request

from gateway.admission import Rejected, Ticket
from gateway.auth import known_caller
from gateway.errors import error_body

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
TICKET = "admission_ticket"


def early_ticket(request: Request) -> Ticket | None:
    return request.scope.get("state", {}).get(TICKET)


class EarlyAdmission:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        state = None
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in GENERATION_PATHS \
                and "app" in scope:
            state = getattr(scope["app"].state, "gateway", None)
        caller = known_caller(state, _header(scope, b"authorization")) if state is not None else None
        if caller is None:
            await self.app(scope, receive, send)
            return
        try:
            ticket = await state.admission.acquire(caller.priority, caller.api_key_id)
        except Rejected as refused:
            if state.metrics is not None:
                state.metrics.rejected.labels(str(refused.status_code)).inc()
            await _answer(send, refused)
            return
        scope.setdefault("state", {})[TICKET] = ticket
        try:
            await asyncio.sleep(0)  # the rest of the burst first
            await self.app(scope, receive, send)
        finally:
            state.admission.release(ticket)


def _header(scope, name: bytes) -> str:
    return next((value.decode("latin-1") for key, value in scope["headers"] if key == name), "")


async def _answer(send, refused: Rejected) -> None:
    code = "rate_limit_exceeded" if refused.status_code == 429 else "overloaded"
    body = json.dumps(error_body(refused.status_code, refused.message, code=code)).encode()
    await send({"type": "http.response.start", "status": refused.status_code,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"retry-after", str(refused.retry_after_s).encode())]})
    await send({"type": "http.response.body", "body": body})
