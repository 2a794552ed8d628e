"""Each fallback rule fires from heartbeat readings (pure: no Redis, no clock)."""

import pytest

from services.config import TelemetrySettings
from services.protocol import Heartbeat
from telemetry.rules import evaluate

CONFIG = TelemetrySettings()
NOW = 1000.0


def beat(worker_id, pool, **fields):
    defaults = {"role": "verify", "sent_at": NOW, "device_kind": "cuda" if pool == "gpu" else "cpu"}
    return Heartbeat(worker_id=worker_id, pool=pool, **{**defaults, **fields})


def kinds(events):
    return [e.kind for e in events]


def test_equal_workers_split_evenly_and_version_counts_changes():
    table, events = evaluate([beat("g", "gpu"), beat("c", "cpu")], None, CONFIG, NOW)
    assert table.pool_weights == {"cpu": 0.5, "gpu": 0.5} and table.version == 1
    assert kinds(events).count("worker_joined") == 2 and "routing_changed" in kinds(events)
    again, events = evaluate([beat("g", "gpu"), beat("c", "cpu")], table, CONFIG, NOW + 1)
    assert again.version == 1 and "routing_changed" not in kinds(events)


def test_profiles_weight_pools_by_measured_speed():
    table, _ = evaluate([beat("g", "gpu", profile={"verify_ms_1": 10.0}),
                         beat("c", "cpu", profile={"verify_ms_1": 40.0})], None, CONFIG, NOW)
    assert table.pool_weights == pytest.approx({"gpu": 0.8, "cpu": 0.2})


def test_hot_accelerator_moves_traffic_to_cpu_with_hysteresis():
    hot, events = evaluate([beat("g", "gpu", temperature_c=90.0), beat("c", "cpu")], None, CONFIG, NOW)
    assert hot.pool_weights == {"cpu": 1.0, "gpu": 0.0} and hot.hot_workers == ["g"]
    assert "thermal_on" in kinds(events)
    warm, _ = evaluate([beat("g", "gpu", temperature_c=83.0), beat("c", "cpu")], hot, CONFIG, NOW)
    assert warm.hot_workers == ["g"]  # 83 C is between cool (80) and hot (85): still hot
    cool, events = evaluate([beat("g", "gpu", temperature_c=79.0), beat("c", "cpu")], warm, CONFIG, NOW)
    assert cool.pool_weights == {"cpu": 0.5, "gpu": 0.5} and "thermal_off" in kinds(events)
    # A CPU at 90 C is not an accelerator: no thermal rule.
    cpu_hot, _ = evaluate([beat("g", "gpu"), beat("c", "cpu", temperature_c=95.0)], None, CONFIG, NOW)
    assert cpu_hot.hot_workers == []


def test_utilization_gap_rebalances():
    table, _ = evaluate([beat("g", "gpu", utilization=0.9), beat("c", "cpu", utilization=0.2)], None, CONFIG, NOW)
    assert table.pool_weights == pytest.approx({"gpu": 0.4, "cpu": 0.6})
    table, _ = evaluate([beat("g", "gpu", utilization=0.5), beat("c", "cpu", utilization=0.3)], None, CONFIG, NOW)
    assert table.pool_weights == {"gpu": 0.5, "cpu": 0.5}


def test_rejection_alert_latency_degrade_and_acceptance_fallback():
    beats = [beat("g", "gpu", num_draft_tokens=100, num_accepted_tokens=70, latency_p99_shared_ms=250.0),
             beat("c", "cpu", num_draft_tokens=100, num_accepted_tokens=20)]
    table, events = evaluate(beats, None, CONFIG, NOW)
    assert table.alerts == ["c", "g"] and kinds(events).count("rejection_alert") == 2
    assert table.degraded_pools == ["gpu"]
    assert table.ar_pools == ["cpu"]
    few = [beat("c", "cpu", num_draft_tokens=10, num_accepted_tokens=0)]
    assert evaluate(few, None, CONFIG, NOW)[0].ar_pools == []  # too little evidence yet


