"""The fleet views: `GET /v1/telemetry` (table, live workers, events), `GET /v1/dashboard` (what the
dashboard page polls each second) and the page itself at `/dashboard`.

Auth: the JSON endpoints take an API key exactly like every other /v1 endpoint (none with
`gateway.auth_disabled`). The page and its assets are static files holding no data, so they
are served without a key: the page asks for one when /v1/dashboard answers 401 and keeps it
in the tab's sessionStorage. The snapshot is built at most every SNAPSHOT_CACHE_S per gateway,
so any number of open dashboards cost one Redis scan and one SQL read per half second.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from gateway.admission.auth import Caller, authenticate
from gateway.fleet.routing import current_table
from gateway.state import GatewayState
from gateway.fleet.workers import live_workers
from services.protocol import CHILDREN_KEY, ROUTING_HISTORY_KEY, Heartbeat, RoutingTable
from services.redis_client import decode_children
from services.storage import crud

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
SNAPSHOT_CACHE_S = 0.5
HISTORY_WINDOW_S = 300.0  # the weights chart's span
NUM_EVENTS = 15
# Same-origin only: no CDN, no inline script; the page talks to this gateway alone.
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
                "Cache-Control": "no-cache"}
WORKER_FIELDS = ("worker_id", "role", "pool", "model", "device_kind", "utilization", "memory_used_frac",
                 "temperature_c", "num_sessions", "kv_cache_bytes", "queue_depth", "latency_p50_ms",
                 "latency_p99_ms", "batch_rows", "overridden", "local_draft", "local_turns")

router = APIRouter()


async def recent_events(state: GatewayState, limit: int) -> list[dict]:
    def read() -> list[dict]:
        with state.db() as session:
            return [{"at": e.created_at.isoformat(), "kind": e.kind, "worker_id": e.worker_id,
                     "request_id": e.request_id, "detail": e.detail}
                    for e in crud.list_events(session=session, limit=limit)]

    return await asyncio.to_thread(read)


def worker_view(beat: Heartbeat, table: RoutingTable | None, now: float) -> dict:
    """A heartbeat without its start-up profile (large, and static), plus what the table says of it."""
    view = {name: getattr(beat, name) for name in WORKER_FIELDS}
    view.update(acceptance_rate=beat.acceptance_rate, age_s=round(now - beat.sent_at, 2),
                draft_fallback=beat.draft_fallback.to_wire() if beat.draft_fallback else None,
                link=beat.link.to_wire() if beat.link is not None else None,  # a draft worker's, as it measures it
                hot=bool(table and beat.worker_id in table.hot_workers),
                alert=bool(table and beat.worker_id in table.alerts))
    return view


def history_view(raw: list[bytes], now: float) -> list[dict]:
    """Routing versions inside the chart's window, oldest first, plus the last one before it (where the
    chart's lines start)."""
    tables = sorted((RoutingTable.decode(item) for item in raw), key=lambda t: t.version)
    inside = [t for t in tables if t.updated_at >= now - HISTORY_WINDOW_S]
    before = [t for t in tables if t.updated_at < now - HISTORY_WINDOW_S][-1:]
    return [{"t": t.updated_at, "version": t.version, "pool_weights": t.pool_weights,
             "hot_workers": t.hot_workers} for t in before + inside]


async def build_snapshot(state: GatewayState) -> dict:
    now = time.time()
    table = await current_table(state)
    beats = sorted(await live_workers(state, fresh=True), key=lambda b: (b.role, b.pool, b.worker_id))
    history = await state.redis.lrange(ROUTING_HISTORY_KEY, 0, -1)
    live = state.metrics.live
    return {
        "now": now,
        "window_s": HISTORY_WINDOW_S,
        "gateway": {"model": state.model.name, "inflight": state.inflight,
                    "max_inflight": state.settings.gateway.max_inflight,
                    "fallback_pool": state.settings.telemetry.fallback_pool},
        "routing": table.to_dict() if table else None,
        "routing_history": history_view(history, now),
        "workers": [worker_view(beat, table, now) for beat in beats],
        "children": [child.to_dict() for child in decode_children(await state.redis.hgetall(CHILDREN_KEY))],
        "summary": live.summary(now=now),
        "throughput": live.series(60, now=now),
        "acceptance_per_position": live.acceptance_per_position(),
        "events": await recent_events(state, NUM_EVENTS),
    }


@router.get("/v1/telemetry")
async def telemetry(request: Request, caller: Caller = Depends(authenticate)) -> dict:
    """The current routing table, live workers and recent events."""
    state: GatewayState = request.app.state.gateway
    table = await current_table(state)
    return {
        "routing": table.to_dict() if table else None,
        "workers": [beat.to_dict() for beat in await live_workers(state, fresh=True)],
        "events": await recent_events(state, 50),
    }


@router.get("/v1/dashboard")
async def dashboard_data(request: Request, caller: Caller = Depends(authenticate)) -> dict:
    """Everything the dashboard shows, in one call (polled about once a second)."""
    state: GatewayState = request.app.state.gateway
    return await state.dashboard_cache.get(lambda: build_snapshot(state))


@router.get("/dashboard", include_in_schema=False)
async def dashboard_page() -> FileResponse:
    return FileResponse(STATIC_DIR / "dashboard.html", media_type="text/html", headers=PAGE_HEADERS)


def install_dashboard(app: FastAPI) -> None:
    app.include_router(router)
    app.mount("/dashboard/static", StaticFiles(directory=STATIC_DIR), name="dashboard-static")
