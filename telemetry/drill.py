"""A thermal drill: inject a temperature, time the routing change and the first request that follows it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import httpx
import msgpack
import redis

from services.protocol import probe_override_key
from telemetry.service import read_routing_table

logger = logging.getLogger(__name__)


@dataclass
class DrillResult:
    to_routing_change_s: float
    to_first_rerouted_request_s: float
    routing_version: int
    pool_weights: dict[str, float]
    first_rerouted_pool: str


def run_drill(client: redis.Redis, *, worker: str, temperature: float, url: str, model: str,
              api_key: str | None = None, timeout_s: float = 30.0) -> DrillResult:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    started = time.monotonic()
    client.set(probe_override_key(worker), msgpack.packb(
        {"temperature_c": temperature, "device_kind": "cuda", "expires_at": time.time() + 120}), ex=121)
    try:
        while True:
            table = read_routing_table(client)
            if table is not None and worker in table.hot_workers:
                changed = time.monotonic() - started
                break
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"routing did not react to {temperature} C on {worker} within {timeout_s}s")
            time.sleep(0.01)
        with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
            while True:  # until a request is routed by the new table (the gateway caches it briefly)
                body = http.post("/v1/completions", json={"model": model, "prompt": "Drill:", "max_tokens": 1,
                                                          "temperature": 0}).json()
                if body["mirror_sd"]["routing_version"] >= table.version:
                    rerouted = time.monotonic() - started
                    pool = body["mirror_sd"]["pool"]
                    break
                if time.monotonic() - started > timeout_s:
                    raise TimeoutError("no request was routed by the new table")
        return DrillResult(changed, rerouted, table.version, table.pool_weights, pool)
    finally:
        client.delete(probe_override_key(worker))
