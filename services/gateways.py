"""Several gateway processes on one port (`mirror-sd gateway --workers N`, `mirror-sd up --gateways N`).

Each process binds the port with SO_REUSEPORT, so the kernel spreads new connections over them, and each keeps
its own graceful drain (gateway/drain.py): SIGTERM to all of them drains all of them. They share what must be
shared through Redis: admission (gateway.shared_admission, gateway/admission/shared.py), single-flight and
similarity routing. Their Prometheus figures are summed over the processes (prometheus_client's multiprocess
mode, in a folder this group owns): a scrape of the port sees the host's totals whichever process answers.
One process is the plain single gateway of before: no SO_REUSEPORT, nothing shared, nothing changed.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def gateway_names(count: int) -> list[str]:
    """Child names: `gateway` alone, as before; gateway-1..N for several (the supervisor's stop order and
    `essential` go by the `gateway` prefix)."""
    return ["gateway"] if count == 1 else [f"gateway-{index}" for index in range(1, count + 1)]


@dataclass
class GatewayGroup:
    count: int
    metrics_dir: str | None = field(default=None)

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"gateways must be >= 1, got {self.count}")
        if self.count > 1 and self.metrics_dir is None:
            self.metrics_dir = tempfile.mkdtemp(prefix="mirror-sd-gateway-metrics-")

    def children(self, command: list[str], env: dict[str, str]) -> dict[str, tuple[list[str], dict[str, str]]]:
        """name -> (command, env) of each gateway process."""
        if self.count == 1:
            return {"gateway": (command, env)}
        shared = {**env, "MIRROR_SD_GATEWAY__SHARED_ADMISSION": "true", MULTIPROC_ENV: self.metrics_dir}
        return {name: ([*command, "--reuse-port"], shared) for name in gateway_names(self.count)}

    def on_change(self, child) -> None:
        """The supervisor's news of a child (services/supervisor.py Child, or None). A gateway process gone: its
        live gauges (requests in flight) stop counting; its counters stay in the sums, so totals never go down."""
        if self.metrics_dir is not None and child is not None and child.process is not None and not child.alive:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(child.process.pid, self.metrics_dir)

    def close(self) -> None:
        if self.metrics_dir is not None:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """Bound, not yet listening (uvicorn listens once the app has started: until then the kernel sends this
    port's connections to the processes already serving)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)
    sock.set_inheritable(False)
    logger.info("bound %s:%d with SO_REUSEPORT (pid %d)", host, port, os.getpid())
    return sock
