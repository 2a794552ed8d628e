"""Every message that crosses a process, typed and versioned, encoded with msgpack.
(Over 300 lines on purpose: every message in one module, so the wire format is read in one place.)

One place for the wire format (like TGI's generate.v3 proto): each message
is a dataclass with `encode()` -> bytes and `decode(bytes)` -> message.
Decoding checks the size, the version and the kind, and raises
`ProtocolError` with a clear message instead of crashing the reader.
A decoder ignores fields it does not know (protobuf's rule), so a newer
sender may add a field without a version bump; a field a message cannot
do without is still refused. Nested values (the spec-decode stats) travel
whole, as a map, encoded and decoded by their own class.

Queue, key and task names live here too, so every service agrees on them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import msgpack

from services.speculative.params import SamplingParams
from services.speculative.stats import SpecDecodingStats

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 6  # 3: SessionSpec carries its sampling params whole (`sampling`); 4: `opened`;
# 5: Verdict.num_bridged; 6: penalties, logit_bias and logprobs in `sampling` (a worker that ignored them would
# answer wrongly, not just less), OutputEvent's logprobs
MAX_MESSAGE_BYTES = 8 * 1024 * 1024  # a block with fp16 draft probs for gamma 8 x 49k vocab is ~800 KB

# --- Celery (control path) ---------------------------------------------------
TASK_RUN_SESSION = "mirror_sd.draft.run_session"
DEFAULT_POOL = "cpu"


def draft_queue(pool: str) -> str:
    """Celery queue the gateway sends new sessions to."""
    return f"draft.{pool}"


# --- Redis (hot path and state) ------------------------------------------------
KEY_PREFIX = "mirror-sd"


def verify_pool_queue(pool: str) -> str:
    """Redis list any verify worker of the pool pops from."""
    return f"{KEY_PREFIX}:verify:pool:{pool}"


def verify_worker_queue(worker_id: str) -> str:
    """Redis list of one verify worker: blocks of sessions whose KV cache it holds."""
    return f"{KEY_PREFIX}:verify:worker:{worker_id}"


def verdict_queue(request_id: str) -> str:
    return f"{KEY_PREFIX}:verdict:{request_id}"


def draft_inbox(worker_id: str) -> str:
    """Redis list of one draft worker process: the verdicts of every session it drives."""
    return f"{KEY_PREFIX}:draft:inbox:{worker_id}"


def output_stream(request_id: str) -> str:
    """Redis stream of committed tokens, one entry per round, with sequence numbers."""
    return f"{KEY_PREFIX}:out:{request_id}"


def request_key(request_id: str) -> str:
    """The request spec (SessionSpec), written by the gateway."""
    return f"{KEY_PREFIX}:request:{request_id}"


def cancel_key(request_id: str) -> str:
    return f"{KEY_PREFIX}:cancel:{request_id}"


def lease_key(request_id: str) -> str:
    """Which draft task drives the session now (expires if that worker dies)."""
    return f"{KEY_PREFIX}:lease:{request_id}"


def owner_key(request_id: str) -> str:
    """The draft worker process (instance_id) that last took the session's lease (kept after it dies, unlike
    the lease):
    a gateway whose stream stalls reads it to tell a dead owner from a task still queued."""
    return f"{KEY_PREFIX}:owner:{request_id}"


def instance_id(worker_id: str, pid: int) -> str:
    """One process of a worker: a restarted worker keeps its id (compose, --worker-id) but not its pid."""
    return f"{worker_id}#{pid}"


def parse_instance(value: str) -> tuple[str, int]:
    worker_id, _, pid = value.rpartition("#")
    return (worker_id, int(pid)) if worker_id and pid.isdigit() else (value, 0)


def revive_key(request_id: str, dead_owner: str) -> str:
    """Taken (SET NX) by the one gateway that re-sends a session whose owner died."""
    return f"{KEY_PREFIX}:revive:{request_id}:{dead_owner}"


def flight_key(digest: str) -> str:
    """Single-flight (gateway/sessions/single_flight.py): a hash of the leader and the subscribers of one generation
    that identical requests share."""
    return f"{KEY_PREFIX}:flight:{digest}"


def answer_cancel_key(request_id: str) -> str:
    """Single-flight: a DELETE of one subscriber's request. Its reader ends that client's answer; the
    generation goes on while other subscribers read it (the generation's own is cancel_key)."""
    return f"{KEY_PREFIX}:answer-cancel:{request_id}"


def work_counted_key(request_id: str) -> str:
    """Single-flight across gateways: taken (SET NX) by the one gateway that counts a generation's drafting stats."""
    return f"{KEY_PREFIX}:counted:{request_id}"


def heartbeat_key(worker_id: str) -> str:
    return f"{KEY_PREFIX}:heartbeat:{worker_id}"


HEARTBEAT_PATTERN = f"{KEY_PREFIX}:heartbeat:*"

# Several gateways sharing admission (gateway/admission/shared.py): the live gateways (a sorted set, id -> lease
# expiry in ms on Redis's clock) and each one's slots (a hash, ticket -> API key id or '').
GATEWAYS_KEY = f"{KEY_PREFIX}:gateways"
ADMISSION_SLOTS_PREFIX = f"{KEY_PREFIX}:admission:"


def admission_slots_key(gateway_id: str) -> str:
    return f"{ADMISSION_SLOTS_PREFIX}{gateway_id}"


# Several gateways sharing similarity routing (gateway/fleet/similarity_log.py): recent prompts' sketches and the verify
# worker each went to, a capped stream every gateway tails into its own index.
SIMILARITY_LOG_KEY = f"{KEY_PREFIX}:similarity:log"

# Recent per-round transport in ms (round trip minus the verify worker's time and the draft driver's time
# elsewhere, on the draft worker's clock: services/link/meter.py), newest first, capped.
TRANSPORT_SAMPLES_KEY = f"{KEY_PREFIX}:metrics:transport_ms"
TRANSPORT_SAMPLES_MAX = 20000
# Recent per-round round trips in ms (block sent -> verdict seen, on the draft worker's clock), like the above.
ROUND_TRIP_SAMPLES_KEY = f"{KEY_PREFIX}:metrics:round_trip_ms"
DRAFT_TIMING_KEY = f"{KEY_PREFIX}:draft-timing"  # hash of summed seconds/counts (services/engine/draft_pipeline.py)
# `mirror-sd up`'s supervisor: child name -> ChildStatus (a hash, rewritten on every change and every few
# seconds, expiring when no supervisor writes it), read by /metrics, /readyz, the dashboard and `mirror-sd status`.
CHILDREN_KEY = f"{KEY_PREFIX}:supervisor:children"
CHILDREN_TTL_S = 10
DRAFT_LINK = "draft"  # the name of the link `mirror-sd up --draft-link` puts the draft workers behind
LINK_STATUS_TTL_S = 3


def link_status_key(name: str) -> str:
    """A running link's LinkStatus (services/link/), rewritten every second, expiring when it stops."""
    return f"{KEY_PREFIX}:link:{name}"


def link_setting_key(name: str) -> str:
    """The LinkSetting a running link applies (the bench's --draft-link levels write it)."""
    return f"{KEY_PREFIX}:link:{name}:setting"


class ProtocolError(ValueError):
    """A message that cannot be decoded: too big, wrong version, wrong kind, bad fields."""


M = TypeVar("M", bound="Message")


@dataclass
class Message:
    KIND: ClassVar[str] = ""
    NESTED: ClassVar[dict[str, type]] = {}  # field -> class with to_wire() / from_wire(map); None travels as nil

    def to_dict(self) -> dict[str, Any]:
        body = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in self.NESTED:
            if body[name] is not None:
                body[name] = body[name].to_wire()
        return body

    def encode(self) -> bytes:
        payload = {"v": PROTOCOL_VERSION, "kind": self.KIND, "body": self.to_dict()}
        return msgpack.packb(payload, use_bin_type=True)

    @classmethod
    def decode(cls: type[M], data: bytes) -> M:
        return decode_one_of(data, (cls,))

    @classmethod
    def from_dict(cls: type[M], body: dict[str, Any]) -> M:
        hints = _field_hints(cls)
        known = {name: value for name, value in body.items() if name in hints}  # unknown fields: ignored
        for name, value in known.items():
            if name not in cls.NESTED and not conforms(value, hints[name]):
                hint = hints[name]
                shown = hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
                raise ValueError(f"{name} must be {shown}, got {type(value).__name__}")
        for name, nested in cls.NESTED.items():
            if name in known and not (known[name] is None and conforms(None, hints[name])):
                if not isinstance(known[name], dict):
                    raise ValueError(f"{name} must be a map")
                known[name] = nested.from_wire(known[name])
        return cls(**known)


@functools.cache
def _field_hints(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def conforms(value: Any, hint: Any) -> bool:
    """Whether a decoded msgpack value fits a field's annotation (a float field takes an int; bool is no int)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, arg) for arg in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint in (str, bytes):
        return isinstance(value, hint)
    if hint is list or origin is list:
        return isinstance(value, list) and (not args or all(conforms(item, args[0]) for item in value))
    if hint is dict or origin is dict:
        return isinstance(value, dict) and (not args or all(conforms(k, args[0]) and conforms(v, args[1])
                                                            for k, v in value.items()))
    return True  # Any, and nested messages (checked by their own from_wire)


def decode_one_of(data: bytes, kinds: tuple[type[M], ...]) -> M:
    """The message in `data`, which must be of one of `kinds` (a queue that carries several)."""
    names = "/".join(kind.KIND for kind in kinds)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"{names}: expected bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"{names}: message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        payload = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"{names}: not valid msgpack ({exc})") from exc
    if not isinstance(payload, dict):
        raise ProtocolError(f"{names}: expected a map, got {type(payload).__name__}")
    if payload.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"{names}: unsupported protocol version {payload.get('v')!r}, this side speaks "
                            f"{PROTOCOL_VERSION}")
    kind = next((kind for kind in kinds if kind.KIND == payload.get("kind")), None)
    if kind is None:
        expected = " or ".join(repr(kind.KIND) for kind in kinds)
        raise ProtocolError(f"expected a {expected} message, got {payload.get('kind')!r}")
    body = payload.get("body")
    if not isinstance(body, dict):
        raise ProtocolError(f"{kind.KIND}: body must be a map")
    try:
        return kind.from_dict(body)
    except (TypeError, ValueError, KeyError) as exc:
        raise ProtocolError(f"{kind.KIND}: bad fields ({exc})") from exc


@dataclass
class SessionSpec(Message):
    """Everything a session needs, written once by the gateway under request_key()."""

    KIND: ClassVar[str] = "session_spec"
    NESTED: ClassVar[dict[str, type]] = {"sampling": SamplingParams}
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    priority: int = 1  # 0 high, 1 normal, 2 low
    pool: str = DEFAULT_POOL  # verify pool, chosen by the gateway from the routing table
    route: str = "sd"  # "sd" or "ar" (plain target decoding)
    max_draft_tokens: int | None = None  # cap on gamma (a degraded pool gets shorter blocks)
    routing_version: int = 0
    created_at: float = field(default_factory=time.time)
    verify_worker: str | None = None  # cache affinity: the verify worker holding a similar request's KV
    cache_salt: str | None = None  # KV is reused only between sessions of the same salt
    # Whose history a suffix draft may read (services/models/drafters/history.py): the API key, and its cache_salt
    # when one is given (tenant_of); "" with auth off. A session drafts only from its own tenant's earlier outputs.
    tenant: str = ""
    # Who drafts: "remote", a draft worker (Celery task on draft.<pool>); "local", the verify worker that holds the
    # session, in-process (a start block on the pool's queue). A revived session is started the same way again.
    draft_placement: str = "remote"
    # Placement remote: the gateway sent round 0 (one target-only round, opening_block()) to the verify pool
    # itself, so the first token does not wait for a draft worker to start over its link; the draft session
    # takes that block as its first one out.
    opened: bool = False


def opening_block(spec: "SessionSpec") -> "DraftBlock":
    """Round 0 of an opened session (SessionSpec.opened), as the gateway sends it and the draft session knows
    it: target-only, block 1 of the session, answered on the request's own verdict list (no draft worker's
    inbox is known yet; the draft worker moves what arrives there into its inbox)."""
    return DraftBlock(request_id=spec.request_id, round=0, num_committed=len(spec.prompt_ids), draft_ids=[],
                      reply_to=verdict_queue(spec.request_id), block_id=OPENING_BLOCK_ID)


OPENING_BLOCK_ID = 1


@dataclass
class DraftBlock(Message):
    """Draft -> verify: one round's proposal, based on the first `num_committed` tokens."""

    KIND: ClassVar[str] = "draft_block"
    request_id: str
    round: int
    num_committed: int  # prompt + output tokens the draft saw
    draft_ids: list[int]
    draft_probs: bytes | None = None  # float16 [len(draft_ids), vocab], row-major; None = point mass
    vocab_size: int = 0
    reply_to: str = ""
    release: bool = False  # end of session (cancelled, or the drafter gave up): free the KV cache
    # Rounds this block covers: the first verifies draft_ids, the others are target-only rounds the verify
    # worker runs on its own (no round trip per token); the verdict comes after the last, or at the end.
    num_rounds: int = 1
    # A start, not a proposal (placement "local"): the verify worker that takes it drafts the session itself,
    # from its committed output (draft_ids empty).
    draft_here: bool = False
    sent_at: float = field(default_factory=time.time)
    drafter: str = ""  # who made draft_ids: "suffix" or "history" (suffix drafts, counted apart in stats), else ""
    # Blocks verified ahead (services/speculative/chaining.py): the sender's number for this block (0: none),
    # and for a chained block the block it extends (assumed accepted whole) and the bonus token it assumes.
    block_id: int = 0
    parent_id: int = 0
    assumed_bonus: int = -1


@dataclass
class Verdict(Message):
    """Verify -> draft: what a block's rounds committed."""

    KIND: ClassVar[str] = "verdict"
    NESTED: ClassVar[dict[str, type]] = {"stats": SpecDecodingStats}
    request_id: str
    round: int  # the block's first round
    num_committed: int  # total committed tokens after the block (prompt included)
    num_draft_tokens: int  # of the block's drafted round
    num_accepted: int
    committed_ids: list[int]  # tokens committed by the block's rounds (accepted + recovered/bonus each)
    finished: bool = False
    finish_reason: str | None = None
    worker_id: str = ""
    num_rounds: int = 1  # output events the block committed (a resync may cover rounds of an earlier owner)
    # the load the next block meets: rows in the step that verified the drafted round, and the openings on their
    # way to the next steps (verify_worker/told_load.py)
    batch_rows: int = 1
    stats: SpecDecodingStats = field(default_factory=SpecDecodingStats)  # the request's, after the block
    block_sent_at: float = 0.0
    block_id: int = 0  # the block's (DraftBlock.block_id)
    verify_started_at: float = 0.0
    verify_finished_at: float = field(default_factory=time.time)
    # of num_rounds, the target-only rounds the verify worker ran on its own while the block was on its way
    # (services/speculative/bridging.py); the block's drafted tokens were checked against their tokens
    num_bridged: int = 0
    # the verify worker's word on its load (verify_worker/load_word.py): "plain" when its own steps measured
    # target-only rounds faster than drafted ones at the load of the moment (the next block asks for target-only
    # rounds); "" leaves the block to the draft's own cost model
    load_arm: str = ""


@dataclass
class BlockTaken(Message):
    """Verify -> draft: a worker took a block from its pool's queue. The block's sender now knows whose
    heartbeat to watch: if that worker dies before its verdict, the block goes back to the pool."""

    KIND: ClassVar[str] = "block_taken"
    request_id: str
    round: int
    worker_id: str


def encode_probs(probs) -> bytes:
    """Draft probs tensor [num_draft_tokens, vocab] -> float16 bytes for a DraftBlock."""
    return probs.detach().to("cpu").half().numpy().tobytes()


def decode_probs(block: DraftBlock):
    """A DraftBlock's probs as a float32 tensor [num_draft_tokens, vocab], or None (point mass)."""
    if block.draft_probs is None:
        return None
    import numpy as np
    import torch

    expected = len(block.draft_ids) * block.vocab_size * 2
    if len(block.draft_probs) != expected:
        raise ProtocolError(f"draft_probs has {len(block.draft_probs)} bytes, expected {expected}")
    probs = np.frombuffer(block.draft_probs, dtype=np.float16).reshape(len(block.draft_ids), block.vocab_size)
    return torch.from_numpy(probs.astype(np.float32))


@dataclass
class OutputEvent(Message):
    """One entry of the per-request output stream (verify worker -> gateway)."""

    KIND: ClassVar[str] = "output"
    NESTED: ClassVar[dict[str, type]] = {"stats": SpecDecodingStats}
    request_id: str
    seq: int  # 0, 1, 2 ... per request, no gaps: one per round
    token_ids: list[int]
    num_output_tokens: int  # after this event
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None
    stats: SpecDecodingStats = field(default_factory=SpecDecodingStats)  # the request's, cumulative
    created_at: float = field(default_factory=time.time)
    num_cached_tokens: int = 0  # prompt tokens whose KV was reused, not prefilled (prefix reuse)
    worker_id: str = ""  # the verify worker that committed it (holds the session's KV: cache affinity)
    # When the request asks for them (SamplingParams.logprobs), one entry per token of token_ids: its log
    # probability under the target, and the most likely ids with theirs (services/speculative/processing.py).
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)


