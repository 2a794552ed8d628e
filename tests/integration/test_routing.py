"""Traffic follows the hardware: an injected 90 C on the accelerator pool moves new sessions to the CPU pool."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import httpx
import pytest

from services.protocol import ROUTING_TABLE_KEY, RoutingTable
from tests.integration.stack import Stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # the utilization rule off (a gap no two pools reach): these tests watch the thermal rule's weights, and a
    # cpu worker busy with the test's requests beside an idle gpu one made it move 0.1 of weight mid-test
    running = Stack(tmp_path_factory.mktemp("routing"), verify_pools=["gpu", "cpu"], telemetry=True, auth=False,
                    env={"MIRROR_SD_TELEMETRY__UTILIZATION_GAP": "1.0"}).start()
    yield running
    running.stop()


def cli(stack: Stack, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], env=stack.env, capture_output=True,
                          text=True, timeout=60)


def table(stack: Stack) -> RoutingTable | None:
    raw = stack.redis.get(ROUTING_TABLE_KEY)
    return RoutingTable.decode(raw) if raw else None


def wait_table(stack: Stack, condition, timeout_s: float = 10.0) -> RoutingTable:
    """The routing table once it meets `condition` (a liveness bound, not a speed check)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        current = table(stack)
        if current is not None and condition(current):
            return current
        time.sleep(0.05)
    raise AssertionError(f"routing table never met the condition: {table(stack)}")


def pools_used(stack: Stack, count: int) -> list[str]:
    pools = []
    for index in range(count):
        body = httpx.post(f"{stack.base_url}/v1/completions", timeout=60,
                          json={"model": "smollm2-135m", "prompt": f"Number {index}:", "max_tokens": 2,
                                "temperature": 0,
                                # a prompt seen before would go to its worker (cache affinity): the weights are
                                # what is tested here, so nothing is shared
                                "cache_salt": uuid.uuid4().hex}).json()
        pool = httpx.get(f"{stack.base_url}/v1/requests/{body['id']}").json()["pool"]
        assert body["mirror_sd"]["pool"] == pool
        pools.append(pool)
    return pools


def test_thermal_rule_moves_new_sessions_and_brings_them_back(stack):
    gpu_worker = next(w for w, pool in stack.verify_pool_of.items() if pool == "gpu")
    # This machine has no accelerator: the probe override makes the gpu-pool worker report as one.
    assert cli(stack, "telemetry", "inject", "--worker", gpu_worker, "--device-kind", "cuda",
               "--temperature", "60", "--for", "5m").returncode == 0
    before = wait_table(stack, lambda t: t.pool_weights.get("gpu", 0) > 0 and t.pool_weights.get("cpu", 0) > 0)
    time.sleep(0.6)
    used = pools_used(stack, 10)
    # Smooth weighted round-robin: 10 requests follow the weights to within one request.
    assert abs(used.count("gpu") - 10 * before.pool_weights["gpu"]) <= 1.5, (used, before.pool_weights)

    injected = cli(stack, "telemetry", "inject", "--worker", gpu_worker, "--device-kind", "cuda",
                   "--temperature", "90", "--for", "5m")
    assert injected.returncode == 0, injected.stderr
    hot = wait_table(stack, lambda t: gpu_worker in t.hot_workers)
    assert hot.pool_weights == {"cpu": 1.0, "gpu": 0.0}
    time.sleep(0.6)  # the gateway caches the table for 0.5 s
    assert pools_used(stack, 6) == ["cpu"] * 6

    cli(stack, "telemetry", "inject", "--worker", gpu_worker, "--device-kind", "cuda",
        "--temperature", "70", "--for", "5m")
    cooled = wait_table(stack, lambda t: not t.hot_workers)
    assert cooled.pool_weights["gpu"] > 0 and cooled.version > hot.version
    time.sleep(0.6)
    used = pools_used(stack, 10)
    assert abs(used.count("gpu") - 10 * cooled.pool_weights["gpu"]) <= 1.5, (used, cooled.pool_weights)

    from prometheus_client.parser import text_string_to_metric_families

    scraped = httpx.get(f"http://127.0.0.1:{stack.telemetry_port}/metrics").text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(scraped) for s in family.samples}
    assert samples[("mirror_sd:routing_pool_weight", (("pool", "gpu"),))] > 0
    assert samples[("mirror_sd:routing_table_version", ())] >= cooled.version
    assert samples[("mirror_sd:telemetry_events_total", (("kind", "thermal_on"),))] >= 1
    assert samples[("mirror_sd:telemetry_events_total", (("kind", "thermal_off"),))] >= 1

    status = cli(stack, "status")
    assert status.returncode == 0 and gpu_worker in status.stdout and "routing v" in status.stdout


def test_killed_worker_leaves_the_routing_table(stack):
    cpu_worker = next(w for w, pool in stack.verify_pool_of.items() if pool == "cpu")
    wait_table(stack, lambda t: cpu_worker in t.workers)
    stack.kill(cpu_worker)
    # gone once its heartbeat (TTL 3 s) lapsed and the next telemetry tick ran: waited for, not timed
    wait_table(stack, lambda t: cpu_worker not in t.workers, timeout_s=30)
    stack.spawn_verify(cpu_worker)
    wait_table(stack, lambda t: cpu_worker in t.workers, timeout_s=120)


def test_drill_reports_time_to_reroute(stack):
    gpu_worker = next(w for w, pool in stack.verify_pool_of.items() if pool == "gpu")
    wait_table(stack, lambda t: not t.hot_workers and len(t.workers) == 2, timeout_s=30)
    time.sleep(0.6)
    drill = cli(stack, "telemetry", "drill", "--worker", gpu_worker, "--url", stack.base_url)
    assert drill.returncode == 0, drill.stderr
    print(drill.stdout)  # the figures for the closing note: pytest -s tests/integration/test_routing.py
    assert "first request on pool 'cpu'" in drill.stdout
    assert stack.redis.get(f"mirror-sd:probe-override:{gpu_worker}") is None  # the drill cleans up
