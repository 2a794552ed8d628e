"""Refusals before any request work: an ASGI layer in front of the application that answers a generation
request 503 (or 429) from the admission counters alone when its caller is known (auth off, or a cached key) and
the answer is already certain: the gateway drains, the tier is full with no wait allowed, or the key is over
its limit. The body is never read, nothing is parsed or validated, no route runs; under a burst the refusals go
out at the cost of a header lookup. A request this layer cannot decide goes on to the route, whose admission
(gateway/admission.py) decides the same way."""

from __future__ import annotations

import json

from gateway.auth import known_caller
from gateway.errors import error_body

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


class EarlyRefusal:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in GENERATION_PATHS:
            state = getattr(scope["app"].state, "gateway", None) if "app" in scope else None
            if state is not None:
                header = next((value.decode("latin-1") for name, value in scope["headers"]
                               if name == b"authorization"), "")
                caller = known_caller(state, header)
                refused = state.admission.refusal(caller.priority, caller.api_key_id) if caller else None
                if refused is not None:
                    if state.metrics is not None:
                        state.metrics.rejected.labels(str(refused.status_code)).inc()
                    await _answer(send, refused.status_code, refused.message, refused.retry_after_s)
                    return
        await self.app(scope, receive, send)


async def _answer(send, status: int, message: str, retry_after_s: int) -> None:
    body = json.dumps(error_body(status, message, code="rate_limit_exceeded" if status == 429 else "overloaded"))
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"retry-after", str(retry_after_s).encode())]})
    await send({"type": "http.response.body", "body": body.encode()})
