"""One settings object per process.

Values come, highest priority first, from keyword arguments, environment
variables `MIRROR_SD_*` (nested with `__`, e.g.
`MIRROR_SD_SPECULATIVE__MAX_DRAFT_TOKENS=6`), the YAML file named by
`MIRROR_SD_CONFIG`, and the defaults below, which run on one laptop.
"""

from __future__ import annotations

import logging
import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

import platformdirs
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from services.redis_url import check_redis_url

logger = logging.getLogger(__name__)

Precision = Literal["fp32", "bf16", "fp16", "int8"]


class SpeculativeSettings(BaseModel):
    """Block length (gamma) control and the low-acceptance fallback."""

    num_draft_tokens: int = Field(4, ge=1, description="initial gamma")
    min_draft_tokens: int = Field(1, ge=1)
    max_draft_tokens: int = Field(8, ge=1)
    window: int = Field(10, ge=1, description="rounds of acceptance history")
    raise_above: float = Field(0.8, ge=0.0, le=1.0, description="window acceptance that grows gamma")
    raise_step: int = Field(2, ge=0)
    lower_step: int = Field(1, ge=0)
    fallback_below: float = Field(0.3, ge=0.0, le=1.0, description="acceptance that switches to target-only")
    fallback_min_rounds: int = Field(5, ge=1, description="drafted rounds seen before fallback may trigger")
    probe_after_rounds: int = Field(64, ge=0, description="target-only rounds before drafting is retried; 0 never")
    block_policy: Literal["acceptance", "cost"] = Field(
        "cost", description="cost: most tokens per ms from the measured step-cost grid (rows x tokens) at the "
        "current load, the draft cost and the measured acceptance; acceptance: the +raise_step/-lower_step rule. "
        "Without a measured profile (in-process, tiny models) the acceptance rule applies")
    prior_acceptance: float = Field(0.6, ge=0.0, le=1.0, description="per-token acceptance assumed by the cost "
                                    "policy before a session has drafted")
    ngram_max: int = Field(4, ge=1)
    ngram_min: int = Field(2, ge=1)
    plain_opening_tokens: int = Field(1, ge=0, description="pipelined model drafts: a session whose prompt "
                                      "is at least this long opens with one target-only round, and the draft "
                                      "prefills its KV while the target prefills (TTFT: the target's prefill "
                                      "alone, not the draft's first); 0 = always draft the first block")
    draft_context_tokens: int = Field(1024, ge=0, description="a model draft reads only the last N tokens of a "
                                      "prompt (and all that follows): a very long prompt costs it N tokens of "
                                      "prefill and shorter attention; prompt lookup still reads it all; 0 = "
                                      "the whole prompt. A draft cut off from the prompt's start accepts less: "
                                      "at 256, the built-in draft's summarization prompts fell from 0.88 to "
                                      "0.66 (docs/bench/draft-context-2026-12-06)")
    draft_prefill: Literal["overlap", "after_opening"] = Field(
        "overlap", description="when a remote model draft prefills a new session: overlap, while the target "
        "prefills its opening round (free where the draft has hardware of its own); after_opening, after the "
        "opening's verdict unless the draft worker is drafting for other sessions then, with the verify worker "
        "decoding the session target-only (bridging) until its first drafted block comes: where the two share "
        "cores the opening's prefill gets all of them (worker.wide_threads). `mirror-sd up` sets it with "
        "wide threads")

    @model_validator(mode="after")
    def _check_bounds(self) -> "SpeculativeSettings":
        if not self.min_draft_tokens <= self.num_draft_tokens <= self.max_draft_tokens:
            raise ValueError(
                f"need min_draft_tokens <= num_draft_tokens <= max_draft_tokens, got "
                f"{self.min_draft_tokens} <= {self.num_draft_tokens} <= {self.max_draft_tokens}"
            )
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min {self.ngram_min} > ngram_max {self.ngram_max}")
        return self


