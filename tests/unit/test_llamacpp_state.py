"""llama.cpp's sequence-state format as services/models/llamacpp_state.py writes and reads it."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from services.models.llamacpp_state import MAGIC, SequenceState, StateFormatError, check_format, parse, write


def state(cells: int = 5, layers: int = 3, width: int = 8, *, v_trans: bool = False, stream: int = 1,
          streams: int = 4) -> SequenceState:
    rng = np.random.default_rng(0)
    rows = lambda: [rng.standard_normal((cells, width)).astype(np.float16) for _ in range(layers)]  # noqa: E731
    return SequenceState(sequence_id=2, num_streams=streams, stream=stream,
                         positions=np.arange(cells, dtype=np.int32), keys=rows(), values=rows(), v_trans=v_trans)


@pytest.mark.parametrize("v_trans", [False, True])
def test_written_state_reads_back_the_same(v_trans):
    original = state(v_trans=v_trans)
    blob = write(original)
    back = parse(blob)
    assert (back.sequence_id, back.num_streams, back.stream, back.v_trans) == (2, 4, 1, v_trans)
    assert back.positions.tolist() == [0, 1, 2, 3, 4]
    for ours, theirs in zip(original.keys + original.values, back.keys + back.values):
        assert np.array_equal(ours, theirs)
    assert check_format(blob).stream == 1


def test_layout_is_llama_cpps():
    blob = write(state(cells=2, layers=1, width=4, stream=0, streams=2))
    # header, one stream's cell count, two cells (position, one sequence, its id), v_trans and layers
    assert struct.unpack_from("<IiII", blob) == (MAGIC, 2, 2, 2)
    assert struct.unpack_from("<6i", blob, 16) == (0, 1, 2, 1, 1, 2)
    assert struct.unpack_from("<II", blob, 40) == (0, 1)
    assert struct.unpack_from("<iQ", blob, 48) == (1, 8)  # float16 keys, rows of 4 x 2 bytes
    assert struct.unpack_from("<I", blob, len(blob) - 4) == (0,)  # the second stream: no cells


def test_what_is_not_a_state_is_refused():
    blob = write(state())
    with pytest.raises(StateFormatError, match="magic"):
        parse(b"\0" * 16 + blob[16:])
    with pytest.raises(StateFormatError, match="ends early"):
        parse(blob[:-20])
    with pytest.raises(StateFormatError, match="left over"):
        parse(blob + b"\0\0\0\0")
    float32_keys = bytearray(blob)
    first_key_type = 12 + 4 * 1 + 4 + 12 * 5 + 8  # header, stream 0's count, stream 1's, its 5 cells, v_trans
    assert struct.unpack_from("<i", blob, first_key_type) == (1,)
    float32_keys[first_key_type: first_key_type + 4] = struct.pack("<i", 0)
    with pytest.raises(StateFormatError, match="key type 0"):
        parse(bytes(float32_keys))
