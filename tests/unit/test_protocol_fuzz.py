"""Property tests: every protocol decoder turns any bytes, and any well-formed envelope with any body, into
a message of its kind or a ProtocolError, never another exception."""

from __future__ import annotations

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services import protocol
from services.protocol import (BlockTaken, DraftBlock, Heartbeat, OutputEvent, ProtocolError, RoutingTable,
                               SessionSpec, Verdict, decode_one_of)

KINDS = (SessionSpec, DraftBlock, Verdict, BlockTaken, OutputEvent, Heartbeat, RoutingTable)

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**63, max_value=2**64 - 1) | st.floats() | st.text()
    | st.binary(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12,
)


def decodes_or_refuses(kind, data) -> None:
    try:
        message = kind.decode(data)
    except ProtocolError:
        return
    assert isinstance(message, kind)
    message.encode()  # whatever was accepted is well-typed enough to travel again


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(KINDS), st.binary(max_size=512))
def test_arbitrary_bytes(kind, data):
    decodes_or_refuses(kind, data)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(KINDS), st.dictionaries(st.text(max_size=16), msgpack_values, max_size=8), st.data())
def test_any_body_in_a_valid_envelope(kind, body, data):
    # keep some real field names, so the type checks (not only "missing field") are reached
    names = [name for name in kind.__dataclass_fields__]
    for name in data.draw(st.lists(st.sampled_from(names), max_size=len(names), unique=True)):
        body[name] = data.draw(msgpack_values)
    raw = msgpack.packb({"v": protocol.PROTOCOL_VERSION, "kind": kind.KIND, "body": body}, use_bin_type=True)
    decodes_or_refuses(kind, raw)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=256))
def test_the_inbox_decoder_of_several_kinds(data):
    try:
        assert isinstance(decode_one_of(data, (Verdict, BlockTaken)), (Verdict, BlockTaken))
    except ProtocolError:
        pass


def test_a_wrong_field_type_is_named():
    raw = msgpack.packb({"v": protocol.PROTOCOL_VERSION, "kind": "draft_block",
                         "body": {"request_id": "r", "round": "one", "num_committed": 3, "draft_ids": [1]}},
                        use_bin_type=True)
    try:
        DraftBlock.decode(raw)
    except ProtocolError as exc:
        assert "round must be int" in str(exc)
    else:
        raise AssertionError("a str round was accepted")