def _plain_from_wire(cls: type, data: dict, name: str):
    """A flat nested value from its map: unknown keys ignored, known ones type-checked."""
    hints = _field_hints(cls)
    known = {key: data[key] for key in hints if key in data}
    for key, value in known.items():
        if not conforms(value, hints[key]):
            raise ValueError(f"{name}.{key} has the wrong type ({type(value).__name__})")
    return cls(**known)


@dataclass
class DraftFallback:
    """A draft worker serving with another draft than it was given: which failed, how, what serves instead."""

    draft: str  # the spec that could not run, e.g. gguf:smollm2-135m
    fault: str  # e.g. "SIGSEGV", "hung", "exit code 1"
    reason: str  # one line: what happened and where, e.g. "llama.cpp crashed with SIGSEGV in llama_decode (...)"
    serving: str  # the draft serving instead, e.g. ngram
    since: float = field(default_factory=time.time)

    def to_wire(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, data: dict) -> "DraftFallback":
        return _plain_from_wire(cls, data, "draft_fallback")

    def describe(self) -> str:
        return f"draft {self.draft} cannot run here: {self.reason}; drafting with {self.serving} instead"


@dataclass
class LinkFigures:
    """A draft worker's link to Redis, as it measures it (services/link/meter.py). Milliseconds; None: not
    measured yet. Round trip: a block sent -> its verdict seen, on the draft worker's clock; transport: that
    round trip less the verify worker's own time for the block and the time the driver was busy before it
    looked, so it never counts drafting (a lower bound of the time on the wire and in queues)."""

    redis_rtt_ms: float | None = None  # a PING, smoothed (exponential, weight 0.3 for the newest)
    round_trip_ms_p50: float | None = None  # over the last `window` rounds
    round_trip_ms_p99: float | None = None
    transport_ms_p50: float | None = None
    transport_ms_p99: float | None = None
    verify_ms_p50: float | None = None  # the verify worker's own time per block, as it reports it
    rounds: int = 0  # rounds measured since start
    window: int = 0  # rounds the percentiles are over
    # the draft worker's round trips to Redis for its sessions per verdict its driver applied, since start: in all,
    # and by what they were for (services/link/meter.py: the driver's blocks, look, liveness, resend, failover,
    # catch_up, close, recovery; the task threads' open, lease, finish)
    round_trips_per_round: float | None = None
    round_trips_by_kind: dict[str, float] = dataclasses.field(default_factory=dict)
    # the counts behind them, since start: a reader takes differences over any interval (the bench, per link level)
    verdicts: int = 0
    round_trip_counts: dict[str, int] = dataclasses.field(default_factory=dict)
    # blocks verified ahead (services/speculative/chaining.py): how many a session may keep out now, and the
    # share of rounds since start whose block was verified before the verdict of the one before reached the draft
    blocks_ahead: int | None = None
    verified_ahead: float | None = None
    # blocks sent again since start (draft_worker/driver.py): to a live verify worker that had not answered them
    # (resent), and to the pool when the worker that held them stopped heartbeating or died before saying it took
    # them (failed over); not the blocks every session sends again after a Redis outage
    resent_blocks: int = 0
    failed_over_blocks: int = 0

    def to_wire(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, data: dict) -> "LinkFigures":
        return _plain_from_wire(cls, data, "link")

    def describe(self) -> str:
        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value:.1f}"

        trips = "-" if self.round_trips_per_round is None else f"{self.round_trips_per_round:.2f}"
        kinds = (" (" + ", ".join(f"{kind} {share:.2f}" for kind, share in self.round_trips_by_kind.items()) + ")"
                 if self.round_trips_by_kind else "")
        return (f"Redis RTT {ms(self.redis_rtt_ms)} ms; round trip p50/p99 {ms(self.round_trip_ms_p50)}/"
                f"{ms(self.round_trip_ms_p99)} ms; transport p50/p99 {ms(self.transport_ms_p50)}/"
                f"{ms(self.transport_ms_p99)} ms; verify p50 {ms(self.verify_ms_p50)} ms (last {self.window} "
                f"of {self.rounds} rounds); {trips} Redis round trips per round{kinds}"
                + (f"; {self.blocks_ahead} blocks ahead, {self.verified_ahead:.0%} of rounds verified ahead"
                   if self.blocks_ahead is not None and self.verified_ahead is not None else "")
                + (f"; blocks resent {self.resent_blocks}, failed over {self.failed_over_blocks}"
                   if self.resent_blocks or self.failed_over_blocks else ""))


