"""Where drafts run: `up` chooses the placement from where the target runs and the cores it has; the gateway starts a pool's sessions
with a start block when all its live verify workers draft for their own sessions."""

from __future__ import annotations

import pytest

from gateway.fleet.workers import drafts_locally, opens_sessions
from services.protocol import Heartbeat
from services.config import SpeculativeSettings
from services.stack import choose_placement, draft_prefill_env, verify_worker_threads


def test_auto_drafts_in_the_verify_worker_on_a_cpu_box_of_two_cores_or_fewer():
    assert choose_placement("auto", "cpu", cores=1) == "local"  # a draft worker would only take turns with it
    assert choose_placement("auto", "cpu", cores=2) == "local"  # both halves on both cores, taking turns
    assert choose_placement("auto", "cpu", cores=3) == "remote"  # pipelined on a core of its own
    assert choose_placement("auto", "cpu", cores=2, draft_worker=True) == "remote"  # --draft-link, --pin
    assert choose_placement("local", "cpu", cores=2, draft_worker=True) == "local"  # up refuses local with a link
    assert choose_placement("auto", "cuda", cores=1) == "remote"  # the draft runs on the CPU beside the accelerator
    assert choose_placement("local", "cuda") == "local" and choose_placement("remote", "cpu") == "remote"


def test_an_unknown_placement_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"one of auto, local, remote, got 'edge'"):
        choose_placement("edge", "cpu")


def test_the_verify_worker_borrows_the_draft_core_only_when_a_draft_worker_has_one_on_its_box():
    def threads(cores=2, model_draft=True, local=False, pin=False, pools=False, device="cpu"):
        return verify_worker_threads(cores, model_draft=model_draft, local=local, pin=pin, pools=pools, device=device)

    assert threads() == (1, 2)  # a model draft worker on one core: every core while it has nothing to draft
    assert threads(cores=8) == (7, 8)
    assert threads(model_draft=False) == (2, None)  # prompt lookup: every core always
    assert threads(local=True) == (2, None)  # co-located drafting: every core always
    assert threads(pin=True) == (1, None)  # pinned: the verify worker may not run on the draft's core
    assert threads(pools=True) == (1, None)  # several verify workers share the cores out
    assert threads(device="cuda") == (1, None)
    assert threads(cores=1) == (1, None)


def test_a_verify_worker_that_borrows_the_draft_core_has_its_drafts_prefill_after_the_opening():
    assert draft_prefill_env(2, SpeculativeSettings()) == {"MIRROR_SD_SPECULATIVE__DRAFT_PREFILL": "after_opening"}
    assert draft_prefill_env(None, SpeculativeSettings()) == {}  # the draft has a core of its own, or none
    assert draft_prefill_env(2, SpeculativeSettings(draft_prefill="overlap")) == {}  # given: kept
    with pytest.raises(ValueError, match="draft_prefill"):
        SpeculativeSettings(draft_prefill="later")


def verify(worker_id: str, pool: str, local_draft: str = "") -> Heartbeat:
    return Heartbeat(worker_id=worker_id, role="verify", pool=pool, local_draft=local_draft)


def test_a_pool_drafts_locally_when_all_its_live_verify_workers_do():
    beats = [verify("v0", "cpu", "gguf:smollm2-135m"), verify("v1", "cpu", "ngram"), verify("g0", "gpu"),
             Heartbeat(worker_id="d0", role="draft", pool="gpu")]
    assert drafts_locally(beats, "cpu")
    assert not drafts_locally(beats, "gpu")  # waits for draft workers
    assert not drafts_locally([*beats, verify("v2", "cpu")], "cpu")  # a mix while a fleet changes over
    assert not drafts_locally(beats, "accel")  # no live verify worker at all


def draft(worker_id: str, pool: str, plain_opening_tokens: int) -> Heartbeat:
    return Heartbeat(worker_id=worker_id, role="draft", pool=pool, plain_opening_tokens=plain_opening_tokens)


def test_the_gateway_opens_a_session_only_when_round_0_is_target_only_wherever_it_lands():
    models = [draft("d0", "cpu", 1), draft("d1", "cpu", 16), draft("e0", "edge", 0)]
    assert opens_sessions(models, draft_pool="cpu", route="sd", num_prompt_tokens=16)
    assert not opens_sessions(models, draft_pool="cpu", route="sd", num_prompt_tokens=15)  # d1 would draft it
    assert not opens_sessions(models, draft_pool="edge", route="sd", num_prompt_tokens=99)  # prompt lookup drafts
    assert opens_sessions(models, draft_pool="edge", route="ar", num_prompt_tokens=1)  # the plain route always
    assert not opens_sessions([], draft_pool="cpu", route="sd", num_prompt_tokens=99)  # no draft worker known
