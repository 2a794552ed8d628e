"""Branches: blocks sent ahead for a block's likeliest rejections (services/speculative/branching.py), where to
put them, the rule both sides check, and a draft session that drafts, sends and follows one."""

from __future__ import annotations

import dataclasses

import pytest

from services.config import SpeculativeSettings
from services.engine.draft_pipeline import speculate_many
from services.engine.draft_session import DraftSession
from services.models.drafters import DraftSource
from services.models.drafters.batched import propose_many
from services.protocol import DraftBlock, SessionSpec, Verdict
from services.speculative.branching import BranchPoint, Choice, branch_points
from services.speculative.chaining import chain_holds
from services.speculative.params import SamplingParams
from tests.conftest import build_tiny_llama
from verify_worker.sessions import descendants


def test_points_are_ranked_by_the_chance_the_targets_path_takes_them():
    path = [10, 11, 12]  # two draft tokens, then the guessed bonus
    choices = {5: Choice(10, 0.9, 20, 0.08), 6: Choice(11, 0.5, 21, 0.4), 7: Choice(12, 0.6, 22, 0.3)}
    points = branch_points(5, path, choices, max_branches=3, min_chance=0.0)
    # reach x second choice: 1 x 0.08, 0.9 x 0.4, 0.9 x 0.5 x 0.3
    assert [(p.accepted, p.token) for p in points] == [(1, 21), (2, 22), (0, 20)]
    assert points[0].chance == pytest.approx(0.36) and points[1].chance == pytest.approx(0.135)
    assert branch_points(5, path, choices, max_branches=1, min_chance=0.0) == [points[0]]
    assert [p.accepted for p in branch_points(5, path, choices, max_branches=3, min_chance=0.1)] == [1, 2]


def test_the_ranking_stops_where_the_draft_did_not_choose_the_paths_token():
    choices = {0: Choice(10, 0.5, 20, 0.4), 2: Choice(12, 0.5, 22, 0.4)}  # position 1 unknown (prompt lookup)
    assert [p.accepted for p in branch_points(0, [10, 11, 12], choices, 3, 0.0)] == [0]
    other_first = {0: Choice(10, 0.5, 20, 0.4), 1: Choice(99, 0.5, 11, 0.4)}  # its first was not the path's
    assert [p.accepted for p in branch_points(0, [10, 11], other_first, 3, 0.0)] == [0]


PARENT = DraftBlock(request_id="r", round=3, num_committed=20, draft_ids=[7, 8, 9], block_id=5)
BRANCH = DraftBlock(request_id="r", round=4, num_committed=22, draft_ids=[1, 2], block_id=7, parent_id=5,
                    assumed_bonus=42, assumed_accepted=1)
REJECTED_AT_1 = Verdict(request_id="r", round=3, num_committed=22, num_draft_tokens=3, num_accepted=1,
                        committed_ids=[7, 42], worker_id="v", block_id=5)


def test_a_branch_holds_on_a_rejection_at_its_point_with_its_token():
    assert chain_holds(REJECTED_AT_1, PARENT, BRANCH)
    assert not chain_holds(dataclasses.replace(REJECTED_AT_1, committed_ids=[7, 43]), PARENT, BRANCH)
    at_2 = dataclasses.replace(REJECTED_AT_1, num_accepted=2, committed_ids=[7, 8, 42], num_committed=23)
    assert not chain_holds(at_2, PARENT, BRANCH)
    whole = dataclasses.replace(REJECTED_AT_1, num_accepted=3, committed_ids=[7, 8, 9, 42], num_committed=24)
    assert not chain_holds(whole, PARENT, BRANCH)
    # a branch at the bonus position: the parent accepted whole, the bonus not the chained block's guess
    at_bonus = dataclasses.replace(BRANCH, num_committed=24, assumed_accepted=3)
    assert chain_holds(whole, PARENT, at_bonus)
    assert not chain_holds(whole, PARENT, dataclasses.replace(at_bonus, assumed_accepted=4, num_committed=25))


def test_the_line_after_a_block_is_kept_and_its_siblings_lines_dropped():
    def b(block_id, parent_id):
        return DraftBlock(request_id="r", round=0, num_committed=0, draft_ids=[], block_id=block_id,
                          parent_id=parent_id)
    chained, after_chained, taken, after_taken, sibling = b(2, 1), b(3, 2), b(4, 1), b(6, 4), b(5, 1)
    assert descendants(taken, [after_chained, sibling, after_taken, chained]) == [after_taken]
    assert descendants(chained, [after_taken, after_chained, sibling]) == [after_chained]


