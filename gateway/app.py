"""The FastAPI application (`uvicorn gateway.app:create_app --factory`)."""

from __future__ import annotations

import asyncio
import gc
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI

from gateway.observability.access_log import AccessLog
from gateway.api.dashboard import install_dashboard
from gateway.errors import install_error_handlers
from gateway.observability.metrics import GatewayMetrics
from gateway.api.generation import router as generation_router
from gateway.admission.front_door import EarlyAdmission
from gateway.api.routes import router, set_gauges
from gateway.state import GatewayState, load_served_model
from services.celery_app import create_celery_app
from services.config import Settings, get_settings
from services.models.tokenization import encode_messages
from services.redis_conn import connect_async
from services.storage.db import init_db, session_factory

logger = logging.getLogger(__name__)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine = init_db(settings.database_url)
        state = GatewayState(
            settings=settings,
            # every streaming request holds a connection while it waits on its stream: size the pool for
            # the admission limit, and have a burst wait for a connection instead of failing
            redis=connect_async(settings.redis_url, max_connections=settings.gateway.max_inflight + 64,
                                pool_timeout_s=settings.gateway.redis_pool_timeout_s, retry_on_timeout=True),
            celery=create_celery_app(settings),
            db=session_factory(engine),
            model=load_served_model(settings),
            metrics=GatewayMetrics(),
        )
        app.state.gateway = state
        warm_up(state)
        # Everything loaded so far (the tokenizer, the chat template, the app's modules) lives as long as the process: out
        # of the collector's sight, a burst's garbage collections stop walking it (pauses of 100s of ms at once).
        gc.collect()
        gc.freeze()
        logger.info("gateway serving %s (context %d)%s", state.model.name, state.model.max_context,
                    f" as {state.gateway_id}, admission shared in Redis" if state.shared else "")
        background = [asyncio.create_task(task) for task in (
            state.admission.keep_lease() if state.shared else None,
            state.similarity_log.follow() if state.similarity_log is not None else None,
            keep_gauges(state) if state.metrics.multiprocess else None) if task is not None]
        try:
            yield
        finally:
            for task in background:
                task.cancel()
            if state.shared:
                await state.admission.leave()
            state.reads.close()
            await state.redis.aclose()
            engine.dispose()

    app = GatewayApp(title="Mirror-SD gateway", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    app.include_router(generation_router)
    app.include_router(router)
    install_dashboard(app)
    return app


class GatewayApp(FastAPI):
    """FastAPI with the access log and admission in front of its whole middleware stack: a refusal
    (gateway/admission/front_door.py) goes out before any of FastAPI's layers or a route runs, at the cost of a header
    lookup and a counter check."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._front = AccessLog(EarlyAdmission(super().__call__))

    async def __call__(self, scope, receive, send) -> None:
        scope["app"] = self  # as Starlette sets it: the layer finds the gateway's state through it
        await self._front(scope, receive, send)


def warm_up(state: GatewayState) -> None:
    """What a first request would otherwise pay on the event loop, in front of a burst behind it: compiling
    the chat template, the tokenizer's first call."""
    tokenizer = state.model.tokenizer
    if getattr(tokenizer, "chat_template", None):
        encode_messages(tokenizer, [{"role": "user", "content": "warm-up"}])
    tokenizer.encode("warm-up")


async def keep_gauges(state: GatewayState, every_s: float = 1.0) -> None:
    """One of several processes on a port: the scrape that another answers sums this one's gauges as of now."""
    while True:
        set_gauges(state)
        await asyncio.sleep(every_s)