class SuffixSettings(BaseModel):
    """Suffix drafts (`--draft suffix`, `suffix:<model draft>`): the continuation of the context's longest earlier
    match in the conversation or the tenant's earlier outputs (docs/drafts.md, suffix drafts)."""

    history_tokens: int = Field(1 << 18, ge=0, description="tokens of earlier outputs indexed per tenant, per "
                                "drafting process (the oldest evicted; 0: no fleet history, the conversation only). "
                                "Memory: about 52 bytes a token (ids, links, chain tables: 13.6 MB at the default), fixed "
                                "when a tenant's index is created")
    max_tenants: int = Field(8, ge=1, description="tenants' indexes held at once per process (the least recently "
                             "used dropped for a new one)")
    share_across_tenants: bool = Field(False, description="one history for every API key and cache_salt: a "
                                       "draft's speed could then reveal another tenant's text; off by default")
    max_depth: int = Field(32, ge=2, description="longest match looked for, tokens")
    min_match: int = Field(2, ge=1, description="shortest match a draft is made from")
    max_draft_tokens: int = Field(16, ge=1, description="a sure match may be drafted this long, past the block "
                                  "length chosen for the model draft (it costs nothing to draft; its length is "
                                  "the one with the most expected tokens per verified cost)")
    min_prob: float = Field(0.1, gt=0.0, le=1.0, description="a draft stops where the estimated chance that all "
                            "its tokens are right falls below this")
    max_spec_factor: float = Field(1.0, gt=0.0, description="a draft is at most this many tokens per matched "
                                   "token, plus max_spec_offset (a short match predicts a short way)")
    max_spec_offset: float = Field(1.0, ge=0.0)
    model_draft_cost: float = Field(0.3, ge=0.0, description="suffix:<model>: one model draft token's cost in "
                                    "one-token target forwards, where no measured profile says (a profile's ratio "
                                    "replaces it)")
    verify_growth: float = Field(0.05, ge=0.0, description="each extra verified token's cost in one-token target "
                                 "forwards, where no measured profile says")


class LlamaCppSettings(BaseModel):
    """llama.cpp drafts (`--draft gguf:PATH`): one context per draft worker process, one sequence per session."""

    threads: int | None = Field(None, ge=1, description="llama.cpp threads; None = num_threads, else the cores "
                                "this process may run on")
    num_sequences: int = Field(32, ge=1, le=256, description="sessions whose draft KV stays in the context at "
                               "once; more are served, the least recently drafted giving their slot up")
    context_tokens: int = Field(2048, ge=64, description="draft KV positions per session (prompt + output); a "
                                "longer session is decoded by the target alone past this")
    batch_tokens: int = Field(512, ge=16, description="tokens per llama_decode call (prefill goes in pieces)")
    check_engine: bool = Field(True, description="decode the GGUF once in a child process before loading llama.cpp "
                               "in-process (cached per GGUF, build and CPU): a build that faults on this CPU is "
                               "refused with its fault named instead of killing the process")


class CrashedDraft(BaseModel):
    """A draft a worker process kept crashing with at start (services/stack.py's draft_fallback)."""

    draft: str
    fault: str  # the signal, e.g. SIGSEGV
    reason: str


