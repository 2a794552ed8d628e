"""Several choices of one request (`n`): each choice is a session of its own, their answers merged into one.

Greedy choices are one generation: identical requests share it (gateway/sessions/single_flight.py), so n greedy
choices cost one. Sampled choices with a seed take seed, seed + 1, ...: each reproducible, none equal to another
by construction; without a seed each draws its own.

Pure functions over the choices' answers: the bodies of a non-streamed request, the events of a streamed one
(the single choice's SSE events, each rewritten with its choice's index; one usage event and one [DONE] at the
end). gateway/api/generation.py runs the sessions.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence

from gateway.schemas import SamplingFields

SEED_LIMIT = 2**63 - 1


def choices_room(tier_limit: int, per_key_limit: int) -> int:
    """The most choices one request can ever be admitted with: each takes a slot of its tier, and of its key's
    limit when there is one (0: none). More is a 400 (n), not a wait that ends in a 503."""
    return min(tier_limit, per_key_limit) if per_key_limit else tier_limit


def choice_params(params: SamplingFields, index: int) -> SamplingFields:
    """The request's fields for choice `index`: a seeded request's seed + index (wrapping within the 64-bit
    range), one choice each."""
    update: dict = {"n": 1}
    if params.seed is not None and index:
        seed = params.seed + index
        update["seed"] = seed if seed <= SEED_LIMIT else seed - 2 * (SEED_LIMIT + 1)
    return params.model_copy(update=update)


def merge_bodies(bodies: Sequence[dict]) -> dict:
    """One response from each choice's own (as if n were 1): choices in order with their indices, usage summed over
    the choices (the prompt counted once), the first choice's request id; every choice's stats under
    mirror_sd.choices."""
    first = bodies[0]
    merged = dict(first)
    merged["choices"] = [dict(body["choices"][0], index=index) for index, body in enumerate(bodies)]
    completion = sum(body["usage"]["completion_tokens"] for body in bodies)
    merged["usage"] = dict(first["usage"], completion_tokens=completion,
                           total_tokens=first["usage"]["prompt_tokens"] + completion)
    merged["mirror_sd"] = dict(first["mirror_sd"], choices=[body["mirror_sd"] for body in bodies])
    return merged


def rewrite_event(event: dict, index: int) -> tuple[dict | None, dict | None]:
    """One choice's SSE event for the merged stream: (the event with its choice's index, or None for its [DONE]
    and its usage event; that usage event's body, to be summed)."""
    data = event.get("data")
    if data == "[DONE]":
        return None, None
    try:
        payload = json.loads(data)
    except (TypeError, ValueError):
        return event, None
    if "usage" in payload and not payload.get("choices"):
        return None, payload
    for choice in payload.get("choices", []):
        choice["index"] = index
    return {**event, "data": json.dumps(payload)}, None


def merged_usage(usages: Sequence[dict]) -> dict:
    """The usage event of the merged stream: the first choice's, completion tokens summed over the choices."""
    merged = dict(usages[0])
    completion = sum(usage["usage"]["completion_tokens"] for usage in usages)
    merged["usage"] = dict(usages[0]["usage"], completion_tokens=completion,
                           total_tokens=usages[0]["usage"]["prompt_tokens"] + completion)
    merged["mirror_sd"] = dict(usages[0].get("mirror_sd", {}), choices=[usage.get("mirror_sd") for usage in usages])
    return merged


async def merge_streams(streams: Sequence[AsyncIterator[dict]]) -> AsyncIterator[dict]:
    """The choices' SSE events as they come, each with its index; their usage events as one; one [DONE]. A client
    gone (this generator closed) closes every choice's stream, which ends its session as any stream does."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[dict]) -> None:
        try:
            async for event in stream:
                await queue.put((index, event))
        finally:
            await queue.put((index, done))

    tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    usages: dict[int, dict] = {}
    try:
        running = len(tasks)
        while running:
            index, event = await queue.get()
            if event is done:
                running -= 1
                continue
            rewritten, usage = rewrite_event(event, index)
            if usage is not None:
                usages[index] = usage
            if rewritten is not None:
                yield rewritten
        for task in tasks:
            task.result()  # a choice's stream that raised: raise it here
        if usages:
            yield {"data": json.dumps(merged_usage([usages[index] for index in sorted(usages)]))}
        yield {"data": "[DONE]"}
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
