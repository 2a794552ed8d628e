"""Prometheus metrics of the gateway: collected in a stats object per request, exported here.

Names follow vLLM's (`vllm:` -> `mirror_sd:`), so existing dashboards map over.
"""

from __future__ import annotations

import logging
import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gateway.observability.live_stats import LiveStats
from services.gateways import MULTIPROC_ENV
from services.protocol import CHILD_STATES, ChildStatus, Heartbeat, RoutingTable

logger = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("mirror_sd:requests", "Finished requests", ["endpoint", "finish_reason"], registry=r)
        self.rejected = Counter("mirror_sd:requests_rejected", "Requests refused before reaching a worker",
                                ["status"], registry=r)
        self.prompt_tokens = Counter("mirror_sd:prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("mirror_sd:generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("mirror_sd:time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("mirror_sd:time_per_output_token_seconds", "Time per output token after the first",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.num_drafts = Counter("mirror_sd:spec_decode_num_drafts", "Rounds that verified >= 1 draft token",
                                  registry=r)
        self.num_draft_tokens = Counter("mirror_sd:spec_decode_num_draft_tokens", "Draft tokens proposed",
                                        registry=r)
        self.num_accepted_tokens = Counter("mirror_sd:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                           registry=r)
        self.num_accepted_tokens_per_pos = Counter(
            "mirror_sd:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the block",
            ["position"], registry=r)
        self.drafts_by_drafter = Counter(
            "mirror_sd:spec_decode_num_drafts_by_drafter", "Rounds that verified >= 1 draft token, by who drafted "
            "the block: suffix (the conversation), history (the tenant's earlier outputs), model (the model draft "
            "or prompt lookup)", ["drafter"], registry=r)
        self.accepted_by_drafter = Counter(
            "mirror_sd:spec_decode_num_accepted_tokens_by_drafter", "Draft tokens accepted, by who drafted the block "
            "(suffix and history together: suffix)", ["drafter"], registry=r)
        self.forced_draft_tokens = Counter(
            "mirror_sd:spec_decode_num_forced_draft_tokens", "Draft tokens a request's grammar forced (structured "
            "output: drafted for free, whoever drafted)", registry=r)
        self.forced_accepted_tokens = Counter(
            "mirror_sd:spec_decode_num_forced_accepted_tokens", "Forced draft tokens accepted", registry=r)
        # several gateway processes on one port: the live processes' sum
        self.inflight = Gauge("mirror_sd:requests_inflight", "Requests being served", registry=r,
                              multiprocess_mode="livesum")
        self.queued = Gauge("mirror_sd:requests_waiting", "Requests waiting for an admission slot", registry=r,
                            multiprocess_mode="livesum")
        self.revived = Counter("mirror_sd:sessions_revived", "Sessions re-sent after their draft worker died",
                               registry=r)
        self.lost = Counter("mirror_sd:requests_lost", "Requests whose state Redis lost (ended with an error)",
                            registry=r)
        self.prefix_queries = Counter("mirror_sd:prefix_cache_queries", "Prompt tokens of finished requests (the "
                                      "prefix cache was asked for them)", registry=r)
        self.prefix_hits = Counter("mirror_sd:prefix_cache_hits", "Prompt tokens whose KV was reused, not prefilled",
                                   registry=r)
        self.affinity_routed = Counter("mirror_sd:affinity_routed", "Requests sent to the verify worker holding a "
                                       "similar recent request's KV", registry=r)
        self.fleet = FleetCollector()
        r.register(self.fleet)
        self.live = LiveStats()  # the same observations per second, for the dashboard
        self.single_flight_merged = Counter(
            "mirror_sd:single_flight_merged", "Requests answered from an identical request's generation in flight "
            "(single-flight followers)", registry=r)

    @property
    def multiprocess(self) -> bool:
        """One of several gateway processes on one port (services/gateways.py): figures kept in files they share."""
        return bool(os.environ.get(MULTIPROC_ENV))

    def exposition(self) -> bytes:
        """This process's figures; or, one of several gateway processes on a port, all of theirs summed (the
        scrape sees the host's totals whichever process answers); the fleet's from Redis either way."""
        if not self.multiprocess:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        registry.register(self.fleet)
        return generate_latest(registry)

    def observe_finished(self, *, endpoint: str, finish_reason: str | None, prompt_tokens: int,
                         completion_tokens: int, ttft_s: float | None, total_s: float, event) -> None:
        self.requests.labels(endpoint, finish_reason or "unknown").inc()
        self.live.observe_finished(ttft_s=ttft_s, stats=event.stats if event is not None else None)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            if completion_tokens > 1:
                self.tpot.observe((total_s - ttft_s) / (completion_tokens - 1))
        if event is not None:  # once per generation (a single-flight follower passes None)
            self.prefix_queries.inc(prompt_tokens)
            self.prefix_hits.inc(event.num_cached_tokens)
            stats = event.stats
            self.num_drafts.inc(stats.num_drafts)
            self.num_draft_tokens.inc(stats.num_draft_tokens)
            self.num_accepted_tokens.inc(stats.num_accepted_tokens)
            for position, accepted in enumerate(stats.num_accepted_tokens_per_pos):
                self.num_accepted_tokens_per_pos.labels(str(position)).inc(accepted)
            for drafter, drafts in drafts_by_drafter(stats).items():
                self.drafts_by_drafter.labels(drafter).inc(drafts)
            self.accepted_by_drafter.labels("suffix").inc(stats.num_suffix_accepted_tokens)
            self.accepted_by_drafter.labels("model").inc(stats.num_accepted_tokens - stats.num_suffix_accepted_tokens)
            self.forced_draft_tokens.inc(stats.num_forced_draft_tokens)
            self.forced_accepted_tokens.inc(stats.num_forced_accepted_tokens)


def drafts_by_drafter(stats) -> dict[str, int]:
    """A request's drafted rounds by who drafted them (SpecDecodingStats' suffix counters)."""
    return {"suffix": stats.num_suffix_drafts - stats.num_history_drafts, "history": stats.num_history_drafts,
            "model": stats.num_drafts - stats.num_suffix_drafts}


STEP_COUNTERS = {  # a verify worker's heartbeat step_counters: (unit suffix, help)
    "steps": ("", "Target steps a verify worker ran"),
    "rows": ("", "Rows (sessions) over all its steps"),
    "tokens": ("", "Tokens fed over all its steps (prefill chunks, blocks to verify, single tokens)"),
    "forward_s": ("_seconds", "Time in the engine's forward"),
    "step_s": ("_seconds", "Time in steps: the forward, preparing rows, the round math, commits"),
    "bridged_rounds": ("", "Target-only rounds run for a session while its next block was on its way (bridging), "
                       "counted when the block came"),
    "blocks_bridged": ("", "Blocks that came after bridged rounds"),
    "blocks_answered": ("", "Of those, blocks with nothing left to verify (answered at once)"),
    "wide_steps": ("", "Steps run on worker.wide_threads (no draft worker drafting for any of its sessions)"),
}


class FleetCollector:
    """Worker readings and routing weights as of the last scrape (filled by the /metrics route)."""

    def __init__(self) -> None:
        self.beats: list[Heartbeat] = []
        self.table: RoutingTable | None = None
        self.children: list[ChildStatus] = []  # `mirror-sd up`'s supervisor: its children, as last published

    def collect(self):
        readings = {
            "temperature_celsius": ("Worker device temperature", lambda b: b.temperature_c),
            "utilization": ("Worker device utilization 0..1", lambda b: b.utilization),
            "queue_depth": ("Blocks waiting in the worker's pool queue", lambda b: b.queue_depth),
            "sessions": ("Sessions held by the worker", lambda b: b.num_sessions),
            "batch_rows": ("Verify workers: mean rows per target step", lambda b: b.batch_rows if b.role == "verify"
                           else None),
            "prefix_hits": ("Verify workers: sessions started from another sequence's prefix (cumulative)",
                            lambda b: b.prefix_cache.get("hits")),
            "prefix_reused_tokens": ("Verify workers: KV positions copied instead of prefilled (cumulative)",
                                     lambda b: b.prefix_cache.get("reused_tokens")),
            "prefix_retired_bytes": ("Verify workers: KV bytes of finished sessions kept for prefix reuse",
                                     lambda b: b.prefix_cache.get("retired_bytes")),
            "suffix_history_tokens": ("Drafting processes: tokens of the tenants' earlier outputs their suffix "
                                      "drafts read (bounded by suffix.history_tokens per tenant)",
                                      lambda b: b.suffix_history.get("tokens")),
            "suffix_history_bytes": ("Drafting processes: memory their suffix history holds (fixed per tenant's "
                                     "index; suffix.max_tenants indexes at most)",
                                     lambda b: b.suffix_history.get("bytes")),
        }
        for name, (doc, read) in readings.items():
            family = GaugeMetricFamily(f"mirror_sd:worker_{name}", doc, labels=["worker", "role", "pool"])
            for beat in self.beats:
                value = read(beat)
                if value is not None:
                    family.add_metric([beat.worker_id, beat.role, beat.pool], float(value))
            yield family
        weights = GaugeMetricFamily("mirror_sd:routing_pool_weight", "Share of new sessions per pool",
                                    labels=["pool"])
        version = GaugeMetricFamily("mirror_sd:routing_table_version", "Routing table version")
        alerts = GaugeMetricFamily("mirror_sd:rejection_alert", "1 while a worker's rejection rate is over the line",
                                   labels=["worker"])
        if self.table is not None:
            for pool, weight in self.table.pool_weights.items():
                weights.add_metric([pool], weight)
            version.add_metric([], self.table.version)
            for worker in self.table.alerts:
                alerts.add_metric([worker], 1.0)
        yield weights
        yield version
        yield alerts
        fallbacks = GaugeMetricFamily("mirror_sd:draft_fallback", "1 while a draft worker serves with a fallback "
                                      "draft because the one it was given cannot run here", labels=["worker", "draft",
                                                                                                    "serving", "fault"])
        for beat in self.beats:
            if beat.draft_fallback is not None:
                fallback = beat.draft_fallback
                fallbacks.add_metric([beat.worker_id, fallback.draft, fallback.serving, fallback.fault], 1.0)
        yield fallbacks
        turns = GaugeMetricFamily("mirror_sd:local_turn_tokens_per_second", "Committed tokens per second of a "
                                  "verify worker's turns (co-located drafting) or steps (remote drafts, its word on "
                                  "the load) that drafted and that did not, by load (sessions held, bucketed); the "
                                  "faster arm is taken at that load",
                                  labels=["worker", "load", "arm"])
        for beat in self.beats:
            for load, arms in beat.local_turns.items():
                for arm, rate in arms.items():
                    turns.add_metric([beat.worker_id, str(load), arm], float(rate))
        yield turns
        yield from self._step_counters()
        yield from self._draft_links()
        restarts = GaugeMetricFamily("mirror_sd:child_restarts", "Restarts of each `mirror-sd up` child process "
                                     "by its supervisor", labels=["child"])
        states = GaugeMetricFamily("mirror_sd:child_state", "1 for the state each `mirror-sd up` child is in "
                                   "(failed: it kept dying at start and is no longer restarted)",
                                   labels=["child", "state"])
        for child in self.children:
            restarts.add_metric([child.name], child.restarts)
            for state in CHILD_STATES:
                states.add_metric([child.name, state], 1.0 if child.state == state else 0.0)
        yield restarts
        yield states

    def _step_counters(self):
        """Verify workers' cumulative step counters (verify_worker/figures.py StepCounters), as Prometheus
        counters: rate() of them gives steps, rows and tokens a second, bridging and the share of wide steps."""
        for name, (unit, doc) in STEP_COUNTERS.items():
            family = CounterMetricFamily(f"mirror_sd:verify_{name.removesuffix('_s')}{unit}", doc,
                                         labels=["worker", "pool"])
            for beat in self.beats:
                value = beat.step_counters.get(name) if beat.role == "verify" else None
                if value is not None:
                    family.add_metric([beat.worker_id, beat.pool], float(value))
            yield family

    def _draft_links(self):
        """Draft workers' link figures (services/link/meter.py), in seconds: Redis RTT, the driver's round trips
        per round, and per round the round trip and the transport (round trip - the verify worker's time - the draft driver's time elsewhere)."""
        rtt = GaugeMetricFamily("mirror_sd:draft_redis_rtt_seconds", "A draft worker's Redis PING, smoothed",
                                labels=["worker", "pool"])
        trips = GaugeMetricFamily("mirror_sd:draft_redis_round_trips_per_round", "Round trips to Redis a draft "
                                  "worker's driver spends per round (1 while blocks flow)", labels=["worker", "pool"])
        ahead = GaugeMetricFamily("mirror_sd:draft_verified_ahead_ratio", "Share of a draft worker's rounds whose "
                                  "block its verify worker took before the verdict of the block before it reached "
                                  "the draft (blocks verified ahead), since start", labels=["worker", "pool"])
        resent = CounterMetricFamily("mirror_sd:draft_resent_blocks", "Blocks a draft worker sent again to a live "
                                     "verify worker that had not answered them for a resend period and no longer "
                                     "queued them (each is in its log), since start", labels=["worker", "pool"])
        failed_over = CounterMetricFamily("mirror_sd:draft_failed_over_blocks", "Blocks a draft worker sent to "
                                          "its pool again because the verify worker holding them stopped "
                                          "heartbeating, or died before saying it took them, since start",
                                          labels=["worker", "pool"])
        families = {figure: GaugeMetricFamily(f"mirror_sd:draft_{figure}_seconds", doc, labels=["worker", "pool",
                                                                                                "quantile"])
                    for figure, doc in (("round_trip", "Draft block sent -> its verdict seen, on the draft "
                                         "worker's clock, over its recent rounds"),
                                        ("transport", "Round trip less the verify worker's own time for the block "
                                         "and the draft driver's time on other work, over its recent rounds"))}
        for beat in self.beats:
            link = beat.link
            if beat.role != "draft" or link is None:
                continue
            if link.redis_rtt_ms is not None:
                rtt.add_metric([beat.worker_id, beat.pool], link.redis_rtt_ms / 1000)
            if link.round_trips_per_round is not None:
                trips.add_metric([beat.worker_id, beat.pool], link.round_trips_per_round)
            if link.verified_ahead is not None:
                ahead.add_metric([beat.worker_id, beat.pool], link.verified_ahead)
            resent.add_metric([beat.worker_id, beat.pool], link.resent_blocks)
            failed_over.add_metric([beat.worker_id, beat.pool], link.failed_over_blocks)
            for figure, family in families.items():
                for suffix, quantile in (("p50", "0.5"), ("p99", "0.99")):
                    value = getattr(link, f"{figure}_ms_{suffix}")
                    if value is not None:
                        family.add_metric([beat.worker_id, beat.pool, quantile], value / 1000)
        yield rtt
        yield trips
        yield ahead
        yield resent
        yield failed_over
        yield from families.values()
