"""The verify worker's session state: rebuild from the committed prefix, LRU eviction under a KV budget."""

import time

from services.engine import GenerationOptions, GenerationSession
from services.engine.target import run_step
from services.models.engine import TorchEngine
from services.models.kv_store import PAGE_TOKENS
from services.protocol import DraftBlock, OutputEvent, SessionSpec
from services.speculative.stats import SpecDecodingStats
from tests.conftest import build_tiny_llama
from verify_worker.session_table import SessionTable
from verify_worker.sessions import build_session

PROMPT = [5, 9, 13, 2, 40, 41, 7, 7, 30, 12]


def spec(request_id: str, max_new_tokens: int = 20) -> SessionSpec:
    return SessionSpec(request_id=request_id, prompt_ids=PROMPT, max_new_tokens=max_new_tokens, ignore_eos=True)


def plain_round(engine, session) -> None:
    session.target.set_draft([])
    while run_step(engine, [session.target], [4])[0] is None:  # chunks of 4: the rebuild prefills in steps
        pass


def test_kv_bytes_per_token_formula():
    engine = TorchEngine(build_tiny_llama(0))
    # 2 (k, v) x 2 layers x 2 kv heads x head_dim 8 x 4 bytes
    assert engine.store.shape.bytes_per_token == 2 * 2 * 2 * 8 * 4


def test_rebuilt_session_continues_exactly_like_an_unbroken_one():
    target = build_tiny_llama(0)
    reference = GenerationSession(target, None, PROMPT, GenerationOptions(max_new_tokens=20, ignore_eos=True))
    while not reference.finished:
        reference.step()
    first = reference.output_ids[:7]
    events = [OutputEvent(request_id="r", seq=0, token_ids=first[:3], num_output_tokens=3),
              OutputEvent(request_id="r", seq=1, token_ids=first[3:], num_output_tokens=7)]
    engine = TorchEngine(target)
    session = build_session(engine, spec("r"), events)
    assert session.round == 2 and session.target.num_committed == len(PROMPT) + 7
    assert session.target.num_cached == 0  # nothing computed until a step feeds it
    while not session.target.finished:
        plain_round(engine, session)
    assert session.target.output.output_ids == reference.output_ids
    assert session.target.num_cached == session.target.num_committed - 1


def test_lru_eviction_of_idle_sessions_under_budget():
    target = build_tiny_llama(0)
    engine = TorchEngine(target, budget_bytes=2 * PAGE_TOKENS * 2 * 2 * 2 * 8 * 4)  # two pages
    table = SessionTable(engine)
    for name in ("a", "b"):
        session = build_session(engine, spec(name), [])
        table.put(session)
        plain_round(engine, session)  # one page each
    assert engine.store.used_bytes == engine.store.budget_bytes
    table.touch(table.get("a"))  # a is now the most recently used
    c = build_session(engine, spec("c"), [])
    c.take(DraftBlock(request_id="c", round=0, num_committed=len(PROMPT), draft_ids=[]))
    table.put(c)
    needed = engine.store.growth_bytes(c.target.sequence, len(PROMPT))
    assert table.evict_idle(needed)
    assert "b" not in table and "a" in table and "c" in table and table.num_evictions == 1
    assert not table.evict_idle(10 * needed)  # c has a block in hand and a is all that is left idle...
    assert "a" not in table and "c" in table  # ...so a went too, and c is never evicted while working
    popped = table.pop("c")
    assert popped.target.sequence.released and engine.store.used_bytes == 0


def test_sessions_left_without_blocks_are_dropped():
    engine = TorchEngine(build_tiny_llama(0))
    table = SessionTable(engine)
    old, busy, fresh = (build_session(engine, spec(name), []) for name in ("old", "busy", "fresh"))
    busy.take(DraftBlock(request_id="busy", round=0, num_committed=len(PROMPT), draft_ids=[]))
    for session in (old, busy, fresh):
        table.put(session)
    old.last_used = busy.last_used = time.monotonic() - 1000
    table._sessions.move_to_end("fresh")
    table.drop_idle(600)
    assert "old" not in table and "busy" in table and "fresh" in table


def test_a_block_against_the_stream_resumes_resyncs_or_is_dropped():
    from services.protocol import Verdict
    from verify_worker.sessions import resume_block

    engine = TorchEngine(build_tiny_llama(0))
    stats = [SpecDecodingStats(), SpecDecodingStats()]
    stats[0].observe(3, 2)  # round 0 drafted 3, accepted 2
    stats[1] = stats[0].copy()
    stats[1].observe(0, 0)  # round 1 target-only
    events = [OutputEvent(request_id="r", seq=0, token_ids=[7, 8, 9], num_output_tokens=3, stats=stats[0]),
              OutputEvent(request_id="r", seq=1, token_ids=[4], num_output_tokens=4, stats=stats[1])]
    fresh = DraftBlock(request_id="r", round=2, num_committed=len(PROMPT) + 4, draft_ids=[1, 2])
    session = resume_block(engine, spec("r"), events, fresh)
    assert session.round == 2 and not session.first_round_done and session.target.draft_ids == [1, 2]
    plain = DraftBlock(request_id="r", round=1, num_committed=len(PROMPT) + 3, draft_ids=[], num_rounds=5)
    resumed = resume_block(engine, spec("r"), events, plain)  # round 1 of 1..5 is already in the stream
    assert resumed.first_round_done and resumed.block_end_round == 6 and resumed.autonomous
    done = DraftBlock(request_id="r", round=0, num_committed=len(PROMPT), draft_ids=[7, 8, 5])
    resync = resume_block(engine, spec("r"), events, done)  # a resend of round 0: it is committed
    assert isinstance(resync, Verdict) and resync.committed_ids == [7, 8, 9, 4] and resync.num_rounds == 2
    assert (resync.num_draft_tokens, resync.num_accepted) == (3, 2)
    assert resume_block(engine, spec("r"), events, DraftBlock(request_id="r", round=5, num_committed=99,
                                                              draft_ids=[])) is None  # from the future
    stale = DraftBlock(request_id="r", round=2, num_committed=3, draft_ids=[1])  # saw another prefix
    assert resume_block(engine, spec("r"), events, stale) is None
