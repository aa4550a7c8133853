"""Repeated aborts of a round for one cause: when to stop, and what the error says."""

from __future__ import annotations

import pytest

from isthmus.coordinator.abort_streak import AbortStreak, normalize_cause


def test_normalize_cause_keeps_who_and_drops_what_changes_per_attempt() -> None:
    a = "peer 2 (peer2) failed: all_reduce did not complete within 30.0s (epoch 5)"
    b = "peer 2 (peer2) failed: all_reduce did not complete within 30.0s (epoch 6)"
    assert normalize_cause(a) == normalize_cause(b)
    c = a.replace("peer 2 (peer2)", "peer 3 (peer3)")
    assert normalize_cause(a) != normalize_cause(c)
    r1 = "Read error [10.0.0.4]:55500: Connection reset by peer"
    r2 = "Read error [10.0.0.4]:41002: Connection reset by peer"
    assert normalize_cause(r1) == normalize_cause(r2)
    assert "10.0.0.4" in normalize_cause(r1)


def test_abort_streak_stops_on_the_same_cause_and_resets() -> None:
    s = AbortStreak(limit=3)
    for i in range(2):
        reason = f"peer 1 (peer1) failed: timed out in epoch {i}"
        s.aborted(normalize_cause(reason), reason)
    assert s.stop() is None
    s.aborted(normalize_cause("peer 3 (peer3) failed: reset"), "peer 3 (peer3) failed: reset")
    assert s.count == 1 and s.stop() is None  # another cause starts over
    for i in range(3):
        reason = f"peer 1 (peer1) failed: timed out in epoch {i + 7}"
        s.aborted(normalize_cause(reason), reason)
    stop = s.stop()
    assert stop is not None
    assert "3 times in a row" in stop and "peer 1 (peer1) failed: timed out in epoch 9" in stop
    s.committed()
    assert s.stop() is None and s.count == 0
    with pytest.raises(ValueError, match="limit"):
        AbortStreak(limit=1)
