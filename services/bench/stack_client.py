"""The `stack` bench mode: the same prompts through a running gateway (streaming, to time TTFT)."""

from __future__ import annotations

import json
import logging
import time

import httpx

from services.bench.prompts import BenchPrompt
from services.engine import GenerationOptions, GenerationResult
from services.speculative.stats import SpecDecodingStats

logger = logging.getLogger(__name__)


def _stats(payload: dict) -> SpecDecodingStats:
    stats = SpecDecodingStats()
    stats.num_drafts = payload.get("num_drafts", 0)
    stats.num_draft_tokens = payload.get("num_draft_tokens", 0)
    stats.num_accepted_tokens = payload.get("num_accepted_tokens", 0)
    stats.num_target_calls = payload.get("num_rounds", 0)
    stats.num_draft_tokens_per_pos = list(payload.get("num_draft_tokens_per_pos", []))
    stats.num_accepted_tokens_per_pos = list(payload.get("num_accepted_tokens_per_pos", []))
    return stats


def read_chunk(line: str, prompt_id: str) -> dict | None:
    """One SSE line of a streamed completion: its JSON chunk, None for anything else ([DONE], pings);
    an error chunk raises, naming the prompt."""
    if not line.startswith("data: {"):
        return None
    chunk = json.loads(line[6:])
    if "error" in chunk:
        raise RuntimeError(f"{prompt_id}: {chunk['error']['message']}")
    return chunk


def run_one(client: httpx.Client, model: str, prompt: BenchPrompt, options: GenerationOptions) -> GenerationResult:
    body = {
        "model": model, "messages": [{"role": "user", "content": prompt.prompt}],
        "max_tokens": options.max_new_tokens, "temperature": options.sampling.temperature,
        "top_p": options.sampling.top_p, "top_k": options.sampling.top_k, "seed": options.sampling.seed,
        "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
    }
    started = time.perf_counter()
    ttft = 0.0
    text, token_ids, finish_reason, usage = "", [], "length", {}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"{prompt.id}: HTTP {response.status_code}: {response.text}")
        for line in response.iter_lines():
            chunk = read_chunk(line, prompt.id)
            if chunk is None:
                continue
            if not chunk["choices"]:
                usage = chunk
                continue
            choice = chunk["choices"][0]
            delta = choice["delta"].get("content", "")
            if delta and not ttft:
                ttft = time.perf_counter() - started
            text += delta
            if choice["finish_reason"] is not None:
                finish_reason = choice["finish_reason"]
                token_ids = choice.get("token_ids", [])
    total = time.perf_counter() - started
    return GenerationResult(
        text=text, token_ids=token_ids, prompt_tokens=usage.get("usage", {}).get("prompt_tokens", 0),
        finish_reason=finish_reason, stats=_stats(usage.get("mirror_sd", {})), draft="stack",
        ttft_s=ttft or total, total_s=total,
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