@dataclass
class Heartbeat(Message):
    KIND: ClassVar[str] = "heartbeat"
    worker_id: str
    role: str  # "draft" | "verify" | "gateway"
    pool: str
    model: str = ""
    num_sessions: int = 0
    kv_cache_bytes: int = 0
    queue_depth: int = 0
    device_kind: str = "cpu"
    utilization: float = 0.0  # 0..1
    memory_used_frac: float = 0.0
    temperature_c: float | None = None
    overridden: list[str] = field(default_factory=list)  # readings injected by a probe override
    num_draft_tokens: int = 0  # over the rolling window
    num_accepted_tokens: int = 0
    latency_p50_ms: float | None = None  # per committed token, rolling
    latency_p99_ms: float | None = None
    latency_p99_shared_ms: float | None = None  # of steps another session shared: what the latency rule reads
    profile: dict = field(default_factory=dict)  # measured at start-up, e.g. {"verify_ms_1": 43.0}
    batch_rows: float = 0.0  # verify workers: mean rows per target step
    step_counters: dict = field(default_factory=dict)  # verify workers, cumulative: steps, rows, forward_s, step_s
    stage_times: dict = field(default_factory=dict)  # verify workers, cumulative: seconds per stage of a turn
    prefix_cache: dict = field(default_factory=dict)  # verify workers: lookups, hits, reused_tokens (cumulative), retired
    pid: int = 0  # the worker's process on its host (the chaos drill's kill -9)
    host: str = ""
    draft_fallback: DraftFallback | None = None  # draft workers: the draft they were given cannot run here
    local_draft: str = ""  # verify workers drafting for their own sessions (placement local): that draft's spec
    # and what their turns measured: {load bucket: {"draft": tok/s, "plain": tok/s}} (the choice at each load)
    local_turns: dict = field(default_factory=dict)
    link: LinkFigures | None = None  # draft workers: their link to Redis and their rounds' round trips
    # draft workers: a session of at least this many prompt tokens opens with a target-only round while the
    # draft prefills (services/speculative/block_length.py opens_plain); 0: never (prompt lookup drafts)
    plain_opening_tokens: int = 0
    # drafting processes with suffix drafts: their history of the tenants' outputs (History.figures(): tokens,
    # bytes held, tenants, outputs indexed)
    suffix_history: dict = field(default_factory=dict)
    sent_at: float = field(default_factory=time.time)
    NESTED: ClassVar[dict[str, type]] = {"draft_fallback": DraftFallback, "link": LinkFigures}

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None


