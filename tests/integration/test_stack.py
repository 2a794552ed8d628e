"""The distributed suite end to end: real Redis, real worker processes, real HTTP."""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from services.engine import GenerationOptions, generate
from services.models.drafters import DraftSource
from services.models.tokenization import encode_prompt
from services.protocol import DRAFT_TIMING_KEY
from tests.integration.stack import Stack, sse_events

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    running = Stack(tmp_path_factory.mktemp("stack")).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(stack):
    key = stack.create_key("normal")
    with httpx.Client(base_url=stack.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=180) as http:
        yield http


@pytest.fixture(scope="module")
def reference(builtin_target):
    cache: dict[tuple, list[int]] = {}

    def target_only(prompt: str, *, chat: bool, max_tokens: int = MAX_TOKENS) -> list[int]:
        key = (prompt, chat, max_tokens)
        if key not in cache:
            prompt_ids = encode_prompt(builtin_target.tokenizer, prompt, chat=chat)
            cache[key] = generate(builtin_target, DraftSource("none"), prompt_ids,
                                  GenerationOptions(max_new_tokens=max_tokens)).token_ids
        return cache[key]

    return target_only


def chat_body(prompt: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "return_token_ids": True, **extra}


def iter_sse(response: httpx.Response):
    """Each `data:` payload, parsed; the final "[DONE]" as a string."""
    return sse_events(response)


def read_sse(response: httpx.Response) -> list[dict | str]:
    return list(iter_sse(response))


def pick(dev_prompts: list[dict], count: int) -> list[dict]:
    open_prompts = [p for p in dev_prompts if p["context_chars"] == 0][:count]
    grounded = sorted((p for p in dev_prompts if p["context_chars"] > 0), key=lambda p: len(p["prompt"]))[:count]
    return open_prompts + grounded


def test_health_models_and_readiness(stack, client):
    assert httpx.get(f"{stack.base_url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{stack.base_url}/readyz").json()
    assert ready["ready"] and ready["draft_workers"] == 1 and ready["verify_workers"] == 2
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    # device profiles measured at start-up travel in the heartbeats: the verify cost curve, the draft cost
    assert all(beat.profile[f"verify_ms_{n}"] > 0 for beat in stack.heartbeats("verify") for n in range(1, 10))
    assert all(beat.profile["draft_ms_per_token"] > 0 for beat in stack.heartbeats("draft"))


