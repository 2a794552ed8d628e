"""The verify worker's session state: rebuild from the committed prefix, LRU eviction under a KV budget."""

from services.engine import GenerationOptions, GenerationSession
from services.protocol import OutputEvent, SessionSpec
from services.speculative.sampling import SamplingParams
from tests.conftest import build_tiny_llama
from verify_worker.sessions import SessionCache, build_session, kv_bytes_per_token

PROMPT = [5, 9, 13, 2, 40, 41, 7, 7, 30, 12]


def spec(request_id: str, max_new_tokens: int = 20) -> SessionSpec:
    return SessionSpec(request_id=request_id, prompt_ids=PROMPT, max_new_tokens=max_new_tokens, ignore_eos=True)


def test_kv_bytes_per_token_formula():
    target = build_tiny_llama(0)
    # 2 (k, v) x 2 layers x 2 kv heads x head_dim 8 x 4 bytes
    assert kv_bytes_per_token(target) == 2 * 2 * 2 * 8 * 4


def test_rebuilt_session_continues_exactly_like_an_unbroken_one():
    target = build_tiny_llama(0)
    reference = GenerationSession(target, None, PROMPT, GenerationOptions(max_new_tokens=20, ignore_eos=True))
    while not reference.finished:
        reference.step()
    first = reference.output_ids[:7]
    events = [OutputEvent(request_id="r", seq=0, token_ids=first[:3], num_output_tokens=3),
              OutputEvent(request_id="r", seq=1, token_ids=first[3:], num_output_tokens=7)]
    session = build_session(target, spec("r"), events, chunk_size=4)
    assert session.seq == 2 and session.num_committed == len(PROMPT) + 7
    assert session.target_session.num_cached == session.num_committed - 1
    while not session.output.finished:
        verification = session.target_session.verify([], None, SamplingParams(), None)
        session.output.accept([verification.next_token_id])
    assert session.output.output_ids == reference.output_ids


def test_lru_eviction_under_budget():
    target = build_tiny_llama(0)
    per_token = kv_bytes_per_token(target)
    per_session = (len(PROMPT) - 1) * per_token  # a fresh session caches prompt[:-1]
    cache = SessionCache(bytes_per_token=per_token, budget_bytes=2 * per_session)
    for name in ("a", "b"):
        cache.put(name, build_session(target, spec(name), [], chunk_size=512))
    assert len(cache) == 2 and cache.kv_bytes == 2 * per_session
    cache.get("a")  # a is now the most recently used
    cache.put("c", build_session(target, spec("c"), [], chunk_size=512))
    assert "b" not in cache and "a" in cache and "c" in cache
    assert cache.num_evictions == 1 and cache.kv_bytes <= cache.budget_bytes
    popped = cache.pop("a")
    assert popped.target_session.num_cached == 0  # freed
