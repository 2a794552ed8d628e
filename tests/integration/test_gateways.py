"""Several gateways, as real processes over real HTTP and real Redis: `mirror-sd gateway --workers 2`, two
processes on one port. A client's connection stays with the process that accepted it, so each test pins clients
to one process or the other (by the id /readyz names) and plays them against each other: admission is shared
(max_inflight 2 in all), a request started on one is looked up, merged into and cancelled through the other,
/metrics sums both, and SIGTERM drains both, exit 0, out of the shared count.

Requests are held in flight by having the draft worker take no session task for a while: their sessions wait,
queued, for as long as the test needs, whatever the machine's speed."""

from __future__ import annotations

import signal
import time
from contextlib import ExitStack, contextmanager

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.gateway_client import DONE
from services.protocol import GATEWAYS_KEY, draft_queue
from tests.integration.stack import Stack, sse_events

pytestmark = pytest.mark.slow

MODEL = "random:tiny"  # a chat template, and nothing to load


@pytest.fixture(scope="module")
def gateways(tmp_path_factory):
    """(the stack, the ids of its two gateway processes)."""
    root = tmp_path_factory.mktemp("gateways")
    stack = Stack(root, verify_workers=1, auth=False, gateway_args=("--workers", "2"), env={
        "MIRROR_SD_TARGET": MODEL, "MIRROR_SD_DRAFT": "ngram", "MIRROR_SD_CACHE_DIR": str(root / "cache"),
        "MIRROR_SD_GATEWAY__MAX_INFLIGHT": "2",
        "MIRROR_SD_GATEWAY__TIER_SHARE": '{"high": 1.0, "normal": 1.0, "low": 1.0}'})  # 2 for every tier
    try:
        stack.start()
        yield stack, sorted(answering(stack.base_url, 2))
    finally:
        stack.stop()


def answering(url: str, count: int, timeout_s: float = 120) -> set[str]:
    """The ids of `count` gateway processes answering /readyz on `url` (a new connection each time: the kernel
    spreads them over the processes)."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while len(seen) < count:
        assert time.monotonic() < deadline, f"only {seen} answered on {url}"
        try:
            seen.add(httpx.get(f"{url}/readyz", timeout=2).json()["gateway"])
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    return seen


def pinned(clients: ExitStack, url: str, gateway_id: str) -> httpx.Client:
    """A client whose one connection the process `gateway_id` accepted."""
    for _ in range(200):
        client = httpx.Client(base_url=url, timeout=60, limits=httpx.Limits(max_connections=1))
        if client.get("/readyz").json().get("gateway") == gateway_id:
            clients.callback(client.close)
            return client
        client.close()
    raise AssertionError(f"no connection reached {gateway_id}")


def chat(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say yes."}], "max_tokens": 50,
            "temperature": 0, "ignore_eos": True, **extra}


@contextmanager
def draft_paused(stack: Stack):
    """The draft worker takes no session task meanwhile (Celery's cancel_consumer): new requests wait, queued."""
    from services.celery_app import create_celery_app
    from services.config import Settings

    control = create_celery_app(Settings(redis_url=stack.redis_url)).control
    queue = draft_queue(stack.pool)
    assert control.cancel_consumer(queue, reply=True, limit=1, timeout=30)
    try:
        yield
    finally:
        assert control.add_consumer(queue, reply=True, limit=1, timeout=30)


def open_stream(clients: ExitStack, client: httpx.Client, body: dict) -> tuple[str, object]:
    """A streaming chat answer, open (its slot held) once its first chunk is in: (request id, its chunks). Keep
    the chunks: a reader dropped closes its connection, and the gateway takes the client for gone."""
    response = clients.enter_context(client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}))
    assert response.status_code == 200, response.read()
    chunks = (chunk for chunk in sse_events(response) if chunk != DONE)
    return next(chunks)["id"], chunks


def served(client: httpx.Client, timeout_s: float = 60) -> httpx.Response:
    """A short answer, once a slot is free (a client that left gives its slot back as its gateway notices)."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = client.post("/v1/chat/completions", json=chat(max_tokens=4))
        if response.status_code != 503 or time.monotonic() > deadline:
            return response
        time.sleep(0.1)


def test_two_in_flight_on_one_gateway_fill_the_limit_on_the_other(gateways):
    stack, (one, other) = gateways
    with ExitStack() as clients:
        with draft_paused(stack):
            held = [open_stream(clients, pinned(clients, stack.base_url, one), chat(cache_salt=salt))
                    for salt in ("a", "b")]  # (their chunks kept: a reader dropped would close its stream)
            refused = pinned(clients, stack.base_url, other).post("/v1/chat/completions", json=chat())
        assert refused.status_code == 503, refused.text
        assert int(refused.headers["Retry-After"]) >= 1 and refused.json()["error"]["code"] == "overloaded"
        assert len(held) == 2
    with httpx.Client(base_url=stack.base_url, timeout=60) as client:
        assert served(client).status_code == 200  # the two gave their slots back when their clients left


def test_a_request_on_one_gateway_is_looked_up_merged_into_and_cancelled_through_the_other(gateways):
    stack, (one, other) = gateways
    with ExitStack() as clients:
        here, there = pinned(clients, stack.base_url, one), pinned(clients, stack.base_url, other)
        with draft_paused(stack):
            leader, chunks = open_stream(clients, pinned(clients, stack.base_url, one), chat(cache_salt="shared"))
            follower, follower_chunks = open_stream(clients, pinned(clients, stack.base_url, other),
                                                    chat(cache_salt="shared"))
            looked_up = there.get(f"/v1/requests/{leader}").json()
            merged = here.get(f"/v1/requests/{follower}").json()
            deleted = there.delete(f"/v1/requests/{leader}").json()
            finish = [chunk["choices"][0]["finish_reason"] for chunk in chunks]  # its answer ends, none generated
        follower_finish = [chunk["choices"][0]["finish_reason"] for chunk in follower_chunks]
        after = there.get(f"/v1/requests/{leader}").json()  # the worker's records never undo its client's cancel
    assert looked_up["id"] == leader and looked_up["status"] == "queued"
    assert merged["params"]["merged_into"] == leader  # an identical request on the other gateway: one generation
    assert deleted["cancelled"] is True and finish[-1] == "cancelled" and after["status"] == "cancelled"
    assert follower_finish[-1] in ("length", "stop")  # its client still reading: the generation went on for it


def requests_finished(client: httpx.Client) -> float:
    families = text_string_to_metric_families(client.get("/metrics").text)
    return sum(sample.value for family in families if family.name == "mirror_sd:requests"
               for sample in family.samples if sample.name == "mirror_sd:requests_total")


def test_a_scrape_of_either_process_sums_both(gateways):
    stack, (one, other) = gateways
    with ExitStack() as clients:
        here, there = pinned(clients, stack.base_url, one), pinned(clients, stack.base_url, other)
        before = requests_finished(here)
        assert served(here).status_code == 200 and served(there).status_code == 200
        scrapes = [requests_finished(here), requests_finished(there)]
    assert scrapes[0] == scrapes[1] >= before + 2  # (more: the last test's answers, if one ended late)


def test_sigterm_drains_both_processes_and_they_leave_the_shared_count(gateways):
    stack, ids = gateways
    assert {member.decode() for member in stack.redis.zrange(GATEWAYS_KEY, 0, -1)} == set(ids)
    parent = stack.processes["gateway"]
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=60) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{stack.base_url}/healthz", timeout=5)
    assert stack.redis.zcard(GATEWAYS_KEY) == 0
