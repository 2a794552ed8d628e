"""Synthetic stacks (docs/synthetic.md): what a stack serving a random-weight target or a synthetic draft
says about itself, and the reference runs its synthetic drafts replay, through Redis.

The oracle: a synthetic draft must know the target's greedy continuation, which only a target forward
computes. The bench computes it anyway (its `ar` mode, in the bench's own process, before the stack mode
runs the same prompt) and publishes it here; a draft worker, or a verify worker drafting for its own
sessions, reads it once per session. Nothing in the stack spends a core on it; a request no bench
published a reference for is decoded target-only (its draft proposes nothing)."""

from __future__ import annotations

import logging

import redis

from services.models.synthetic_spec import ReferenceBook, is_synthetic_spec, parse_synthetic_spec, prompt_digest
from services.models.random_spec import is_random_spec, parse_random_spec
from services.protocol import SYNTHETIC_REFERENCES_KEY, SYNTHETIC_REFERENCES_TTL_S, SyntheticReference
from services.redis_conn import connect

logger = logging.getLogger(__name__)


def synthetic_label(target: str, draft: str) -> dict | None:
    """The label every report of a synthetic stack carries (None for a real one): what is synthetic, and
    that its acceptance is chosen, not earned, and its target's weights are random."""
    label = {}
    if is_random_spec(target):
        label["target"] = f"{target} ({parse_random_spec(target).name}: random weights, output text meaningless)"
    if is_synthetic_spec(draft):
        spec = parse_synthetic_spec(draft)
        label["draft"] = (f"{draft}: acceptance {spec.acceptance:g} chosen, not earned; "
                          f"{spec.ms_per_token:g} ms per draft token modeled by a sleep")
    return {"synthetic": True, **label} if label else None


def describe_label(label: dict) -> str:
    """One line for markdown reports and logs."""
    return "SYNTHETIC: " + "; ".join(f"{key} {value}" for key, value in label.items() if key != "synthetic")


def worker_synthetic(model: str, local_draft: str = "") -> str | None:
    """What is synthetic about a worker, from its heartbeat (model: a verify worker's target name, a draft
    worker's draft spec; local_draft: a verify worker's own draft), for `mirror-sd status`; None if nothing."""
    parts = []
    if model.startswith("random-"):
        parts.append(f"target {model} has random weights")
    for draft in (model, local_draft):
        if is_synthetic_spec(draft):
            parts.append(f"draft {draft} has a chosen acceptance, not an earned one")
    return "; ".join(parts) or None


def publish_reference(client: redis.Redis, prompt_ids: list[int], output_ids: list[int]) -> None:
    """The target's greedy output after a prompt, for the stack's synthetic drafts (expires in a day)."""
    with client.pipeline() as pipe:
        pipe.hset(SYNTHETIC_REFERENCES_KEY, prompt_digest(prompt_ids),
                  SyntheticReference(prompt_ids=list(prompt_ids), output_ids=list(output_ids)).encode())
        pipe.expire(SYNTHETIC_REFERENCES_KEY, SYNTHETIC_REFERENCES_TTL_S)
        pipe.execute()


def fetch_references(client: redis.Redis) -> list[tuple[list[int], list[int]]]:
    """Every published reference, as (prompt ids, output ids)."""
    references = []
    for raw in client.hvals(SYNTHETIC_REFERENCES_KEY):
        reference = SyntheticReference.decode(raw)
        references.append((reference.prompt_ids, reference.output_ids))
    return references


def redis_reference_book(redis_url: str) -> ReferenceBook:
    """A serving synthetic draft's book: published references, fetched again on a miss (a new prompt)."""
    client = connect(redis_url, socket_timeout=5)
    return ReferenceBook(fetch=lambda: fetch_references(client))
