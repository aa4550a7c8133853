"""Catching up by replay under ``zo``, in one process: the round log's format and bounds, and the
choice between replay and state transfer."""

from __future__ import annotations

import pytest
import torch

from isthmus.strategies.zo.math import ScalarCodec
from isthmus.strategies.zo.replay import (
    LoggedRound,
    RoundLog,
    decode_rounds,
    encode_rounds,
    nonzero_estimates,
    replay_is_cheaper,
)

pytestmark = pytest.mark.usefixtures("one_thread")


# -- the log ------------------------------------------------------------------------------------
def test_rounds_round_trip_through_the_wire_format_and_truncation_is_refused():
    rounds = [LoggedRound(7, 2, b"\x01\x02"), LoggedRound(8, 3, b"\x03\x04\x05")]
    raw = encode_rounds(rounds)
    assert len(raw) == 2 * 12 + 5  # int64 round + int32 world per round, then the codes
    assert decode_rounds(raw, 1) == rounds
    with pytest.raises(ValueError, match="truncated"):
        decode_rounds(raw[:-1], 1)
    with pytest.raises(ValueError, match="world size 0"):
        decode_rounds(encode_rounds([LoggedRound(1, 0, b"")]), 1)


def test_the_log_is_bounded_and_contiguous():
    log = RoundLog(3)
    for r in range(5):
        log.append(LoggedRound(r, 1, b"\x00"))
    assert [e.round for e in log] == [2, 3, 4]
    assert [e.round for e in log.span(3, 5) or []] == [3, 4]
    assert log.span(1, 5) is None  # round 1 fell out
    assert log.span(3, 6) is None  # round 5 not there yet
    assert log.span(4, 4) is None  # nothing to replay
    log.append(LoggedRound(9, 1, b"\x00"))  # a gap: the rounds before it cannot be replayed
    assert [e.round for e in log] == [9]


def test_replay_is_chosen_when_the_log_and_the_regeneration_cost_less_than_the_state():
    rate = 1e6  # bytes per second
    common = {"log_bytes": 1000, "link_bytes_per_s": rate, "seconds_per_estimate": 0.01}
    # 5 MB of state: 5 s to transfer; 100 estimates: 1 s + 1 ms to replay
    assert replay_is_cheaper(transfer_bytes=5_000_000, estimates=100, **common)
    # 1000 estimates: 10 s
    assert not replay_is_cheaper(transfer_bytes=5_000_000, estimates=1000, **common)
    codec = ScalarCodec(8)
    zero, absent, one = codec.encode(0.0), codec.absent, codec.encode(1.0)
    rows = torch.cat([codec.pack([one]), codec.pack([zero]), codec.pack([absent])])
    raw = bytes(rows.tolist())
    # only present, nonzero estimates regenerate a z
    assert nonzero_estimates([LoggedRound(0, 3, raw)], codec, 1) == 1
