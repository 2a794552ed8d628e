import msgpack
import pytest
import torch

from services import protocol
from services.speculative.params import SamplingParams
from services.protocol import (
    MAX_MESSAGE_BYTES,
    ChildStatus,
    DraftBlock,
    DraftFallback,
    Heartbeat,
    OutputEvent,
    ProtocolError,
    SessionSpec,
    Verdict,
)

EXAMPLES = [
    SessionSpec(request_id="r1", prompt_ids=[1, 2, 3], max_new_tokens=8,
                sampling=SamplingParams(temperature=0.7, seed=3), stop=["\n"]),
    DraftBlock(request_id="r1", round=2, num_committed=5, draft_ids=[7, 8], draft_probs=b"\x00" * 8, vocab_size=2),
    Verdict(request_id="r1", round=2, num_committed=7, num_draft_tokens=2, num_accepted=1, committed_ids=[7, 9]),
    OutputEvent(request_id="r1", seq=0, token_ids=[7, 9], num_output_tokens=2, finished=True, finish_reason="stop"),
    Heartbeat(worker_id="w", role="verify", pool="cpu", num_sessions=3, kv_cache_bytes=1024),
    Heartbeat(worker_id="d", role="draft", pool="cpu", model="suffix",
              draft_fallback=DraftFallback(draft="suffix:gguf:smollm2-135m", fault="SIGSEGV", serving="suffix",
                                           reason="llama.cpp crashed with SIGSEGV in llama_decode", since=5.0)),
    ChildStatus(name="draft-worker", state="failed", restarts=5, failures=6, last_exit="SIGSEGV",
                detail="draft-worker exited 6 times in a row", log_path=None),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: m.KIND)
def test_round_trip(message):
    assert type(message).decode(message.encode()) == message


def test_unknown_version_is_refused():
    raw = msgpack.packb({"v": 99, "kind": "verdict", "body": {}})
    with pytest.raises(ProtocolError, match="unsupported protocol version 99"):
        Verdict.decode(raw)


def test_oversized_payload_is_refused_before_parsing():
    with pytest.raises(ProtocolError, match=f"exceeds {MAX_MESSAGE_BYTES}"):
        DraftBlock.decode(b"\x00" * (MAX_MESSAGE_BYTES + 1))


@pytest.mark.parametrize(
    "kind, raw, message",
    [
        (DraftBlock, b"\xc1garbage", "not valid msgpack"),
        (DraftBlock, msgpack.packb([1, 2]), "expected a map"),
        (DraftBlock, EXAMPLES[2].encode(), "expected a 'draft_block' message, got 'verdict'"),
        (DraftBlock, msgpack.packb({"v": protocol.PROTOCOL_VERSION, "kind": "draft_block",
                                    "body": {"request_id": "r"}}), "bad fields"),
        (Verdict, msgpack.packb({"v": protocol.PROTOCOL_VERSION, "kind": "verdict",
                                 "body": {**EXAMPLES[2].to_dict(), "stats": [1, 2]}}), "stats must be a map"),
        (OutputEvent, msgpack.packb({"v": protocol.PROTOCOL_VERSION, "kind": "output",
                                     "body": {**EXAMPLES[3].to_dict(), "stats": {"num_drafts": -1}}}),
         "stats.num_drafts must be a count"),
        (Heartbeat, msgpack.packb({"v": protocol.PROTOCOL_VERSION, "kind": "heartbeat",
                                   "body": {**EXAMPLES[5].to_dict(), "draft_fallback": "SIGSEGV"}}),
         "draft_fallback must be a map"),
        (Heartbeat, msgpack.packb({"v": protocol.PROTOCOL_VERSION, "kind": "heartbeat",
                                   "body": {**EXAMPLES[5].to_dict(), "draft_fallback": {"draft": 3}}}),
         "draft_fallback.draft has the wrong type"),
        (SessionSpec, msgpack.packb({"v": protocol.PROTOCOL_VERSION, "kind": "session_spec",
                                     "body": {**EXAMPLES[0].to_dict(), "sampling": {"top_p": 5.0}}}),
         r"top_p must be in \(0, 1\]"),
        (SessionSpec, msgpack.packb({"v": protocol.PROTOCOL_VERSION, "kind": "session_spec",
                                     "body": {**EXAMPLES[0].to_dict(), "sampling": {"seed": "7"}}}),
         "seed must be an integer"),
    ],
)
def test_bad_messages_raise_protocol_error(kind, raw, message):
    with pytest.raises(ProtocolError, match=message):
        kind.decode(raw)