def test_greedy_over_http_equals_target_only(stack, client, reference, dev_prompts):
    for record in pick(dev_prompts, 3):
        response = client.post("/v1/chat/completions", json=chat_body(record["prompt"]))
        assert response.status_code == 200, response.text
        body = response.json()
        expected = reference(record["prompt"], chat=True)
        choice = body["choices"][0]
        assert choice["token_ids"] == expected, record["id"]
        assert body["usage"]["completion_tokens"] == len(expected)
        assert body["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
        assert set(body["mirror_sd"]) >= {"num_drafts", "num_draft_tokens", "num_accepted_tokens",
                                          "mean_acceptance_length"}
    # the draft worker pipelines: grounded prompts accept whole blocks, so speculated blocks were sent
    timing = {k.decode(): float(v) for k, v in stack.redis.hgetall(DRAFT_TIMING_KEY).items()}
    assert 0 < timing["speculation_hits"] <= timing["speculations"]


def test_n_greedy_choices_are_the_target_only_answer_each_and_one_generation(stack, client, reference):
    prompt = "Name three rivers of Europe."
    response = client.post("/v1/chat/completions", json=chat_body(prompt, n=3))
    assert response.status_code == 200, response.text
    body = response.json()
    expected = reference(prompt, chat=True)
    assert [choice["index"] for choice in body["choices"]] == [0, 1, 2]
    assert all(choice["token_ids"] == expected for choice in body["choices"])
    assert body["usage"]["completion_tokens"] == 3 * len(expected)
    merged = [stats["merged_into"] for stats in body["mirror_sd"]["choices"]]
    assert merged[0] is None and merged[1:] == [body["id"]] * 2  # the other two read the first's generation


def test_n_sampled_streamed_choices_carry_their_index_and_usage_sums_them(stack, client, builtin_target):
    body = chat_body("Write a haiku about rain.", n=2, stream=True, stream_options={"include_usage": True},
                     temperature=1.0, seed=11)
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        events = read_sse(response)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    usage = [event for event in events[:-1] if not event["choices"]]
    chunks = [event for event in events[:-1] if event["choices"]]
    texts, finals = {0: "", 1: ""}, {}
    for chunk in chunks:
        choice = chunk["choices"][0]
        texts[choice["index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"] is not None:
            finals[choice["index"]] = choice["token_ids"]
    assert sorted(finals) == [0, 1]
    for index in (0, 1):  # each choice's deltas are its own tokens' text: no chunk went to the other choice
        assert texts[index] == builtin_target.tokenizer.decode(finals[index], skip_special_tokens=True)
    assert len(usage) == 1 and usage[0]["usage"]["completion_tokens"] == sum(map(len, finals.values()))
    sessions = [stats["request_id"] for stats in usage[0]["mirror_sd"]["choices"]]
    assert len(set(sessions)) == 2  # a session each: seeds 11 and 12


def test_streaming_equals_target_only(stack, client, reference, builtin_target, dev_prompts):
    for record in pick(dev_prompts, 2):
        body = chat_body(record["prompt"], stream=True, stream_options={"include_usage": True})
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = read_sse(response)
        assert events[-1] == "[DONE]"
        chunks = [e for e in events[:-1] if e["choices"]]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        expected = reference(record["prompt"], chat=True)
        assert chunks[-1]["choices"][0]["token_ids"] == expected
        assert text == builtin_target.tokenizer.decode(expected, skip_special_tokens=True)
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        usage = events[-2]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(expected)


def test_completions_endpoint_plain_prompt(stack, client, reference, builtin_target):
    prompt = "The three primary colors are"
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 16,
                                                     "temperature": 0, "return_token_ids": True})
    body = response.json()
    expected = reference(prompt, chat=False, max_tokens=16)
    assert body["choices"][0]["token_ids"] == expected
    assert body["choices"][0]["text"] == builtin_target.tokenizer.decode(expected, skip_special_tokens=True)
    assert body["object"] == "text_completion" and body["choices"][0]["finish_reason"] == "length"


def test_eight_concurrent_requests_are_all_correct(stack, client, reference, dev_prompts):
    prompts = [p["prompt"] for p in pick(dev_prompts, 4)]
    assert len(prompts) == 8

    def ask(prompt):
        return client.post("/v1/chat/completions", json=chat_body(prompt, max_tokens=16)).json()

    with ThreadPoolExecutor(max_workers=8) as pool:
        bodies = list(pool.map(ask, prompts))
    for prompt, body in zip(prompts, bodies):
        assert "choices" in body, body
        assert body["choices"][0]["token_ids"] == reference(prompt, chat=True, max_tokens=16)


@pytest.mark.parametrize(
    "payload, status, fragment",
    [
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens must be >= 1, got 0"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 100000}, 400, "max_tokens must be <= 4096, got 100000"),
        ({"model": MODEL}, 400, "missing required field 'prompt'"),
        ({"model": "gpt-9", "prompt": "hi"}, 404, "model 'gpt-9' does not exist"),
        ({"model": MODEL, "prompt": "word " * 9000, "max_tokens": 4}, 400, "does not fit"),
        ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
        ({"model": MODEL, "prompt": "hi", "n": 17}, 400, "n: Input should be less than or equal to 16 (got 17)"),
        ({"model": MODEL, "prompt": [999999]}, 400, "outside the vocabulary"),
    ],
)
def test_bad_input_gets_a_clear_4xx(stack, client, payload, status, fragment):
    response = client.post("/v1/completions", json=payload)
    assert response.status_code == status, response.text
    assert fragment in response.json()["error"]["message"]