class WorkerSettings(BaseModel):
    """Draft and verify worker processes."""

    pool: str = Field("cpu", pattern=r"^[a-z0-9_-]+$", description="pool this worker serves")
    device_kind: str | None = Field(None, pattern=r"^[a-z0-9_-]+$", description="verify workers: the device kind "
                                    "heartbeats report instead of the probed one, e.g. accelerator: declares a pool "
                                    "an accelerator for thermal drills on a CPU-only box (readings stay the probe's)")
    worker_id: str | None = Field(None, description="stable id; default host-pid")
    heartbeat_interval_s: float = Field(1.0, gt=0)
    heartbeat_ttl_s: float = Field(3.0, gt=0)
    kv_budget_mb: int = Field(2048, ge=1, description="verify worker KV-cache budget")
    wide_threads: int | None = Field(None, ge=1, description="verify workers: torch threads for a step of 16+ "
                                     "tokens (prefill chunks, many rows) while no draft worker drafts for any of "
                                     "its sessions (the plain route, target-only rounds, a fallen-back draft), "
                                     "and for smaller plain steps from the size at which they were timed faster "
                                     "so at start (services/engine/wide_steps.py); num_threads otherwise. On one "
                                     "box the draft worker's core is idle then: `mirror-sd up` sets it to every "
                                     "core. None: num_threads always")
    load_word: bool = Field(True, description="verify workers: measure committed tokens per second of their steps "
                            "while every remote draft drafts and while none does, per load, and tell the drafts in "
                            "each verdict to send target-only rounds where those measured faster (verify_worker/"
                            "load_word.py); False: each draft's cost model alone decides")
    verdict_timeout_s: float = Field(120.0, gt=0, description="draft side: give up on a round after this")
    draft_concurrency: int = Field(128, ge=1, description="sessions one draft worker process drives at once (Celery "
                                   "task threads that only wait: one driver thread does the hot path for all)")
    pipelined_drafting: bool = Field(True, description="draft block k+1 while block k is verified")
    blocks_ahead: int = Field(0, ge=0, le=16, description="remote drafts: blocks a draft worker keeps at the "
                              "session's verify worker ahead of their verdicts, each drafted assuming the one "
                              "before is accepted whole (the verify worker goes on with it at once when it is, "
                              "without a trip over the link); 1 = one at a time; 0 = from the measured Redis "
                              "RTT and verify time (2 at least; needs pipelined_drafting)")
    profile_cache: bool = Field(True, description="workers keep their measured profiles (the verify step-cost "
                                "grid, the draft's cost per token) in cache_dir/profiles and reuse them while "
                                "model, device and threads stay the same")
    draft_fallback: bool = Field(True, description="draft workers: a model draft that cannot run here (its "
                                 "engine crashes, hangs or fails its check, or under `mirror-sd up` the worker "
                                 "keeps crashing at start) is replaced by suffix drafts alone (no model), lossless "
                                 "but slower, and the heartbeat says so (draft_fallback); false: the worker fails "
                                 "instead")
    draft_placement: Literal["remote", "local"] = Field(
        "remote", description="verify workers: remote, draft workers draft their sessions (a fleet, drafts on other "
        "hosts); local, the verify worker drafts for its own sessions in-process with `draft`, between its "
        "forwards on all its cores (one box: no core split, no Redis hop per round)")
    crashed_draft: CrashedDraft | None = Field(None, description="set by `mirror-sd up`'s supervisor (JSON) when "
                                               "it restarts a draft worker that kept crashing at start with suffix "
                                               "drafts alone: the draft that crashed and how; the heartbeat says so")


class GatewaySettings(BaseModel):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    auth_disabled: bool = Field(False, description="development only: accept requests without an API key")
    request_timeout_s: float = Field(600.0, gt=0)
    model_name: str | None = Field(None, description="name served in /v1/models; default the target spec")
    max_inflight: int = Field(256, ge=1, description="requests in flight; the high tier may fill all of it")
    tier_share: dict[Literal["high", "normal", "low"], float] = Field(
        default_factory=lambda: {"high": 1.0, "normal": 0.9, "low": 0.75},
        description="share of max_inflight each priority tier may fill (the rest is kept for higher tiers)")
    queue_limit: int = Field(0, ge=0, description="requests that may wait for a slot (0: none, a full tier is "
                             "503 at once); beyond it 503 at once")
    queue_timeout_s: float = Field(1.0, ge=0, description="longest wait for a slot before 503")
    max_inflight_per_key: int = Field(0, ge=0, description="requests in flight per API key before 429 (0: none)")
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM: how long in-flight requests may finish")
    redis_pool_timeout_s: float = Field(10.0, gt=0, description="wait for a free Redis connection before 503")
    shared_admission: bool = Field(False, description="several gateways: count in-flight slots (per tier, per "
                                   "key) in Redis so the limits hold across all of them; `gateway --workers N` and "
                                   "`up --gateways N` set it")
    admission_lease_s: float = Field(10.0, gt=0, description="shared admission: a gateway that stops renewing its "
                                     "lease this long (killed) has its slots dropped")
    open_sessions: bool = Field(True, description="placement remote: when a session's first round is target-only "
                                "anyway (the plain route, or a model draft that prefills meanwhile), the gateway "
                                "sends it to the verify pool itself, so the first token does not wait for a draft "
                                "worker's start over its link")


