"""A thermal drill: inject a temperature, time the routing change and the first request that follows it,
hold the heat a while (so a dashboard shows it), then clear it and time the way back."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import msgpack
import redis

from services.pools import ACCELERATORS
from services.protocol import Heartbeat, RoutingTable, heartbeat_key, probe_override_key
from services.redis_client import read_routing_table

logger = logging.getLogger(__name__)


@dataclass
class DrillResult:
    to_routing_change_s: float
    to_first_rerouted_request_s: float
    routing_version: int
    pool_weights: dict[str, float]
    first_rerouted_pool: str
    to_recovery_s: float | None = None  # from clearing the override to the worker leaving hot_workers
    recovered_weights: dict[str, float] | None = None


def _device_kind(client: redis.Redis, worker: str) -> str:
    """Keep the kind a declared accelerator already reports (--device-kind accelerator); anything else is
    reported as cuda for the drill, since the thermal rule only watches accelerators."""
    raw = client.get(heartbeat_key(worker))
    if raw is None:
        raise TimeoutError(f"no heartbeat from worker {worker!r}; see `mirror-sd status` for the ids")
    kind = Heartbeat.decode(raw).device_kind
    return kind if kind in ACCELERATORS else "cuda"


def _wait_table(client: redis.Redis, condition: Callable[[RoutingTable], bool], timeout_s: float,
                what: str) -> RoutingTable:
    deadline = time.monotonic() + timeout_s
    while True:
        table = read_routing_table(client)
        if table is not None and condition(table):
            return table
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s:.0f}s")
        time.sleep(0.01)


def run_drill(client: redis.Redis, *, worker: str, temperature: float, url: str, model: str,
              api_key: str | None = None, timeout_s: float = 30.0, hold_s: float = 0.0,
              recover: bool = True) -> DrillResult:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    kind = _device_kind(client, worker)
    started = time.monotonic()
    client.set(probe_override_key(worker), msgpack.packb(
        {"temperature_c": temperature, "device_kind": kind, "expires_at": time.time() + 120 + hold_s}),
        ex=int(121 + hold_s))
    try:
        table = _wait_table(client, lambda t: worker in t.hot_workers, timeout_s,
                            f"routing did not react to {temperature} C on {worker}")
        changed = time.monotonic() - started
        with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
            while True:  # until a request is routed by the new table (the gateway caches it briefly)
                answer = http.post("/v1/completions", json={"model": model, "prompt": "Drill:", "max_tokens": 1,
                                                            "temperature": 0})
                body = answer.json() if answer.status_code == 200 else None
                if body is not None and body["mirror_sd"]["routing_version"] >= table.version:
                    rerouted = time.monotonic() - started
                    pool = body["mirror_sd"]["pool"]
                    break
                if time.monotonic() - started > timeout_s:
                    why = f" (last answer: HTTP {answer.status_code} {answer.text[:200]})" if body is None else ""
                    raise TimeoutError(f"no request was routed by the new table{why}")
                if body is None:  # 503 while the stack warms up or sheds load: as a client would, wait a little
                    time.sleep(min(1.0, float(answer.headers.get("Retry-After", 1))))
        result = DrillResult(changed, rerouted, table.version, table.pool_weights, pool)
        time.sleep(hold_s)
    finally:
        client.delete(probe_override_key(worker))
    if recover:
        cleared = time.monotonic()
        back = _wait_table(client, lambda t: worker not in t.hot_workers, timeout_s,
                           f"{worker} did not leave the hot list after the override was cleared")
        result.to_recovery_s = time.monotonic() - cleared
        result.recovered_weights = back.pool_weights
    return result