def test_a_slow_model_is_not_degraded_by_its_size_only_by_its_load():
    """A 1B target on a CPU takes ~300 ms a token unloaded: over the 200 ms budget, yet not degraded (capping its
    blocks at 2 would make each token slower); at over 3x its own forward, the load made it slow: degraded."""
    big = {"verify_ms_1": 300.0}
    unloaded, _ = evaluate([beat("c", "cpu", latency_p99_shared_ms=745.0, profile=big)], None, CONFIG, NOW)
    assert unloaded.degraded_pools == []
    loaded, _ = evaluate([beat("c", "cpu", latency_p99_shared_ms=905.0, profile=big)], None, CONFIG, NOW)
    assert loaded.degraded_pools == ["cpu"]
    small = {"verify_ms_1": 30.0}  # the built-in 135M target: the 200 ms budget is what binds
    assert evaluate([beat("c", "cpu", latency_p99_shared_ms=190.0, profile=small)], None, CONFIG,
                    NOW)[0].degraded_pools == []
    assert evaluate([beat("c", "cpu", latency_p99_shared_ms=210.0, profile=small)], None, CONFIG,
                    NOW)[0].degraded_pools == ["cpu"]
    strict = CONFIG.model_copy(update={"latency_over_unloaded": 1.0})
    assert evaluate([beat("c", "cpu", latency_p99_shared_ms=310.0, profile=big)], None, strict,
                    NOW)[0].degraded_pools == ["cpu"]


def test_a_lone_streams_slow_steps_do_not_degrade_its_pool():
    """One stream whose draft sits behind a 50 ms link: a few of its steps ran over 200 ms a token (a long block
    rejected early, a pause of the box), none shared with another session. Degrading the pool capped the next
    request's blocks at 2 tokens, the slowest way to serve it."""
    small = {"verify_ms_1": 41.0}
    lone = beat("c", "cpu", latency_p99_ms=260.0, latency_p99_shared_ms=None, profile=small)
    assert evaluate([lone], None, CONFIG, NOW)[0].degraded_pools == []
    shared = beat("c", "cpu", latency_p99_ms=260.0, latency_p99_shared_ms=240.0, profile=small)
    assert evaluate([shared], None, CONFIG, NOW)[0].degraded_pools == ["cpu"]


def test_missing_heartbeat_drops_the_worker():
    first, _ = evaluate([beat("g", "gpu"), beat("c", "cpu")], None, CONFIG, NOW)
    stale = [beat("g", "gpu", sent_at=NOW - 10), beat("c", "cpu", sent_at=NOW + 4)]
    table, events = evaluate(stale, first, CONFIG, NOW + 4)
    assert table.workers == ["c"] and table.pool_weights == {"cpu": 1.0}
    assert [e.worker_id for e in events if e.kind == "worker_dropped"] == ["g"]


def test_gateway_route_choice_follows_weights_and_rules():
    from gateway.errors import APIError
    from gateway.fleet.routing import choose_route
    from services.protocol import RoutingTable

    table = RoutingTable(version=3, pool_weights={"gpu": 0.75, "cpu": 0.25}, ar_pools=["cpu"],
                         degraded_pools=["gpu"])
    state: dict[str, float] = {}
    routes = [choose_route(table, default_pool="cpu", num_prompt_tokens=10, priority="normal", config=CONFIG,
                           wrr_state=state) for _ in range(8)]
    assert [r.pool for r in routes].count("gpu") == 6
    assert {(r.pool, r.route, r.max_draft_tokens) for r in routes} == {("gpu", "sd", 2), ("cpu", "ar", None)}
    with pytest.raises(APIError) as shed:
        for _ in range(4):
            choose_route(table, default_pool="cpu", num_prompt_tokens=10, priority="low", config=CONFIG,
                         wrr_state=state)
    assert shed.value.status_code == 503 and shed.value.headers == {"Retry-After": "5"}
    assert choose_route(None, default_pool="cpu", num_prompt_tokens=10, priority="low", config=CONFIG,
                        wrr_state={}).pool == "cpu"
    short = CONFIG.model_copy(update={"short_prompt_pool": "cpu"})
    assert choose_route(table, default_pool="gpu", num_prompt_tokens=10, priority="normal", config=short,
                        wrr_state={}).pool == "cpu"


def test_capacity_counts_what_a_worker_decodes_batched():
    from telemetry.rules import plain_capacity

    alone_only = {"verify_ms_1": 40.0}
    batched = {"verify_ms_1": 40.0, "step_ms_16x1": 100.0, "step_ms_16x5": 300.0, "step_ms_32x1": 250.0}
    assert plain_capacity(alone_only) == 25.0
    assert plain_capacity(batched) == 160.0  # 16 rows in 100 ms beats 1 in 40 and 32 in 250
    assert plain_capacity({}) is None