def test_malformed_json_and_bad_keys(stack, client):
    response = client.post("/v1/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert response.status_code == 400 and "malformed JSON" in response.json()["error"]["message"]
    for headers in ({}, {"Authorization": "Bearer msd-not-a-key"}, {"Authorization": "Basic abc"}):
        response = httpx.post(f"{stack.base_url}/v1/completions", json={"model": MODEL, "prompt": "hi"},
                              headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"


def test_workers_survive_bad_input(stack, client):
    """Every bad request above was refused at the gateway; bad wire messages are dropped by the workers."""
    import msgpack

    from services.protocol import verify_pool_queue

    for raw in (b"garbage", msgpack.packb({"v": 99, "kind": "draft_block", "body": {}}), b"\x00" * (9 << 20)):
        stack.redis.rpush(verify_pool_queue("cpu"), raw)
    wait_for(lambda: stack.redis.llen(verify_pool_queue("cpu")) == 0)
    assert all(process.poll() is None for process in stack.processes.values())
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4,
                                                     "temperature": 0})
    assert response.status_code == 200


def wait_for(condition, timeout_s: float = 15.0, interval_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError("condition not met in time")


def sessions_held(stack) -> int:
    return sum(beat.num_sessions for beat in stack.heartbeats("verify"))


def test_delete_cancels_and_frees_the_kv_cache(stack, client):
    body = chat_body("Write a long story about a dragon.", max_tokens=400, ignore_eos=True, stream=True)
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        events = []
        for event in iter_sse(response):
            events.append(event)
            if len(events) == 3:
                wait_for(lambda: sessions_held(stack) > 0)
                deleted = client.delete(f"/v1/requests/{events[0]['id']}")
                assert deleted.status_code == 200 and deleted.json()["cancelled"] is True
    request_id = events[0]["id"]
    final = [e for e in events[:-1] if e["choices"]][-1]["choices"][0]
    assert final["finish_reason"] == "cancelled" and events[-1] == "[DONE]"
    wait_for(lambda: sessions_held(stack) == 0)
    status = wait_for(lambda: (lambda s: s if s["status"] == "cancelled" else None)(
        client.get(f"/v1/requests/{request_id}").json()))
    assert status["finish_reason"] == "cancelled" and status["completion_tokens"] < 400
    # Deleting again is harmless.
    assert client.delete(f"/v1/requests/{request_id}").json()["cancelled"] is False


def test_client_disconnect_cancels_the_session(stack, client):
    body = chat_body("Write a long story about a castle.", max_tokens=400, ignore_eos=True, stream=True)
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        request_id = None
        for event in iter_sse(response):
            request_id = event["id"]
            if event["choices"] and event["choices"][0]["delta"].get("content"):
                break  # the first text: the session is under way (waiting for a heartbeat to say so let a
                # fast box finish all 400 tokens before the close)
    # The connection is closed here, mid-stream.
    status = wait_for(lambda: (lambda s: s if s["status"] in ("finished", "failed", "cancelled") else None)(
        client.get(f"/v1/requests/{request_id}").json()))
    assert status["status"] == "cancelled" and status["completion_tokens"] < 400, status
    wait_for(lambda: sessions_held(stack) == 0)


def test_the_request_record_counts_the_tokens_its_client_got(stack, client, dev_prompts):
    """The request's row (`GET /v1/requests/{id}`) counts what the client got, as its usage does: the target
    commits the EOS, and a block's tokens past a stop string, which the output leaves out (the row read 24 on the
    plain route and 26 on the speculative one for this prompt's 23 tokens)."""
    prompt = next(p for p in dev_prompts if p["id"] == "self_instruct:user_oriented_task_16")["prompt"]

    def recorded(body: dict) -> int:
        status = wait_for(lambda: (lambda s: s if s["status"] == "finished" else None)(
            client.get(f"/v1/requests/{body['id']}").json()))
        return status["completion_tokens"]

    for route in ({}, {"route": "ar"}):
        whole = client.post("/v1/chat/completions", json=chat_body(prompt, max_tokens=64, **route)).json()
        assert whole["choices"][0]["finish_reason"] == "stop", whole  # on the EOS
        assert recorded(whole) == whole["usage"]["completion_tokens"]
        text = whole["choices"][0]["message"]["content"]
        stop = text[len(text) // 2:len(text) // 2 + 6]
        cut = client.post("/v1/chat/completions", json=chat_body(prompt, max_tokens=64, stop=[stop], **route)).json()
        assert 0 < cut["usage"]["completion_tokens"] < whole["usage"]["completion_tokens"]
        assert recorded(cut) == cut["usage"]["completion_tokens"]


def test_request_status_has_timings_and_stats(stack, client):
    # The gateway closes the row from the stream's last event as it answers (recorded_by "stream"); the draft
    # worker's record, with the figures only the draft has (its measured trips), follows when its task ends and
    # overwrites it (recorded_by "driver"; gateway/sessions/ending.py). Seeded sampling does not bridge
    # (services/speculative/bridging.py): no block of this short request is answered by a bridge before the draft
    # measured a trip.
    request = chat_body("Name a fruit.", max_tokens=16, temperature=0.8, seed=7)
    body = client.post("/v1/chat/completions", json=request).json()
    status = wait_for(lambda: (lambda s: s if s["mirror_sd"]["recorded_by"] == "driver" else None)(
        client.get(f"/v1/requests/{body['id']}").json()))
    assert status["status"] == "finished" and status["mirror_sd"]["transport_ms_p50"] is not None
    assert status["queued_at"] <= status["started_at"] <= status["finished_at"]
    assert status["completion_tokens"] == body["usage"]["completion_tokens"]
    assert client.get("/v1/requests/cmpl-nope").status_code == 404


def holder_of(stack, request_id: str) -> str:
    """The verify worker holding a request's session: the one that committed its latest output event."""
    from services.protocol import OutputEvent, output_stream

    last = stack.redis.xrevrange(output_stream(request_id), count=1)
    return OutputEvent.decode(last[0][1][b"m"]).worker_id


def stream_and_stop_its_verify_worker(stack, client, reference, prompt: str, stop) -> tuple[str, list, list[int]]:
    """Stream `prompt`; after 3 events call stop(worker_id) on the worker holding its session. Returns
    (that worker, the events, target-only decoding's tokens)."""
    expected = reference(prompt, chat=True, max_tokens=64)
    stopped, events = None, []
    with client.stream("POST", "/v1/chat/completions", json=chat_body(prompt, max_tokens=64, stream=True)) as response:
        for event in iter_sse(response):
            events.append(event)
            if stopped is None and len(events) >= 3:
                stopped = holder_of(stack, events[0]["id"])  # the worker that committed its latest round
                stop(stopped)
    assert stopped is not None and events[-1] == "[DONE]"
    return stopped, events, expected


def test_killed_verify_worker_loses_no_request(stack, client, reference):
    killed, events, expected = stream_and_stop_its_verify_worker(
        stack, client, reference, "List ten animals that live in the ocean, one per line.", stack.kill)
    final = [e for e in events[:-1] if e["choices"]][-1]["choices"][0]
    assert final["token_ids"] == expected
    stack.spawn_verify(killed)
    stack.wait_ready()


def test_sigterm_to_a_verify_worker_hands_its_session_off_and_it_exits_0(stack, client, reference):
    """A drained verify worker (SIGTERM: an operator's stop, a rolling update) finishes its turn, withdraws
    its heartbeat and exits 0; the draft side rebuilds the session on the other worker from its committed
    prefix, so the stream goes on with no gap, duplicate or error."""
    drained, events, expected = stream_and_stop_its_verify_worker(
        stack, client, reference, "List ten birds that cannot fly, one per line.",
        lambda worker: stack.processes[worker].send_signal(signal.SIGTERM))
    assert not any("error" in event for event in events[:-1])
    final = [e for e in events[:-1] if e["choices"]][-1]["choices"][0]
    assert final["token_ids"] == expected
    assert stack.processes[drained].wait(timeout=30) == 0
    assert holder_of(stack, events[0]["id"]) != drained  # the later rounds were verified elsewhere
    stack.spawn_verify(drained)
    stack.wait_ready()


def test_killed_verify_worker_with_a_batch_in_flight_loses_nothing(stack, client, reference):
    """Four streams batched on one verify worker (two of them on the plain route, running target-only
    rounds on their own); SIGKILL it mid-stream: the other worker rebuilds every session from its committed
    prefix, and every output is single-stream target-only decoding's, with no gap or duplicate."""
    prompts = ["List six rivers of Europe, one per line.", "Name five colours and one fruit of each colour.",
               "Write four short lines about the sea.", "Give three tips for sleeping well."]
    expected = [reference(prompt, chat=True, max_tokens=64) for prompt in prompts]
    killed = []

    def stream(index: int) -> list:
        body = chat_body(prompts[index], max_tokens=64, stream=True, **({"route": "ar"} if index % 2 else {}))
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            return read_sse(response)

    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = [pool.submit(stream, index) for index in range(4)]
        holder = wait_for(lambda: next((beat.worker_id for beat in stack.heartbeats("verify")
                                        if beat.num_sessions >= 2), None), timeout_s=60, interval_s=0.05)
        stack.kill(holder)
        killed.append(holder)
        results = [future.result(timeout=180) for future in futures]
    for events, tokens in zip(results, expected):
        assert events[-1] == "[DONE]"
        final = [e for e in events[:-1] if e["choices"]][-1]["choices"][0]
        assert final["token_ids"] == tokens
    stack.spawn_verify(killed[0])
    stack.wait_ready()


def test_a_request_sharing_a_long_prefix_goes_where_its_kv_is_and_reuses_it(stack, client, reference):
    """Similarity routing (MinHash over the prompt) sends each follow-up to the verify worker that served the
    first; that worker copies the shared prefix's KV instead of prefilling it; answers stay target-only's."""
    document = " ".join(f"Station {n} reports {n * 7 % 13} trains, {n * 5 % 11} delays and a clear sky."
                        for n in range(24))
    def counter(name: str) -> float:
        lines = [line for line in client.get("/metrics").text.splitlines() if line.startswith(name + " ")]
        return float(lines[0].split()[-1]) if lines else 0.0

    routed, hits = counter("mirror_sd:affinity_routed_total"), counter("mirror_sd:prefix_cache_hits_total")
    workers, cached = [], []
    for question in ("How many stations are listed?", "Which station has the most trains?",
                     "Summarize the delays.", "Is the sky clear?"):
        prompt = f"{document}\n\nQuestion: {question}"
        body = client.post("/v1/chat/completions", json=chat_body(prompt, max_tokens=8)).json()
        assert body["choices"][0]["token_ids"] == reference(prompt, chat=True, max_tokens=8)
        workers.append(body["mirror_sd"]["verify_worker"])
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert cached[-1] == body["mirror_sd"]["num_cached_tokens"]
    assert len(set(workers)) == 1 and workers[0] in stack.verify_ids
    prompt_tokens = body["usage"]["prompt_tokens"]
    # the first shares at most the chat template's opening with earlier requests; the others the document
    assert cached[0] < 0.5 * prompt_tokens and all(0.8 * prompt_tokens < n < prompt_tokens for n in cached[1:])
    assert counter("mirror_sd:affinity_routed_total") - routed == 3
    assert counter("mirror_sd:prefix_cache_hits_total") - hits == sum(cached)


def test_plain_route_on_request(stack, client, reference):
    prompt = "Name three planets."
    body = client.post("/v1/chat/completions", json=chat_body(prompt, max_tokens=20, route="ar")).json()
    assert body["choices"][0]["token_ids"] == reference(prompt, chat=True, max_tokens=20)
    assert body["mirror_sd"]["route"] == "ar" and body["mirror_sd"]["num_drafts"] == 0
    bad = client.post("/v1/chat/completions", json=chat_body(prompt, route="fast"))
    assert bad.status_code == 400 and "route" in bad.text


def test_concurrency_bench_batches_and_matches_target_only(stack, tmp_path):
    from typer.testing import CliRunner

    from services.cli import app

    prompts = tmp_path / "prompts.jsonl"
    rows = [{"id": f"p{n}", "category": "chat", "prompt": text, "context_chars": 0}
            for n, text in enumerate(["Name three colours.", "Say hello in French.", "Count from one to five."])]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "concurrency"
    before = scrape(stack)
    result = CliRunner().invoke(app, ["bench", "--concurrency", "1,3", "--modes", "stack,stack-ar,hf-batch",
                                      "--prompts", str(prompts), "--url", stack.base_url,
                                      "--api-key", stack.create_key("normal"), "--redis-url", stack.redis_url,
                                      "-n", "12", "--threads", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    served = scrape(stack)["mirror_sd:requests_total"] - before.get("mirror_sd:requests_total", 0.0)
    data = json.loads((out / "concurrency.json").read_text())
    rows = {(row["mode"], row["concurrency"]): row for row in data["rows"]}
    assert set(rows) == {(mode, level) for mode in ("stack", "stack-ar", "hf-batch") for level in (1, 3)}
    # timed: 3 prompts per level and stack mode (12); untimed, before each level: C requests per stack mode (8)
    assert served == 2 * (3 + 3) + 2 * (1 + 3) and data["meta"]["warmup"] == 1
    assert not data["mismatches"]
    assert all(row["tokens"] > 0 and row["tokens_per_s"] > 0 for row in rows.values())
    # every step carries a row; how many streams shared one is the box's timing (the bench's rows/step column)
    assert rows[("stack-ar", 3)]["extra"]["mean_rows_per_step"] >= 1
    assert (out / "throughput_vs_concurrency.png").read_bytes()[:4] == b"\x89PNG"


def scrape(stack) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(f"{stack.base_url}/metrics")
    assert response.status_code == 200
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def test_metrics_parse_and_match_the_requests_sent(stack, client):
    before = scrape(stack)
    bodies = [client.post("/v1/completions", json={"model": MODEL, "prompt": f"Fact {n}:", "max_tokens": 6,
                                                   "temperature": 0}).json() for n in range(3)]
    client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 0})
    after = scrape(stack)

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("mirror_sd:requests_total") == 3
    assert delta("mirror_sd:requests_rejected_total") == 1
    assert delta("mirror_sd:generation_tokens_total") == sum(b["usage"]["completion_tokens"] for b in bodies)
    for counter in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert delta(f"mirror_sd:spec_decode_{counter}_total") == sum(b["mirror_sd"][counter] for b in bodies)
    per_pos = [b["mirror_sd"]["num_accepted_tokens_per_pos"] for b in bodies]
    assert all(sum(p) == b["mirror_sd"]["num_accepted_tokens"] for p, b in zip(per_pos, bodies))
    assert delta("mirror_sd:spec_decode_num_accepted_tokens_per_pos_total") == sum(map(sum, per_pos))
    assert delta("mirror_sd:time_to_first_token_seconds_count") == 3
    assert after["mirror_sd:worker_sessions"] >= 0 and "mirror_sd:worker_utilization" in after
    telemetry = client.get("/v1/telemetry").json()
    assert {w["role"] for w in telemetry["workers"]} == {"draft", "verify"}


def test_bench_stack_mode_matches_ar_and_reads_the_workers_overheads(stack, tmp_path):
    from typer.testing import CliRunner

    from services.cli import app

    prompts = tmp_path / "prompts.jsonl"
    rows = [{"id": "open-1", "category": "chat", "prompt": "Name three colours.", "context_chars": 0},
            {"id": "grounded-1", "category": "qa", "context_chars": 60,
             "prompt": "Text: The river Lune flows through Lancaster to the sea.\nWhich city does the Lune flow through?"}]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "bench"
    result = CliRunner().invoke(app, ["bench", "--prompts", str(prompts), "--modes", "ar,stack", "--url", stack.base_url,
                                      "--api-key", stack.create_key("normal"), "--redis-url", stack.redis_url, "-n", "16", "--threads", "1",
                                      "--no-progress", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "MISMATCH" not in result.output
    data = json.loads((out / "results.json").read_text())
    stack_runs = [run for run in data["runs"] if run["mode"] == "stack"]
    assert sorted(run["id"] for run in stack_runs) == ["grounded-1", "open-1"]
    assert all(run["matches_ar"] and run["completion_tokens"] > 0 for run in stack_runs)
    assert sum(run["stats"]["num_target_calls"] for run in stack_runs) > 0
    assert data["meta"]["transport_overhead"]["rounds"] > 0


@pytest.fixture(scope="module")
def openai_client(stack):
    import openai

    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=stack.create_key("normal"), max_retries=0,
                         timeout=180)


def target_only_with(builtin_target, prompt: str, sampling, *, chat: bool = True, max_tokens: int = MAX_TOKENS):
    from services.engine import GenerationOptions

    prompt_ids = encode_prompt(builtin_target.tokenizer, prompt, chat=chat)
    return generate(builtin_target, DraftSource("none"), prompt_ids,
                    GenerationOptions(max_new_tokens=max_tokens, sampling=sampling))


def test_the_openai_client_gets_logprobs_as_target_only_decoding_gives_them(openai_client, builtin_target):
    from gateway.streams.logprobs import token_strings
    from services.speculative.params import SamplingParams

    prompt = "List three colors of the rainbow."
    answer = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0,
        logprobs=True, top_logprobs=3, n=3, extra_body={"return_token_ids": True})
    expected = target_only_with(builtin_target, prompt, SamplingParams(logprobs=3))
    strings = token_strings(builtin_target.tokenizer)
    # fp32 logits from a worker's batched block forward differ from one in-process position's in the last bits:
    # measured up to 1.5e-5 in a log probability of -1.58 (in-process speculation: within 1e-5, test_engine_tiny)
    close = dict(abs=5e-5)
    for choice in answer.choices:  # three greedy choices: one generation, each with the whole logprobs
        content = choice.logprobs.content
        assert choice.model_extra["token_ids"] == expected.token_ids
        assert [item.logprob for item in content] == pytest.approx(expected.logprobs.logprobs, **close)
        assert [item.token for item in content] == [strings.get(t)[0] for t in expected.token_ids]
        for item, ids, values in zip(content, expected.logprobs.top_ids, expected.logprobs.top_logprobs):
            assert [alt.logprob for alt in item.top_logprobs] == pytest.approx(values, **close)
            assert [alt.token for alt in item.top_logprobs] == [strings.get(t)[0] for t in ids]
        assert b"".join(bytes(item.bytes) for item in content).decode() == choice.message.content
    streamed = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0,
        logprobs=True, stream=True)
    items = [item for chunk in streamed for choice in chunk.choices if choice.logprobs
             for item in choice.logprobs.content or []]
    assert [item.logprob for item in items] == pytest.approx(expected.logprobs.logprobs, **close)
    assert all(item.top_logprobs == [] for item in items)
    completion = openai_client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                                  temperature=0, logprobs=2)
    shaped = completion.choices[0].logprobs
    assert len(shaped.tokens) == len(shaped.token_logprobs) == len(shaped.top_logprobs) == 8
    assert "".join(shaped.tokens) == completion.choices[0].text
    assert shaped.text_offset == [sum(map(len, shaped.tokens[:i])) for i in range(8)]
    assert all(len(alternatives) <= 2 for alternatives in shaped.top_logprobs)


