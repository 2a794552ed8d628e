"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import redis
from sqlalchemy.exc import OperationalError as DatabaseUnavailable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway import fields

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error"}


class RequestLost(Exception):
    """The request's state is gone (Redis lost it, or its output skips tokens): it cannot finish; the client may
    retry."""


class APIError(Exception):
    def __init__(self, status_code: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status_code: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status_code, "server_error"), "param": param,
                      "code": code}}


def param_path(location: Iterable[object]) -> str | None:
    """A field's place as OpenAI writes it: `messages[0].content[1].type`."""
    path = ""
    for part in location:
        if part == "body" and not path:
            continue
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or None


def _describe(exc: RequestValidationError) -> tuple[str, str | None, str | None]:
    """The first error's message, param and code (OpenAI's codes for an unknown, unsupported or missing
    field: gateway/fields.py)."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None, None
    first = errors[0]
    kind, context = first.get("type"), first.get("ctx") or {}
    param = param_path(first.get("loc", ()))
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if kind == "json_invalid":
        return f"malformed JSON body: {context.get('error', message)}", None, None
    if kind == "missing" and param is None:
        return "missing request body (a JSON object)", None, None
    if kind in ("missing", "extra_forbidden"):
        code = fields.MISSING if kind == "missing" else fields.UNKNOWN
        return fields.message_for(code, param or ""), param, code
    if kind in fields.CODES:  # raised by gateway/fields.py, naming a field below where its validator ran
        param = param_path([*first.get("loc", ()), *_split(str(context.get("param", "")))]) or ""
        return fields.message_for(kind, param, str(context.get("detail", ""))), param, kind
    shown = first.get("input")
    show = param and "got" not in message and not isinstance(shown, (dict, list))
    suffix = f" (got {shown!r})" if show else ""
    return (f"{param}: {message}{suffix}" if param else message), param, None


def _split(param: str) -> list[object]:
    """`content[1].type` as a location: ["content", 1, "type"]."""
    parts: list[object] = []
    for name in param.split("."):
        head, *indexes = name.replace("]", "").split("[")
        parts += [head, *(int(index) for index in indexes)]
    return [part for part in parts if part != ""]


def install_error_handlers(app: FastAPI) -> None:
    def count(request: Request, status: int) -> None:
        state = getattr(request.app.state, "gateway", None)
        if state is not None and state.metrics is not None:
            state.metrics.rejected.labels(str(status)).inc()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        count(request, exc.status_code)
        return JSONResponse(error_body(exc.status_code, exc.message, exc.param, exc.code),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        count(request, 400)
        message, param, code = _describe(exc)
        return JSONResponse(error_body(400, message, param, code), status_code=400)

    def unavailable(request: Request, what: str, cause: BaseException) -> JSONResponse:
        """An outage (what is away, and the error that says so), not a bug in the request: 503 and when to come
        back."""
        count(request, 503)
        logger.warning("%s unavailable: %s: %s", what, type(cause).__name__, cause)
        return JSONResponse(error_body(503, f"the {what} is unavailable ({type(cause).__name__}); retry shortly"),
                            status_code=503, headers={"Retry-After": "2"})

    @app.exception_handler(redis.RedisError)
    async def _redis_error(request: Request, exc: redis.RedisError) -> JSONResponse:
        """Redis busy or away."""
        return unavailable(request, "queue", exc)

    @app.exception_handler(DatabaseUnavailable)
    async def _database_error(request: Request, exc: DatabaseUnavailable) -> JSONResponse:
        """The database restarting, unreachable or locked past its timeout. A request is refused before anything
        of it was sent (its row is written first), so nothing is lost."""
        return unavailable(request, "database", exc.orig if exc.orig is not None else exc)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)
