"""When a session probes its links (LinkProber), in one process."""

from __future__ import annotations

from isthmus.comm.probe import LinkProber
from isthmus.coordinator.protocol import RoundPlan
from isthmus.testing import local_groups


def _plan(epoch: int, members: tuple[int, ...]) -> RoundPlan:
    return RoundPlan(
        round=0, epoch=epoch, members=members, transfers=(), expected={}, new_epoch=True
    )


def test_a_member_set_is_probed_once_and_only_when_every_member_has_probing_on():
    on = LinkProber(enabled=True, cap=1 << 20)
    four = _plan(1, (1, 2, 3, 4))
    assert on.wishes(_plan(1, (1, 2, 3))) == [0, 0]  # three: every order is the same ring
    assert on.wishes(four) == [1, 0]
    on.agree(four, [1, 1])  # some member has it off: nobody probes
    assert not on.due(four)
    on.agree(four, [1, 0])
    assert on.due(four)
    # the same members again (an aborted round, the ring reordered): no second probe
    again = _plan(2, (1, 2, 4, 3))
    assert on.wishes(again) == [0, 0]
    on.agree(again, [0, 0])
    assert not on.due(again) and on.due(four)
    joined = _plan(3, (1, 2, 3, 4, 5))
    assert on.wishes(joined) == [1, 0]
    assert LinkProber(enabled=False, cap=1 << 20).wishes(four) == [0, 1]
    assert LinkProber(enabled=True, cap=1).run(local_groups(1)[0], four) is None  # not due
