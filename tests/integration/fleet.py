"""An in-process fleet for tests on tiny models: verify workers as threads over a real Redis, and draft
runtimes whose driver threads drive sessions, exactly as the worker processes do."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import redis

from draft_worker.runtime import DraftRuntime
from services.config import SchedulerSettings, Settings, SpeculativeSettings, WorkerSettings
from services.engine import GenerationOptions, GenerationSession
from services.models.engine import TorchEngine
from services.models.drafters import DraftSource
from services.protocol import DraftBlock, OutputEvent, SessionSpec, request_key, verify_pool_queue
from services.redis_client import read_events
from services.speculative.params import SamplingParams
from tests.redis_dbs import DATABASES
from verify_worker.local_drafts import LocalDrafting
from verify_worker.worker import VerifyWorker

CURVE = {"verify_ms_1": 10.0, "verify_ms_4": 11.0, "verify_ms_9": 12.0}


class VerifyThread:
    """local: the worker drafts for its own sessions with it (placement local)."""

    def __init__(self, client: redis.Redis, target, *, worker_id: str = "verify-t", pool: str = "cpu",
                 scheduler: SchedulerSettings | None = None, kv_budget_bytes: int = 1 << 26,
                 profile: dict | None = None, local: LocalDrafting | None = None, step_s: float = 0.0,
                 draft_after_opening: bool = False, load_word: bool = True) -> None:
        """step_s: each forward takes at least this long (a target that costs more than the tiny draft).
        draft_after_opening: speculative.draft_prefill "after_opening". load_word: worker.load_word (its word
        moves where drafted rounds fall by what the steps measured: off for tests that count rounds)."""
        engine = TorchEngine(target, budget_bytes=kv_budget_bytes)
        if step_s:
            forward = engine.forward

            def slow_forward(rows):
                started = time.perf_counter()
                logits = forward(rows)
                time.sleep(max(0.0, step_s - (time.perf_counter() - started)))
                return logits

            engine.forward = slow_forward
        self.worker = VerifyWorker(client=client, engine=engine, worker_id=worker_id, pool=pool, scheduler=scheduler,
                                   profile=CURVE if profile is None else profile, local=local,
                                   draft_after_opening=draft_after_opening, load_word=load_word)
        self.worker.heartbeat(ttl_s=60)  # the draft side reads the cost curve from here
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.worker.serve, args=(self.stop, 0.1), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


def draft_runtime(client: redis.Redis, source: DraftSource, *, pipelined: bool = True,
                  block_policy: str = "acceptance", blocks_ahead: int = 0, **speculative) -> DraftRuntime:
    settings = Settings(worker=WorkerSettings(pipelined_drafting=pipelined, verdict_timeout_s=30,
                                              blocks_ahead=blocks_ahead),
                        speculative=SpeculativeSettings(block_policy=block_policy, **speculative))
    return DraftRuntime(settings=settings, client=client, draft_source=source,
                        worker_id=f"draft-{uuid.uuid4().hex[:8]}", profile={"draft_ms_per_token": 0.5})


def submit_spec(client: redis.Redis, spec: SessionSpec) -> None:
    client.set(request_key(spec.request_id), spec.encode())  # what the gateway writes


def start_local(client: redis.Redis, spec: SessionSpec) -> None:
    """What the gateway does for a pool that drafts locally: the spec, then a start block on the pool's queue."""
    spec.draft_placement = "local"
    submit_spec(client, spec)
    client.rpush(verify_pool_queue(spec.pool), DraftBlock(request_id=spec.request_id, round=0,
                                                          num_committed=len(spec.prompt_ids), draft_ids=[],
                                                          draft_here=True).encode())


def wait_finished(client: redis.Redis, request_id: str, timeout_s: float = 60.0) -> list[OutputEvent]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events = read_events(client, request_id)
        if events and events[-1].finished:
            return events
        time.sleep(0.02)
    raise AssertionError(f"request {request_id} did not finish in {timeout_s:.0f}s")


def reference(target, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
              drafter=None) -> list[int]:
    """What the request decodes to in-process (the target alone, unless a drafter is given)."""
    options = GenerationOptions(max_new_tokens=max_new_tokens, ignore_eos=True, sampling=sampling)
    session = GenerationSession(target, drafter, prompt_ids, options)
    while not session.finished:
        session.step()
    return list(session.output_ids)


def output_tokens(client: redis.Redis, request_id: str) -> list[int]:
    return [token for event in read_events(client, request_id) for token in event.token_ids]


@contextmanager
def running_fleet(client: redis.Redis, target, source: DraftSource, *, pipelined: bool = True,
                  **verify_options) -> Iterator[tuple[VerifyThread, DraftRuntime]]:
    """A verify worker thread and a draft runtime, both stopped on the way out."""
    verify = VerifyThread(client, target, **verify_options)
    runtime = draft_runtime(client, source, pipelined=pipelined)
    try:
        yield verify, runtime
    finally:
        runtime.close()
        verify.close()


@contextmanager
def behind_link(client: redis.Redis, rtt_ms: float) -> Iterator[redis.Redis]:
    """A client for `client`'s Redis database through the project's link proxy (services/link/proxy.py),
    delaying every chunk rtt_ms / 2 each way; the proxy runs on its own event loop thread."""
    import asyncio

    from services.link.proxy import LinkProxy
    from services.link.spec import LinkSpec

    kwargs = client.connection_pool.connection_kwargs
    loop = asyncio.new_event_loop()
    loop.set_exception_handler(lambda _loop, _context: None)  # connections cut at shutdown: nothing to report
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    proxy = asyncio.run_coroutine_threadsafe(
        LinkProxy(LinkSpec(rtt_ms), kwargs.get("host", "127.0.0.1"), kwargs.get("port", 6379)).start(), loop).result(10)
    linked = redis.Redis(host="127.0.0.1", port=proxy.port, db=kwargs.get("db", 0))
    async def shutdown() -> None:
        await proxy.close()
        carrying = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in carrying:
            task.cancel()
        await asyncio.gather(*carrying, return_exceptions=True)

    try:
        yield linked
    finally:
        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(10)
        linked.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        loop.close()


@contextmanager
def empty_redis() -> Iterator[redis.Redis]:
    """A test Redis database of its own (tests/redis_dbs.py), empty, emptied again after."""
    with DATABASES.lease() as url:
        yield redis.Redis.from_url(url)