def drafted_session(greedy: bool = True) -> DraftSession:
    """A pipelined session on a tiny model draft, its first block out to worker "v" with one chained block behind
    it, and the speculation after that one done: the draft has nothing else to draft."""
    spec = SessionSpec(request_id="b", prompt_ids=[1, 2, 3, 4, 5], max_new_tokens=40, ignore_eos=True,
                       sampling=SamplingParams() if greedy else SamplingParams(temperature=0.8, seed=3))
    drafter = DraftSource("tiny", build_tiny_llama(1)).new_drafter()
    settings = SpeculativeSettings(num_draft_tokens=3, plain_opening_tokens=0, branches=2, min_branch_chance=0.0)
    session = DraftSession(spec, [], drafter=drafter, speculative=settings, cost=None, reply_to="inbox",
                           pipelined=True)
    session.blocks_ahead = 2
    first = session.next_block(propose_many([session.draft_call()])[0])
    session.sent(first, first.encode(), "v")
    speculate_many([session.speculation()])
    chained = session.chained_block()
    session.sent(chained, chained.encode(), "v")
    speculate_many([session.speculation()])
    return session


def test_a_session_drafts_branches_once_its_chain_is_drafted_and_follows_the_one_a_verdict_took():
    session = drafted_session()
    first, chained = session.in_flight, session.ahead[0]
    sent = []
    while (state := session.speculation()) is not None and not state.done:
        speculate_many([state])
        branch = session.branch_block()
        session.sent(branch, branch.encode(), "v")
        sent.append(branch)
    # two per block out, the block in flight's first (its verdict comes first)
    assert [b.parent_id for b in sent] == [first.block.block_id] * 2 + [chained.block.block_id] * 2
    assert session.timing.branches_sent == 4
    assert first.branches[0].block is sent[0] and chained.branches[1].block is sent[3]
    guesses = {first.block.block_id: chained.block.assumed_bonus,
               chained.block.block_id: chained.speculating.tokens[0]}
    for branch in sent:
        parent = first if branch.parent_id == first.block.block_id else chained
        assert branch.round == parent.block.round + 1
        k = branch.assumed_accepted
        path = [*parent.block.draft_ids, guesses[branch.parent_id]]
        assert 0 <= k <= len(parent.block.draft_ids) and branch.assumed_bonus != path[k]
        start = len(parent.context) - len(parent.block.draft_ids)
        context = [*parent.context[:start + k], branch.assumed_bonus]
        assert branch.num_committed == len(context)
        # the very block a draft would send from that context
        fresh = DraftSource("tiny", build_tiny_llama(1)).new_drafter()
        assert branch.draft_ids == fresh.propose(context, len(branch.draft_ids), SamplingParams(), None).token_ids
    first = first.block

    taken = sent[1]
    k = taken.assumed_accepted
    verdict = Verdict(request_id="b", round=0, num_committed=taken.num_committed,
                      num_draft_tokens=len(first.draft_ids), num_accepted=k,
                      committed_ids=[*first.draft_ids[:k], taken.assumed_bonus], worker_id="v",
                      block_id=first.block_id)
    assert session.on_verdict(verdict) is False
    assert session.in_flight.block.block_id == taken.block_id and session.ahead == []
    assert session.timing.branch_rounds == 1 and session.round == 1
    assert session.speculation() is not None  # the chain goes on after the branch


def test_a_verdict_no_branch_assumed_drops_them_with_the_chain():
    session = drafted_session()
    first = session.in_flight.block
    while (state := session.speculation()) is not None and not state.done:
        speculate_many([state])
        branch = session.branch_block()
        session.sent(branch, branch.encode(), "v")
    tokens = {b.block.assumed_bonus for b in session.in_flight.branches}
    other = next(token for token in range(96) if token not in tokens and token != first.draft_ids[0])
    verdict = Verdict(request_id="b", round=0, num_committed=len(session.committed) + 1,
                      num_draft_tokens=len(first.draft_ids), num_accepted=0, committed_ids=[other],
                      worker_id="v", block_id=first.block_id)
    session.on_verdict(verdict)
    assert session.in_flight is None and session.ahead == [] and session.timing.chains_broken == 1
    assert session.timing.branch_rounds == 0


def test_no_branches_for_a_sampled_session_one_block_at_a_time_or_an_unknown_worker():
    assert drafted_session(greedy=False).speculation().done  # the chain's speculation, nothing after it
    session = drafted_session()
    session.blocks_ahead = 1
    assert session.speculation().done
    session.blocks_ahead, session.in_flight.worker = 2, None
    assert session.speculation().done
    session.in_flight.worker = "v"
    assert not session.speculation().done and isinstance(session.in_flight.branch_plan[0], BranchPoint)