class TelemetrySettings(BaseModel):
    """Fallback-rule thresholds (DESIGN.md, "Telemetry and routing")."""

    interval_s: float = Field(0.5, gt=0, description="how often the routing table is recomputed")
    hot_temperature_c: float = Field(85.0, description="accelerator temperature that moves traffic away")
    cool_temperature_c: float = Field(80.0, description="hysteresis: traffic returns below this")
    thermal_shift: float = Field(1.0, ge=0.0, le=1.0, description="share of a hot worker's new sessions moved")
    fallback_pool: str = "cpu"
    utilization_gap: float = Field(0.30, ge=0.0, le=1.0)
    rebalance_step: float = Field(0.10, ge=0.0, le=1.0)
    rejection_alert: float = Field(0.20, ge=0.0, le=1.0)
    latency_p99_ms: float = Field(200.0, gt=0)
    latency_over_unloaded: float = Field(3.0, ge=1.0, description="a pool is degraded only while its p99 per-token "
                                         "latency is also above this many times a worker's own 1-token forward "
                                         "(its profile): load made it slow, not the model's size")
    acceptance_floor: float = Field(0.30, ge=0.0, le=1.0)
    min_drafted_for_acceptance: int = Field(50, ge=1, description="draft tokens seen before acceptance rules act")
    heartbeat_timeout_s: float = Field(3.0, gt=0)
    short_prompt_tokens: int = Field(50, ge=0, description="prompts under this may go to short_prompt_pool")
    short_prompt_pool: str | None = None
    snapshot_interval_s: float = Field(10.0, ge=0, description="heartbeat history into SQL; 0 = off")
    metrics_host: str = "127.0.0.1"
    metrics_port: int = Field(9464, ge=0, le=65535, description="Prometheus /metrics of the service; 0 = off")


class SchedulerSettings(BaseModel):
    """Verify-side batching (the seed's `scheduler:` block): continuous batching over sessions."""

    model_config = ConfigDict(populate_by_name=True)

    max_batch_size: int = Field(32, ge=1, description="rows (sessions) in one target step")
    timeout_ms: float = Field(50.0, ge=0.0, validation_alias=AliasChoices("timeout_ms", "batch_timeout_ms"),
                              description="batch window: how long a step may wait for blocks known to be "
                              "coming (sessions that just got a verdict); no wait when none is")
    max_batch_tokens: int = Field(128, ge=1, description="tokens in one step (like vLLM's max_num_batched_tokens): "
                                  "prompts are prefilled in chunks within it, so running streams are held up by at "
                                  "most one chunk per step; raise it where a step's cost is flat in tokens (GPUs)")
    prefill_only_batch_tokens: int = Field(512, ge=1, description="tokens in one step while no stream runs on the "
                                           "worker (every session it holds is still prefilling its prompt): no "
                                           "one waits behind a longer step, and fewer steps bring the first token "
                                           "sooner (a lone 300-token prompt in 128-token chunks: about 1.2x "
                                           "target-only's TTFT on 2 cores, docs/bench/prefill-alone-2026-12-04); "
                                           "max_batch_tokens applies again once a stream runs")
    bridge: bool = Field(False, description="between a verdict and a remote speculative session's next block, "
                         "decode it target-only instead of idling (the plain route always does, and so does a "
                         "session after target-only rounds past its opening), and check the block against those "
                         "tokens when it comes "
                         "(services/speculative/bridging.py; lossless; greedy and unseeded sampling). Steadier "
                         "streams; +7% at 20 ms RTT where the verify worker has its cores to itself, -7% where it "
                         "shares them with a draft worker, as on one box (docs/bench/bridging-2026-12-03)")


