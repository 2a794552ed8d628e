"""What the gateway process holds: settings, clients, the tokenizer and the served model's limits."""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from celery import Celery
from sqlalchemy.orm import Session, sessionmaker

from gateway.admission.slots import Admission
from gateway.fleet.cache import Cached
from gateway.admission.shared import SharedAdmission
from gateway.fleet.similarity import SimilarityIndex
from gateway.fleet.similarity_log import SimilarityLog
from gateway.sessions.single_flight import SingleFlight
from gateway.streams.shared_reads import SharedReads
from gateway.streams.tally import StreamTally
from services.config import Settings

logger = logging.getLogger(__name__)

WORKERS_CACHE_S = 1.0  # the gateway asks per request which workers are alive
TABLE_CACHE_S = 0.5  # new routing reaches new sessions well within 2 s


def new_gateway_id() -> str:
    """Host, pid and a few random digits: a restarted process is a new gateway (its predecessor's slots expire)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass
class ServedModel:
    name: str  # what clients put in "model"
    aliases: frozenset[str]
    tokenizer: object
    max_context: int
    created: int = field(default_factory=lambda: int(time.time()))
    synthetic: dict | None = None  # a random-weight target or a synthetic draft: said in /v1/models and stats


@dataclass
class GatewayState:
    settings: Settings
    redis: aioredis.Redis
    celery: Celery
    db: sessionmaker[Session]
    model: ServedModel
    admission: Admission = None  # slots per tier; built from settings when not given
    metrics: object = None  # GatewayMetrics
    key_cache: dict[str, tuple[float, int, str]] = field(default_factory=dict)  # hash -> (expiry, id, priority)
    worker_cache: Cached = field(default_factory=lambda: Cached(WORKERS_CACHE_S))  # live workers' heartbeats
    routing_cache: Cached = field(default_factory=lambda: Cached(TABLE_CACHE_S))  # the RoutingTable (or None)
    wrr_state: dict[str, float] = field(default_factory=dict)  # smooth weighted round-robin over pools
    dashboard_cache: Cached = field(default_factory=lambda: Cached(0.5))  # /v1/dashboard (SNAPSHOT_CACHE_S)
    similarity: SimilarityIndex | None = None  # recent prompts, for cache-affinity routing (None: off)
    similarity_log: SimilarityLog | None = None  # several gateways: the index shared through Redis
    flights: SingleFlight = None  # identical requests sharing one generation; built on `redis` when not given
    tally: StreamTally = field(default_factory=StreamTally)  # each output stream's work counted once here
    reads: SharedReads = None  # the output streams this gateway's answers read, one XREAD for all
    gateway_id: str = field(default_factory=new_gateway_id)  # this process, among several gateways

    def __post_init__(self) -> None:
        if self.reads is None:
            self.reads = SharedReads(self.redis, self.gateway_id)
        if self.flights is None:
            self.flights = SingleFlight(self.redis)
        if self.admission is None:
            gateway = self.settings.gateway
            limits = dict(max_inflight=gateway.max_inflight, queue_limit=gateway.queue_limit,
                          queue_timeout_s=gateway.queue_timeout_s, tier_share=dict(gateway.tier_share),
                          max_inflight_per_key=gateway.max_inflight_per_key)
            self.admission = SharedAdmission(**limits, redis=self.redis, gateway_id=self.gateway_id,
                                             lease_s=gateway.admission_lease_s) \
                if gateway.shared_admission else Admission(**limits)
        if self.similarity is None and self.settings.merging.similarity_routing:
            self.similarity = SimilarityIndex(self.settings.merging)
        if self.similarity is not None and self.shared and self.similarity_log is None:
            self.similarity_log = SimilarityLog(self.redis, self.similarity, self.gateway_id)

    @property
    def shared(self) -> bool:
        """One of several gateways: admission (and similarity routing) shared through Redis."""
        return isinstance(self.admission, SharedAdmission)

    @property
    def inflight(self) -> int:
        return self.admission.inflight

    @property
    def draining(self) -> bool:
        return self.admission.draining


def load_served_model(settings: Settings) -> ServedModel:
    """Tokenizer and context size only: the gateway never loads weights, nor (for folders transformers 5 saved,
    the built-in model's included) any model code (services/models/tokenizer_loading.py)."""
    from services.models.locate import resolve_model_dir
    from services.models.random_spec import MAX_CONTEXT, is_random_spec, parse_random_spec
    from services.models.random_tokenizer import random_tokenizer
    from services.models.tokenizer_loading import load_tokenizer, max_context
    from services.synthetic import synthetic_label

    name = settings.gateway.model_name or settings.target
    label = synthetic_label(settings.target, settings.draft)
    if is_random_spec(settings.target):  # random weights: the tokenizer is built, not loaded
        parsed = parse_random_spec(settings.target)
        tokenizer = random_tokenizer(parsed.vocab_size)
        return ServedModel(name=name, aliases=frozenset({name, settings.target, parsed.name}),
                           tokenizer=tokenizer, max_context=MAX_CONTEXT, synthetic=label)
    display_name, source = resolve_model_dir(settings.target, settings.cache_dir)
    return ServedModel(
        name=name,
        aliases=frozenset({name, settings.target, display_name}),
        tokenizer=load_tokenizer(source),
        max_context=max_context(source),
        synthetic=label,
    )