def probe_override_key(worker_id: str) -> str:
    """Injected readings for one worker (tests and drills): a msgpack map with `expires_at`."""
    return f"{KEY_PREFIX}:probe-override:{worker_id}"


ROUTING_TABLE_KEY = f"{KEY_PREFIX}:routing"
# Every new version of the table, newest first (encoded RoutingTable), for the dashboard's weights-over-time chart.
ROUTING_HISTORY_KEY = f"{KEY_PREFIX}:routing:history"
ROUTING_HISTORY_LEN = 512


@dataclass
class RoutingTable(Message):
    """Written by the telemetry service; read by the gateway for every new session."""

    KIND: ClassVar[str] = "routing_table"
    version: int = 0
    pool_weights: dict[str, float] = field(default_factory=dict)  # share of new sessions per pool
    ar_pools: list[str] = field(default_factory=list)  # plain target decoding (acceptance too low)
    degraded_pools: list[str] = field(default_factory=list)  # latency too high: shorter blocks, shed low
    hot_workers: list[str] = field(default_factory=list)
    workers: list[str] = field(default_factory=list)  # live verify workers
    alerts: list[str] = field(default_factory=list)  # workers whose rejection rate is over the line
    updated_at: float = field(default_factory=time.time)


CHILD_STATES = ("starting", "running", "restarting", "failed", "stopped")


