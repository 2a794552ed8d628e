"""Graceful drain on SIGTERM/SIGINT: stop taking requests, let in-flight ones finish, exit 0.

uvicorn's own handling closes the listener at once and sse-starlette ends every
open stream on the first signal. Here the first signal only marks the gateway
draining: /readyz answers 503 (load balancers stop sending), new requests get
503 with Retry-After, and streams in flight run to their end. When none is
left, or after `gateway.drain_timeout_s`, the server stops as uvicorn would.
A second signal stops it at once. The signal is not re-raised afterwards, so a
drained gateway exits 0.
"""

from __future__ import annotations

import logging
import time
from types import FrameType

import uvicorn
from sse_starlette.sse import AppStatus

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.drain_timeout_s = drain_timeout_s
        self.drain_started: float | None = None
        AppStatus.disable_automatic_graceful_drain()  # streams end when we say so, not on the signal

    def _state(self):
        app = getattr(self.config, "loaded_app", None)  # set once uvicorn has imported the app
        while app is not None and not hasattr(getattr(app, "state", None), "gateway"):
            app = getattr(app, "app", None)  # through uvicorn's middleware wrappers to the FastAPI app
        return getattr(app.state, "gateway", None) if app is not None else None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        state = self._state()
        if self.drain_started is not None or state is None:  # a second signal, or nothing started yet
            logger.warning("signal %d %s: stopping now", sig, "while draining" if state is not None else
                           "before the gateway started")
            AppStatus.should_exit = True
            self.force_exit = self.should_exit
            self.should_exit = True
            return
        self.drain_started = time.monotonic()
        state.admission.drain()
        logger.info("draining: %d requests in flight, up to %.0fs", state.inflight, self.drain_timeout_s)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_started is not None and not self.should_exit:
            state = self._state()
            waited = time.monotonic() - self.drain_started
            if state is None or state.inflight == 0 or waited >= self.drain_timeout_s:
                if state is not None and state.inflight:
                    logger.warning("drain timeout: closing %d streams still in flight", state.inflight)
                logger.info("drained after %.1fs; stopping", waited)
                AppStatus.should_exit = True
                self.should_exit = True
        return await super().on_tick(counter)
