"""The `stack` bench mode: the same prompts through a running gateway (streaming, to time TTFT)."""

from __future__ import annotations

import logging

import httpx

from services.bench.formats import response_format
from services.bench.prompts import Turn
from services.engine import GenerationOptions, GenerationResult
from services.gateway_client import GatewayHTTPError, chat_body, stream_chat
from services.speculative.stats import SpecDecodingStats

logger = logging.getLogger(__name__)


def _stats(payload: dict) -> SpecDecodingStats:
    """The response's mirror_sd stats, every counter it carries (suffix and forced drafts too); its rounds are the
    target calls."""
    return SpecDecodingStats.from_wire({**payload, "num_target_calls": payload.get("num_rounds", 0)})


def request_body(model: str, turn: Turn, options: GenerationOptions) -> dict:
    """A turn's streamed chat request: its messages, the run's sampling, and its schema as response_format."""
    sampling = options.sampling
    body = chat_body(model, turn.messages, options.max_new_tokens, temperature=sampling.temperature,
                     top_p=sampling.top_p, top_k=sampling.top_k, seed=sampling.seed)
    if turn.schema is not None:
        body["response_format"] = response_format(turn.schema)
    return body


def run_one(client: httpx.Client, model: str, turn: Turn, options: GenerationOptions) -> GenerationResult:
    """One turn through the gateway: its chat messages (the stack's own earlier answers in them), streamed."""
    body = request_body(model, turn, options)
    try:
        answer = stream_chat(client, body).raise_for_error(turn.id)
    except GatewayHTTPError as exc:
        raise RuntimeError(f"{turn.id}: {exc}") from None
    return GenerationResult(
        text=answer.text, token_ids=answer.token_ids or [],
        prompt_tokens=(answer.usage.get("usage") or {}).get("prompt_tokens", 0),
        finish_reason=answer.finish_reason or "length", stats=_stats(answer.stats), draft="stack",
        ttft_s=answer.ttft_s or answer.total_s, total_s=answer.total_s,
    )


def served_model(client: httpx.Client, default: str) -> tuple[str, dict | None]:
    """The model a stack serves (its /v1/models id; `default` when it does not answer) and its synthetic label
    (services/synthetic.py: a random-weight target or a synthetic draft), None for a real stack."""
    try:
        answer = client.get("/v1/models")
        answer.raise_for_status()
        entry = answer.json()["data"][0]
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        logger.warning("the stack's /v1/models did not answer; asking for %s, labelled as a real stack", default)
        return default, None
    return entry.get("id", default), entry.get("mirror_sd_synthetic")


def transport_samples(redis_url: str) -> list[float]:
    """Per-round transport overheads the draft workers recorded (ms, newest first)."""
    from services.redis_conn import connect

    from services.protocol import TRANSPORT_SAMPLES_KEY

    return sample_list(connect(redis_url), TRANSPORT_SAMPLES_KEY)


def sample_list(client, key: str) -> list[float]:
    """One of the draft workers' capped sample lists (TRANSPORT_SAMPLES_KEY, ROUND_TRIP_SAMPLES_KEY), newest
    first."""
    return [float(value) for value in client.lrange(key, 0, -1)]


def new_samples(before: int, samples: list[float]) -> list[float]:
    """The samples pushed since the list held `before` of them (all of them once it reached its cap)."""
    from services.protocol import TRANSPORT_SAMPLES_MAX

    return samples[: max(0, len(samples) - before)] if before < TRANSPORT_SAMPLES_MAX else samples


def fleet_draft_ms_per_token(redis_url: str) -> float | None:
    """Mean draft ms/token over the live draft workers' start-up profiles (None if none reports one)."""
    from services.redis_client import read_heartbeats
    from services.redis_conn import connect

    values = [float(beat.profile["draft_ms_per_token"]) for beat in read_heartbeats(connect(redis_url))
              if beat.role == "draft" and "draft_ms_per_token" in beat.profile]
    return sum(values) / len(values) if values else None


def draft_timing(redis_url: str) -> dict[str, float]:
    """Summed drafting time and speculation counts the draft workers recorded (see services/engine/draft_pipeline.py)."""
    from services.redis_conn import connect

    from services.protocol import DRAFT_TIMING_KEY

    client = connect(redis_url)
    return {key.decode(): float(value) for key, value in client.hgetall(DRAFT_TIMING_KEY).items()}


def pipeline_summary(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The bench's window of the draft workers' timing: how much drafting pipelining hid."""
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    drafting = delta.get("draft_s", 0.0) + delta.get("speculation_s", 0.0)
    speculations = delta.get("speculations", 0.0)
    return {
        **delta,
        "drafting_s": drafting,
        "hidden_fraction": delta.get("hidden_s", 0.0) / drafting if drafting else 0.0,
        "speculation_hit_rate": delta.get("speculation_hits", 0.0) / speculations if speculations else 0.0,
    }