@dataclass
class ChildStatus(Message):
    """One child process of `mirror-sd up` as its supervisor sees it (services/supervisor.py)."""

    KIND: ClassVar[str] = "child_status"
    name: str
    state: str  # one of CHILD_STATES; "failed": it kept dying at start and is no longer restarted
    pid: int = 0
    restarts: int = 0
    failures: int = 0  # deaths in a row before it got going
    last_exit: str | None = None  # "SIGSEGV", "SIGKILL", "exit code 3"
    fallback: str | None = None  # settings it was restarted with after crashing at start, e.g. "draft=ngram"
    log_path: str | None = None
    detail: str = ""  # why it failed, one line
    updated_at: float = field(default_factory=time.time)


@dataclass
class LinkSetting(Message):
    """What a running link should add (services/link/): written under link_setting_key by whoever changes it
    (the link itself at start, the bench between levels)."""

    KIND: ClassVar[str] = "link_setting"
    rtt_ms: float
    jitter_ms: float = 0.0
    set_by: str = ""
    set_at: float = field(default_factory=time.time)


@dataclass
class LinkStatus(Message):
    """A running link as it is now (link_status_key, every second): for `mirror-sd status` and the bench."""

    KIND: ClassVar[str] = "link_status"
    name: str
    listen: str  # host:port it accepts on
    upstream: str  # host:port it forwards to
    rtt_ms: float
    jitter_ms: float = 0.0
    connections: int = 0  # open now
    bytes_up: int = 0
    bytes_down: int = 0
    pid: int = 0
    sent_at: float = field(default_factory=time.time)