def test_a_heartbeat_without_a_fallback_carries_none_and_older_ones_decode():
    beat = Heartbeat(worker_id="w", role="draft", pool="cpu")
    assert beat.to_dict()["draft_fallback"] is None and Heartbeat.decode(beat.encode()).draft_fallback is None
    older = {key: value for key, value in beat.to_dict().items() if key != "draft_fallback"}
    raw = msgpack.packb({"v": protocol.PROTOCOL_VERSION, "kind": "heartbeat", "body": older}, use_bin_type=True)
    assert Heartbeat.decode(raw) == beat


def test_unknown_fields_are_ignored_so_messages_can_grow():
    body = {**EXAMPLES[2].to_dict(), "added_by_a_newer_sender": [1, 2]}
    raw = msgpack.packb({"v": protocol.PROTOCOL_VERSION, "kind": "verdict", "body": body}, use_bin_type=True)
    assert Verdict.decode(raw) == EXAMPLES[2]


def test_stats_travel_whole():
    event = OutputEvent(request_id="r", seq=3, token_ids=[1], num_output_tokens=4)
    event.stats.observe(4, 2)
    event.stats.observe(0, 0)
    decoded = OutputEvent.decode(event.encode())
    assert decoded.stats == event.stats and decoded.stats is not event.stats
    assert decoded.stats.num_accepted_tokens_per_pos == [1, 1, 0, 0]


def test_draft_probs_travel_as_float16():
    probs = torch.softmax(torch.randn(3, 11), dim=-1)
    block = DraftBlock(request_id="r", round=0, num_committed=1, draft_ids=[1, 2, 3],
                       draft_probs=protocol.encode_probs(probs), vocab_size=11)
    decoded = protocol.decode_probs(DraftBlock.decode(block.encode()))
    assert decoded.shape == (3, 11)
    torch.testing.assert_close(decoded, probs, atol=1e-3, rtol=1e-2)
    block.vocab_size = 12
    with pytest.raises(ProtocolError, match="expected 72"):
        protocol.decode_probs(block)


def test_names_are_namespaced():
    assert protocol.draft_queue("cpu") == "draft.cpu"
    assert protocol.verify_pool_queue("gpu").startswith("mirror-sd:")
    assert protocol.output_stream("x") != protocol.verdict_queue("x")


def test_a_spec_carries_its_sampling_params_whole():
    spec = SessionSpec.decode(EXAMPLES[0].encode())
    assert spec.sampling == SamplingParams(temperature=0.7, seed=3) and not spec.sampling.greedy
    body = EXAMPLES[0].to_dict()
    assert body["sampling"] == {"temperature": 0.7, "top_p": 1.0, "top_k": 0, "seed": 3, "presence_penalty": 0.0,
                                "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": [],
                                "logprobs": None, "grammar": None}
    assert "temperature" not in body  # one object, not its fields copied beside the others
    del body["sampling"]  # a spec without one samples greedily
    raw = msgpack.packb({"v": protocol.PROTOCOL_VERSION, "kind": "session_spec", "body": body})
    assert SessionSpec.decode(raw).sampling == SamplingParams()


def test_penalties_biases_and_logprobs_cross_whole():
    sampling = SamplingParams(temperature=0.5, presence_penalty=0.5, frequency_penalty=-0.25,
                              repetition_penalty=1.2, logit_bias={7: -100, 3: 2.5}, logprobs=4)
    spec = SessionSpec(request_id="r", prompt_ids=[1, 2], max_new_tokens=4, sampling=sampling)
    decoded = SessionSpec.decode(spec.encode()).sampling
    assert decoded == sampling and decoded.logit_bias == ((3, 2.5), (7, -100.0)) and decoded.processes_logits
    event = OutputEvent(request_id="r", seq=0, token_ids=[5, 6], num_output_tokens=2, logprobs=[-0.5, -1.25],
                        top_ids=[[5, 1], [9, 6]], top_logprobs=[[-0.5, -2.0], [-1.0, -1.25]])
    again = OutputEvent.decode(event.encode())
    assert (again.logprobs, again.top_ids, again.top_logprobs) == (event.logprobs, event.top_ids, event.top_logprobs)