def test_penalties_and_biases_over_http_equal_target_only_decoding_with_them(openai_client, builtin_target):
    from services.speculative.params import SamplingParams

    prompt = "Repeat the word 'hello' ten times."
    plain = target_only_with(builtin_target, prompt, SamplingParams()).token_ids
    banned = plain[0]
    sampling = SamplingParams(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.2,
                              logit_bias={banned: -100.0})
    expected = target_only_with(builtin_target, prompt, sampling).token_ids
    assert expected != plain and banned not in expected
    answer = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0,
        presence_penalty=1.5, frequency_penalty=0.5, logit_bias={str(banned): -100},
        extra_body={"repetition_penalty": 1.2, "return_token_ids": True})
    assert answer.choices[0].model_extra["token_ids"] == expected


CITY_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24}, "country": {"type": "string", "maxLength": 24},
    "population_millions": {"type": "number"}, "landmarks": {"type": "array", "items": {"type": "string",
                                                                                         "maxLength": 24},
                                                           "maxItems": 3}},
    "required": ["city", "country", "population_millions", "landmarks"], "additionalProperties": False}


def test_parse_with_a_pydantic_model_gets_the_constrained_target_only_answer(openai_client, builtin_target):
    import pydantic

    from services.speculative.grammar import json_schema_grammar
    from services.speculative.params import SamplingParams

    class City(pydantic.BaseModel):
        name: str
        country: str
        founded_year: int

    prompt = "Tell me about Paris as JSON."
    answer = openai_client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": prompt}], response_format=City, max_tokens=96,
        temperature=0, extra_body={"return_token_ids": True})
    choice = answer.choices[0]
    assert isinstance(choice.message.parsed, City) and choice.finish_reason == "stop"
    expected = target_only_with(builtin_target, prompt, SamplingParams(grammar=json_schema_grammar(
        openai_strict_schema(City))), max_tokens=96)
    assert choice.model_extra["token_ids"] == expected.token_ids