# Suffix drafts over the fleet's history (services/models/drafters/history.py): every finished output, appended by
# the driver that saw it finish, capped; every drafting process tails it into its per-tenant indexes
# (services/history_feed.py).
HISTORY_STREAM_KEY = f"{KEY_PREFIX}:history"
HISTORY_STREAM_MAX = 20000  # outputs kept (about 20 MB of ids at 250 tokens each): a new reader indexes these first


def tenant_of(api_key_id: int | None, cache_salt: str | None) -> str:
    """SessionSpec.tenant: the API key (its row id), and the cache_salt within it; "" with auth off."""
    key = "" if api_key_id is None else f"key{api_key_id}"
    return f"{key}/{cache_salt}" if cache_salt else key


@dataclass
class FinishedOutput(Message):
    """One finished request's output for the fleet's suffix history (HISTORY_STREAM_KEY)."""

    KIND: ClassVar[str] = "finished_output"
    request_id: str
    tenant: str
    prompt_tail: list[int]  # the prompt's last tokens (the chat template's), so an answer's opening matches
    output_ids: list[int]


# Synthetic drafts served by a stack (`--draft synthetic:<a>[@<ms>ms]`, docs/synthetic.md): the target's greedy
# output per prompt, written by the bench's `ar` mode, read by whoever drafts. A hash: prompt digest -> message.
SYNTHETIC_REFERENCES_KEY = f"{KEY_PREFIX}:synthetic:references"
SYNTHETIC_REFERENCES_TTL_S = 24 * 3600


@dataclass
class SyntheticReference(Message):
    """One reference run: a prompt and the target's greedy output after it (the synthetic draft's oracle)."""

    KIND: ClassVar[str] = "synthetic_reference"
    prompt_ids: list[int]
    output_ids: list[int]
