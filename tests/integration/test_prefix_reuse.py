"""Prefix KV reuse on the verify side: a session started from another sequence's prefix decodes exactly what a
session prefilled from nothing decodes (greedy and seeded sampling), after a partial match, next to the
live session it copied from, and after its source was evicted; memory is accounted per sequence."""

import pytest

from services.config import MergingSettings
from services.engine.target import run_step
from services.models.engine import TorchEngine
from services.models.kv_store import PAGE_TOKENS
from services.protocol import DraftBlock, OutputEvent, SessionSpec
from services.speculative.params import SamplingParams
from tests.conftest import build_tiny_llama
from verify_worker.session_table import SessionTable
from verify_worker.sessions import build_session

SHARED = [(7 * i + 3) % 90 + 5 for i in range(80)]  # a "system prompt" of 80 tokens
QUESTION_A = [11, 12, 13, 14, 15]
QUESTION_B = [21, 22, 23]


def spec(request_id: str, prompt: list[int], *, temperature: float = 0.0, seed: int | None = None) -> SessionSpec:
    return SessionSpec(request_id=request_id, prompt_ids=prompt, max_new_tokens=24, ignore_eos=True,
                       sampling=SamplingParams(temperature=temperature, seed=seed))


def decode(engine, session, rounds: int | None = None) -> list[int]:
    """Target-only rounds (prefill in chunks of 16) until finished or `rounds` more are done."""
    target = session.target
    done = 0
    while not target.finished and (rounds is None or done < rounds):
        target.set_draft([])
        while run_step(engine, [target], [16])[0] is None:
            pass
        done += 1
    return target.output.output_ids


def solo(request: SessionSpec) -> list[int]:
    """What the request decodes on a fresh engine with nothing to reuse."""
    engine = TorchEngine(build_tiny_llama(0))
    return decode(engine, build_session(engine, request, []))


def finish_in(table: SessionTable, request: SessionSpec):
    """Run a request to its end in the table's worker and retire it, as the worker does on its last round."""
    session = build_session(table.engine, request, [], reuse=table.reuse_prefix)
    table.put(session)
    decode(table.engine, session)
    table.pop(request.request_id, retire=True)
    return session


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 1234}], ids=["greedy", "seeded"])
def test_a_session_started_from_a_finished_ones_prefix_decodes_like_a_cold_one(sampling):
    table = SessionTable(TorchEngine(build_tiny_llama(0)))
    first = spec("a", SHARED + QUESTION_A, **sampling)
    assert finish_in(table, first).num_cached_tokens == 0  # nothing to reuse yet
    assert "a" in table.retired and "a" not in table
    second = spec("b", SHARED + QUESTION_B, **sampling)
    session = build_session(table.engine, second, [], reuse=table.reuse_prefix)
    assert session.num_cached_tokens == len(SHARED)  # the common prefix, not one token more
    assert session.target.num_cached == len(SHARED)
    assert decode(table.engine, session) == solo(second)
    assert table.prefix.hits == 1 and table.prefix.reused_tokens == len(SHARED) and table.prefix.lookups == 2


def test_the_same_prompt_again_reuses_all_but_its_last_token():
    table = SessionTable(TorchEngine(build_tiny_llama(0)))
    request = spec("a", SHARED + QUESTION_A)
    finish_in(table, request)
    again = build_session(table.engine, spec("again", SHARED + QUESTION_A), [], reuse=table.reuse_prefix)
    assert again.num_cached_tokens == len(SHARED) + len(QUESTION_A) - 1  # the last one's logits need a forward
    assert decode(table.engine, again) == solo(request)


def test_a_prompt_that_continues_a_finished_answer_reuses_the_answer_too():
    """A follow-up turn: the new prompt is the old prompt, its answer, then more (a chat's history)."""
    table = SessionTable(TorchEngine(build_tiny_llama(0)))
    session = finish_in(table, spec("turn1", SHARED))
    history = session.target.token_ids  # prompt + answer
    follow_up = spec("turn2", [*history, 30, 31])
    reused = build_session(table.engine, follow_up, [], reuse=table.reuse_prefix)
    assert reused.num_cached_tokens == len(history) - 1  # the KV held all but the answer's last token
    assert decode(table.engine, reused) == solo(follow_up)