def openai_strict_schema(model) -> dict:
    """The schema the openai client sends for a pydantic model in parse() (strict: every field required, no
    other properties)."""
    from openai.lib._pydantic import to_strict_json_schema

    return to_strict_json_schema(model)


def test_a_verify_worker_killed_mid_json_answers_the_same_valid_json(stack, client, builtin_target):
    import jsonschema

    from services.speculative.grammar import json_schema_grammar
    from services.speculative.params import SamplingParams

    prompt = "Describe Tokyo as JSON."
    expected = target_only_with(builtin_target, prompt, SamplingParams(grammar=json_schema_grammar(CITY_SCHEMA)),
                                max_tokens=96).token_ids
    body = chat_body(prompt, max_tokens=96, stream=True, response_format={
        "type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}})
    killed, events = None, []
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        for event in iter_sse(response):
            events.append(event)
            if killed is None and len(events) >= 3:
                killed = holder_of(stack, events[0]["id"])
                stack.kill(killed)
    assert killed is not None and events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    final = chunks[-1]["choices"][0]
    assert final["token_ids"] == expected and final["finish_reason"] == "stop"
    text = "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks)
    jsonschema.validate(json.loads(text), CITY_SCHEMA)
    forced = [line for line in client.get("/metrics").text.splitlines()
              if line.startswith("mirror_sd:spec_decode_num_forced_draft_tokens_total ")]
    assert forced and float(forced[0].split()[-1]) > 0  # the grammar's forced tokens, counted on /metrics
    stack.spawn_verify(killed)
    stack.wait_ready()


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


def test_tool_calls_named_and_required_come_back_as_tool_calls_and_the_result_goes_on(openai_client):
    import jsonschema

    question = [{"role": "user", "content": "What is the weather in Oslo?"}]
    answer = openai_client.chat.completions.create(
        model=MODEL, messages=question, tools=[WEATHER], max_tokens=64, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = answer.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    chunks = list(openai_client.chat.completions.create(
        model=MODEL, messages=question, tools=[WEATHER], tool_choice="required", max_tokens=64, temperature=0,
        stream=True))
    streamed = [tool for chunk in chunks for c in chunk.choices if c.delta.tool_calls for tool in c.delta.tool_calls]
    assert len(streamed) == 1 and streamed[0].function.name == "get_weather"
    assert [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason] == ["tool_calls"]
    assert not any(c.delta.content for chunk in chunks for c in chunk.choices)
    follow = openai_client.chat.completions.create(
        model=MODEL, max_tokens=16, temperature=0,
        messages=[*question, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id, "content": "12 degrees and rain"}])
    assert follow.choices[0].message.content and not follow.choices[0].message.tool_calls