class MergingSettings(BaseModel):
    """Work shared between similar requests: prefix KV reuse on verify workers, similarity routing on the
    gateway (cache affinity), single-flight of identical requests."""

    prefix_reuse: bool = Field(True, description="verify workers start a session from the longest common token "
                               "prefix another session's KV holds instead of prefilling it")
    min_prefix_tokens: int = Field(32, ge=1, description="shortest common prefix worth reusing")
    retired_sessions: int = Field(64, ge=0, description="finished sessions whose KV a verify worker keeps for reuse "
                                  "(inside worker.kv_budget_mb, evicted before any live session; 0: none)")
    similarity_routing: bool = Field(True, description="the gateway sends a request similar to a recent one to the "
                                     "verify worker that holds that one's KV, unless routing rules forbid it")
    similarity_threshold: float = Field(0.85, ge=0.0, le=1.0, description="estimated Jaccard similarity of prompt "
                                        "shingles that counts as similar (MinHash LSH)")
    minhash_permutations: int = Field(64, ge=16, le=1024, description="MinHash size: more is more exact, slower")
    shingle_tokens: int = Field(4, ge=1, description="tokens per shingle of a prompt")
    index_size: int = Field(4096, ge=1, description="recent prompts the gateway's similarity index remembers")
    single_flight: bool = Field(True, description="identical requests in flight at once (greedy, or sampled with "
                                "the same seed) share one generation, streamed to each of their clients")


def default_cache_dir() -> Path:
    return Path(platformdirs.user_cache_dir("mirror-sd"))


def _default_database_url() -> str:
    data_dir = Path(platformdirs.user_data_dir("mirror-sd"))
    return f"sqlite:///{data_dir / 'mirror-sd.db'}"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="MIRROR_SD_",
        env_nested_delimiter="__",
        extra="ignore",
    )

    environment: Literal["development", "test", "production"] = "development"
    redis_url: str = "redis://127.0.0.1:6379/0"
    database_url: str = Field(default_factory=_default_database_url)
    cache_dir: Path = Field(default_factory=default_cache_dir)

    target: str = "smollm2-135m"
    target_precision: Precision = "fp32"
    draft: str = Field("auto", description="draft spec (services/models/drafters/factory.py); auto: for the "
                       "built-in target the per-round choice between suffix drafts and its own GGUF on llama.cpp "
                       "(suffix:gguf:<alias>); else suffix drafts alone")
    draft_precision: Precision = "fp32"
    device: str = "cpu"
    cpu_weight_layout: Literal["auto", "transposed", "native"] = Field(
        "auto", description="fp32 Linear weights on CPU (linear_layout.py): which is faster depends on the CPU's "
        "kernels; auto measures both once on the model served (1-9 token forwards) and keeps the faster "
        "(services/engine/layout_choice.py)")
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads; None = torch default")

    log_format: Literal["text", "json"] = Field(
        "text", description="json: every service logs one JSON object per line (ts, level, logger, message, service, "
        "worker_id, request_id), for log pipelines; text: for a terminal (services/logs.py)")

    prefill_chunk_size: int = Field(512, ge=1)
    max_new_tokens_limit: int = Field(4096, ge=1)

    speculative: SpeculativeSettings = Field(default_factory=SpeculativeSettings)
    suffix: SuffixSettings = Field(default_factory=SuffixSettings)
    llamacpp: LlamaCppSettings = Field(default_factory=LlamaCppSettings)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    merging: MergingSettings = Field(default_factory=MergingSettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        return check_redis_url(value)

    @model_validator(mode="after")
    def _refuse_unsafe_outside_development(self) -> "Settings":
        if self.environment == "production" and self.gateway.auth_disabled:
            raise ValueError("gateway.auth_disabled is for development only; it is refused in production")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources = [init_settings, env_settings]
        config_file = os.environ.get("MIRROR_SD_CONFIG")
        if config_file:
            if not Path(config_file).is_file():
                raise ValueError(f"MIRROR_SD_CONFIG={config_file!r} is not a file")
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=config_file))
        return tuple(sources)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process's settings, validated once at start."""
    return Settings()