def test_sessions_sharing_a_prefix_at_once_never_see_each_others_tokens():
    """b copies a's prefix while a is mid-answer; both go on in the same batched steps, each exactly as alone."""
    engine = TorchEngine(build_tiny_llama(0))
    table = SessionTable(engine)
    request_a, request_b = spec("a", SHARED + QUESTION_A), spec("b", SHARED + QUESTION_A[:2] + QUESTION_B)
    a = build_session(engine, request_a, [], reuse=table.reuse_prefix)
    table.put(a)
    decode(engine, a, rounds=5)  # a has prefilled and written 5 answer tokens past the shared part
    b = build_session(engine, request_b, [], reuse=table.reuse_prefix)
    table.put(b)
    assert b.num_cached_tokens == len(SHARED) + 2
    while not (a.target.finished and b.target.finished):
        live = [s.target for s in (a, b) if not s.target.finished]
        for target in live:
            target.set_draft([])
        run_step(engine, live, [16] * len(live))
    assert a.target.output.output_ids == solo(request_a)
    assert b.target.output.output_ids == solo(request_b)


def test_a_short_common_prefix_is_prefilled_and_unrelated_prompts_reuse_nothing():
    table = SessionTable(TorchEngine(build_tiny_llama(0)), MergingSettings(min_prefix_tokens=32))
    finish_in(table, spec("a", SHARED + QUESTION_A))
    short = build_session(table.engine, spec("short", SHARED[:20] + QUESTION_B), [], reuse=table.reuse_prefix)
    other = build_session(table.engine, spec("other", QUESTION_B + SHARED), [], reuse=table.reuse_prefix)
    assert short.num_cached_tokens == 0 and other.num_cached_tokens == 0 and table.prefix.hits == 0


def test_retired_prefixes_are_evicted_first_and_then_nothing_is_reused():
    engine = TorchEngine(build_tiny_llama(0), budget_bytes=4 * PAGE_TOKENS * 2 * 2 * 2 * 8 * 4)  # four pages
    table = SessionTable(engine)
    finish_in(table, spec("a", SHARED + QUESTION_A))  # 80 + 5 + 24 tokens: two pages, retired
    retired_bytes = engine.store.used_bytes
    assert retired_bytes == 2 * PAGE_TOKENS * engine.store.shape.bytes_per_token
    busy = build_session(engine, spec("busy", QUESTION_B * 40), [])  # 120 tokens: two pages
    busy.take(DraftBlock(request_id="busy", round=0, num_committed=120, draft_ids=[]))
    table.put(busy)
    needed = engine.store.growth_bytes(busy.target.sequence, 200)  # more than the two free pages
    assert table.evict_idle(needed)  # the retired sequence made room, before any live session
    assert "a" not in table.retired and "busy" in table and engine.store.used_bytes == 0
    later = spec("b", SHARED + QUESTION_B)
    session = build_session(engine, later, [], reuse=table.reuse_prefix)
    assert session.num_cached_tokens == 0  # its source is gone: prefilled, same answer
    assert decode(engine, session) == solo(later)


def test_a_rebuilt_session_keeps_its_first_builds_cached_count():
    engine = TorchEngine(build_tiny_llama(0))
    events = [OutputEvent(request_id="r", seq=0, token_ids=[3], num_output_tokens=1, num_cached_tokens=77)]
    rebuilt = build_session(engine, spec("r", SHARED), events, reuse=SessionTable(engine).reuse_prefix)
    assert rebuilt.num_cached_tokens == 77  # the request's figure, not this rebuild's


def test_reuse_off_prefills_everything():
    table = SessionTable(TorchEngine(build_tiny_llama(0)), MergingSettings(prefix_reuse=False))
    finish_in(table, spec("a", SHARED + QUESTION_A))
    assert len(table.retired) == 0 and table.engine.store.used_bytes == 0  # nothing kept
    session = build_session(table.engine, spec("b", SHARED + QUESTION_B), [], reuse=table.reuse_prefix)
    assert session.num_cached_tokens == 0 and table.prefix.lookups == 0


def test_a_session_of_another_cache_salt_reuses_nothing_one_of_the_same_salt_does():
    table = SessionTable(TorchEngine(build_tiny_llama(0)))
    first = SessionSpec(request_id="a", prompt_ids=SHARED + QUESTION_A, max_new_tokens=4, cache_salt="tenant-a")
    finish_in(table, first)
    other = SessionSpec(request_id="b", prompt_ids=SHARED + QUESTION_B, max_new_tokens=4, cache_salt="tenant-b")
    same = SessionSpec(request_id="c", prompt_ids=SHARED + QUESTION_B, max_new_tokens=4, cache_salt="tenant-a")
    assert build_session(table.engine, other, [], reuse=table.reuse_prefix).num_cached_tokens == 0
    assert build_session(table.engine, same, [], reuse=table.reuse_prefix).num_cached_tokens == len(SHARED)
