"""The final checkpoint wait's rule (isthmus.checkpoint.write_wait): on for as long as the
write's progress mark changes, over once it has not for idle_s (not before min_s), and over at
limit_s regardless. A fake clock; one process."""

from __future__ import annotations

import pytest

from isthmus.checkpoint.write_wait import WriteWait


def test_a_write_that_keeps_progressing_is_waited_for_until_its_limit() -> None:
    w = WriteWait(100.0, idle_s=60.0, limit_s=3600.0)
    for i in range(1, 120):  # a byte count that grows every 30 s: an hour of it
        now = 100.0 + 30.0 * i
        w.observe(now, (1, 1000 * i))
        assert w.give_up(now) is None
    assert w.changes == 118
    why = w.give_up(100.0 + 3600.0)
    assert why is not None and "limit" in why


def test_a_write_that_stops_is_given_up_idle_s_after_its_last_progress() -> None:
    w = WriteWait(0.0, idle_s=60.0, limit_s=3600.0)
    w.observe(0.0, (1, 0))
    w.observe(500.0, (1, 4096))  # the last change
    for now in (520.0, 540.0, 559.0):
        w.observe(now, (1, 4096))
        assert w.give_up(now) is None
    why = w.give_up(560.0)
    assert why == "no progress for 60s"
    assert w.idle_for(560.0) == 60.0


def test_a_write_that_never_progresses_waits_idle_s_from_the_start() -> None:
    w = WriteWait(10.0, idle_s=60.0, limit_s=3600.0)
    w.observe(10.0, (0, -1))
    w.observe(69.0, (0, -1))
    assert w.give_up(69.0) is None and w.give_up(70.0) is not None


def test_min_s_holds_a_wait_whose_mark_cannot_move_before_the_file_completes() -> None:
    # an object store: nothing shows until the upload is done, so only min_s bounds it below
    w = WriteWait(0.0, idle_s=60.0, limit_s=9000.0, min_s=4060.0)
    w.observe(0.0, (1, 0))
    assert w.give_up(4059.0) is None
    assert w.give_up(4060.0) == "no progress for 4060s"


def test_the_first_mark_is_the_reference_not_progress() -> None:
    w = WriteWait(0.0, idle_s=5.0, limit_s=50.0)
    w.observe(4.0, (3, 100))
    assert w.changes == 0 and w.give_up(5.0) is not None


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"idle_s": 0.0}, "idle_s"),
        ({"idle_s": float("nan")}, "idle_s"),
        ({"limit_s": float("inf")}, "limit_s"),
        ({"limit_s": 30.0}, "limit_s: must be >= idle_s"),
        ({"min_s": -1.0}, "min_s"),
        ({"min_s": 100.0}, "limit_s: must be >= idle_s and >= min_s"),
    ],
)
def test_bad_bounds_are_refused_naming_the_field(kw: dict[str, float], msg: str) -> None:
    args = {"idle_s": 60.0, "limit_s": 90.0, **kw}
    with pytest.raises(ValueError, match=f"WriteWait.{msg}"):
        WriteWait(0.0, **args)


def test_the_final_wait_bounds_grow_with_the_state() -> None:
    from isthmus.strategies.base import final_checkpoint_limit_s, final_checkpoint_wait_s

    assert final_checkpoint_limit_s(0, 30.0) == 60.0 == final_checkpoint_wait_s(0, 30.0)
    big = 40 * 10**9  # a 10B-parameter fp32 state
    assert final_checkpoint_limit_s(big, 30.0) == 60.0 + 40_000.0  # at 1 MB/s
    assert final_checkpoint_limit_s(big, 30.0) > final_checkpoint_wait_s(big, 30.0)
