"""What tools and operators probe: /health (vLLM's and guidellm's), /version, /v1/models, and how /readyz,
/metrics and the dashboard show a draft worker serving with a fallback and a child of `mirror-sd up` that failed.

A real gateway app over real Redis and SQL; heartbeats and the supervisor's child states are written as the
workers and `mirror-sd up` write them."""

from __future__ import annotations

import pytest
import redis
from fastapi.testclient import TestClient

from gateway.app import create_app
from services import __version__
from services.config import Settings
from services.protocol import CHILDREN_KEY, ChildStatus, DraftFallback, Heartbeat, heartbeat_key
from services.storage.db import init_db

FALLBACK = DraftFallback(draft="suffix:gguf:smollm2-135m", fault="SIGSEGV", serving="suffix",
                         reason="llama.cpp crashed with SIGSEGV in llama_decode (build uses AMX_INT8, AVX2)")


@pytest.fixture
def gateway(tmp_path, redis_url):
    client = redis.Redis.from_url(redis_url)
    database_url = f"sqlite:///{tmp_path / 'health.db'}"
    init_db(database_url)
    settings = Settings(redis_url=redis_url, database_url=database_url,
                        gateway={"auth_disabled": True})
    with TestClient(create_app(settings)) as http:
        yield client, http


def beat(client: redis.Redis, worker_id: str, role: str, **fields) -> None:
    client.set(heartbeat_key(worker_id), Heartbeat(worker_id=worker_id, role=role, pool="cpu", **fields).encode(),
               px=30_000)


def test_health_answers_503_until_the_fleet_can_serve_then_200(gateway):
    client, http = gateway
    unavailable = http.get("/health")
    assert unavailable.status_code == 503
    assert unavailable.json()["status"] == "unavailable" and unavailable.json()["draft_workers"] == 0
    assert http.get("/healthz").status_code == 200  # alive, whatever the fleet
    beat(client, "verify-cpu-0", "verify")
    beat(client, "draft-cpu", "draft")
    assert http.get("/health").status_code == 200 and http.get("/health").json() == {"status": "ok"}
    assert http.get("/version").json() == {"version": __version__}
    model = http.get("/v1/models").json()["data"][0]
    assert model["id"] == "smollm2-135m" and model["max_model_len"] == 8192


def test_a_draft_fallback_and_a_failed_child_show_in_readyz_metrics_and_the_dashboard(gateway):
    client, http = gateway
    beat(client, "verify-cpu-0", "verify")
    beat(client, "draft-cpu", "draft", model="suffix", draft_fallback=FALLBACK)
    children = [ChildStatus(name="draft-worker", state="running", pid=41, restarts=2, last_exit="SIGSEGV",
                            fallback="draft suffix instead of suffix:gguf:smollm2-135m"),
                ChildStatus(name="verify-cpu-1", state="failed", restarts=5, failures=6, last_exit="exit code 3",
                            detail="verify-cpu-1 exited 6 times in a row within 30s of starting")]
    client.hset(CHILDREN_KEY, mapping={child.name: child.encode() for child in children})

    ready = http.get("/readyz")
    assert ready.status_code == 200  # a fallback serves: ready, and says so
    body = ready.json()
    assert body["draft_fallbacks"] == [{"worker": "draft-cpu", **FALLBACK.to_wire()}]
    assert body["failed_children"] == [{"name": "verify-cpu-1", "last_exit": "exit code 3",
                                        "detail": children[1].detail}]

    metrics = http.get("/metrics").text
    assert ('mirror_sd:draft_fallback{draft="suffix:gguf:smollm2-135m",fault="SIGSEGV",serving="suffix",'
            'worker="draft-cpu"} 1.0') in metrics
    assert 'mirror_sd:child_state{child="verify-cpu-1",state="failed"} 1.0' in metrics
    assert 'mirror_sd:child_state{child="draft-worker",state="failed"} 0.0' in metrics
    assert 'mirror_sd:child_restarts{child="draft-worker"} 2.0' in metrics

    snap = http.get("/v1/dashboard").json()
    draft = next(w for w in snap["workers"] if w["worker_id"] == "draft-cpu")
    assert draft["draft_fallback"]["reason"] == FALLBACK.reason and draft["model"] == "suffix"
    verify = next(w for w in snap["workers"] if w["worker_id"] == "verify-cpu-0")
    assert verify["draft_fallback"] is None
    assert {c["name"]: c["state"] for c in snap["children"]} == {"draft-worker": "running",
                                                                  "verify-cpu-1": "failed"}
