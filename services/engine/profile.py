"""Device profiles measured at start-up: what a target forward over 1..9 tokens, or one draft token, costs here."""

from __future__ import annotations

import logging
import statistics
import time

from services.engine.target import TargetSession
from services.models.drafters.factory import DraftSource
from services.models.loading import LoadedModel
from services.speculative.cost_model import CostModel
from services.speculative.sampling import SamplingParams

logger = logging.getLogger(__name__)


VERIFY_SIZES = tuple(range(1, 10))  # 1 token (target alone) up to a block of 8 + 1


def measure_verify_profile(target: LoadedModel, *, context_tokens: int = 64, repeats: int = 3,
                           sizes: tuple[int, ...] = VERIFY_SIZES) -> dict[str, float]:
    """{"verify_ms_1": ..., ..., "verify_ms_9": ...}: median ms of one target forward over n tokens
    (the cost curve the block-length controller reads; it is not smooth on CPUs)."""
    vocab = target.vocab_size
    prompt = [(7 * index + 3) % vocab for index in range(min(context_tokens, target.max_context - 16))]
    session = TargetSession(target, prompt)
    greedy = SamplingParams()
    profile = {}
    for num_tokens in sizes:
        draft = [(11 * index + 5) % vocab for index in range(num_tokens - 1)]
        timings = []
        for _ in range(repeats + 1):  # the first call warms up
            started = time.perf_counter()
            verification = session.verify(draft, None, greedy, None)
            timings.append(1000 * (time.perf_counter() - started))
            session.rollback(len(prompt))  # back to the prompt for the next timing
            assert verification.num_draft_tokens == len(draft)
        profile[f"verify_ms_{num_tokens}"] = round(statistics.median(timings[1:]), 3)
    session.release()
    return profile


def measure_verify_profiles(targets: dict[str, LoadedModel], *, context_tokens: int = 64,
                            rounds: int = 5) -> dict[str, dict[str, float]]:
    """measure_verify_profile for several models (e.g. weight layouts), taking turns round by round so a
    drift of this machine's speed hits them alike; per key, the median over rounds."""
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in targets}
    for _ in range(rounds):
        for name, target in targets.items():
            samples[name].append(measure_verify_profile(target, context_tokens=context_tokens, repeats=1))
    return {name: {key: round(statistics.median(sample[key] for sample in runs), 3) for key in runs[0]}
            for name, runs in samples.items()}


def measure_draft_profile(source: DraftSource, vocab_size: int, *, context_tokens: int = 64,
                          num_draft_tokens: int = 8, repeats: int = 3) -> dict[str, float]:
    """{"draft_ms_per_token": ...}: median ms per proposed token of a fresh session's drafter."""
    drafter = source.new_drafter()
    if drafter is None:
        return {}
    prompt = [(7 * index + 3) % vocab_size for index in range(context_tokens)]
    context = [*prompt, *prompt[:16]]  # a repeat, so prompt lookup finds something to propose
    greedy = SamplingParams()
    timings = []
    try:
        for _ in range(repeats + 1):  # the first call warms up (and prefills a model draft's cache)
            started = time.perf_counter()
            proposal = drafter.propose(context, num_draft_tokens, greedy, None)
            timings.append(1000 * (time.perf_counter() - started) / max(1, proposal.num_draft_tokens))
    finally:
        drafter.release()
    return {"draft_ms_per_token": round(statistics.median(timings[1:]), 4)}


def measure_cost_model(target: LoadedModel, source: DraftSource, max_draft_tokens: int) -> CostModel:
    """The in-process cost model: this target's verify curve and this draft's per-token cost."""
    verify = measure_verify_profile(target, sizes=tuple(range(1, max_draft_tokens + 2)))
    draft = measure_draft_profile(source, target.vocab_size).get("draft_ms_per_token", 0.0)
    return CostModel.from_profile(verify, draft)
