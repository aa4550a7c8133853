"""The run's phase: the table of legal moves, the refusal of every other, the round that only
the running phase carries, and the phases a membership walks through (start, rounds committed
and aborted, a restart from a checkpoint)."""

import itertools

import pytest
from test_membership import Run, full_round

from isthmus.coordinator.phase import TRANSITIONS, IllegalTransition, Phase, Round, RunPhase
from isthmus.coordinator.protocol import RestorePoint, RoundPlan

PLAN = RoundPlan(round=0, epoch=1, members=(0,), transfers=(), expected={}, new_epoch=True)
LEGAL = {
    (Phase.STARTING, Phase.RUNNING),
    (Phase.RESTARTING, Phase.RUNNING),
    (Phase.RUNNING, Phase.COMMITTED),
    (Phase.RUNNING, Phase.ABORTED),
    (Phase.COMMITTED, Phase.RUNNING),
    (Phase.COMMITTED, Phase.RESTARTING),
    (Phase.ABORTED, Phase.RUNNING),
    (Phase.ABORTED, Phase.RESTARTING),
}


def at(phase: Phase) -> RunPhase:
    """A RunPhase in ``phase``, reached by legal moves only."""
    path = {
        Phase.STARTING: [],
        Phase.RUNNING: [Phase.RUNNING],
        Phase.COMMITTED: [Phase.RUNNING, Phase.COMMITTED],
        Phase.ABORTED: [Phase.RUNNING, Phase.ABORTED],
        Phase.RESTARTING: [Phase.RUNNING, Phase.ABORTED, Phase.RESTARTING],
    }[phase]
    ph = RunPhase()
    for step in path:
        ph.to(step, Round(PLAN, 0.0, {0: "n"}) if step is Phase.RUNNING else None)
    assert ph.phase is phase
    return ph


def test_the_table_holds_exactly_the_legal_moves():
    assert {(a, b) for a, bs in TRANSITIONS.items() for b in bs} == LEGAL
    assert set(TRANSITIONS) == set(Phase)


@pytest.mark.parametrize("src,dst", list(itertools.product(Phase, Phase)))
def test_every_move_is_taken_or_refused_by_the_table(src, dst):
    ph = at(src)
    ph.waiting(5.0)
    rnd = Round(PLAN, 1.0, {0: "n"}) if dst is Phase.RUNNING else None
    assert ph.may(dst) == ((src, dst) in LEGAL)
    if (src, dst) in LEGAL:
        ph.to(dst, rnd)
        assert ph.phase is dst and ph.round is rnd and ph.waiting_since is None
    else:
        before = (ph.round, ph.waiting_since)
        with pytest.raises(IllegalTransition, match=f"from {src.value} to {dst.value}"):
            ph.to(dst, rnd)
        assert ph.phase is src and (ph.round, ph.waiting_since) == before  # unchanged


def test_only_the_running_phase_carries_a_round():
    ph = RunPhase()
    with pytest.raises(ValueError, match="running phase needs"):
        ph.to(Phase.RUNNING)
    assert ph.phase is Phase.STARTING
    ph.to(Phase.RUNNING, Round(PLAN, 0.0, {}))
    with pytest.raises(ValueError, match="committed phase has no"):
        ph.to(Phase.COMMITTED, Round(PLAN, 0.0, {}))
    assert ph.phase is Phase.RUNNING and ph.round is not None
    ph.to(Phase.COMMITTED)
    assert ph.round is None


def test_the_questions_follow_the_phase():
    expect = {  # started, running, new epoch due
        Phase.STARTING: (False, False, True),
        Phase.RESTARTING: (False, False, True),
        Phase.RUNNING: (True, True, False),
        Phase.COMMITTED: (True, False, False),
        Phase.ABORTED: (True, False, True),
    }
    for phase, answers in expect.items():
        ph = at(phase)
        assert (ph.started, ph.running, ph.new_epoch_due) == answers, phase


def test_the_forming_clock_starts_once_and_restarts_with_each_phase():
    ph = RunPhase()
    assert ph.waiting(3.0) == 3.0 and ph.waiting(7.0) == 3.0
    ph.nobody_waiting()
    assert ph.waiting(8.0) == 8.0
    ph.to(Phase.RUNNING, Round(PLAN, 8.0, {}))
    assert ph.waiting_since is None


def phases(r: Run) -> tuple[Phase, bool]:
    """The membership's phase, and whether its running plan agrees with it."""
    return r.m.phase.phase, (r.m.running is not None) == (r.m.phase.phase is Phase.RUNNING)


def test_a_membership_walks_start_running_committed_aborted():
    r = Run(start_peers=2)
    a, b = r.add("a"), r.add("b")
    assert phases(r) == (Phase.STARTING, True) and not r.m.started
    r.begin(a)
    assert phases(r) == (Phase.STARTING, True) and r.m.phase.waiting_since == r.now
    r.begin(b)
    assert phases(r) == (Phase.RUNNING, True) and r.m.started
    plan = r.poll(a).plan
    r.commit(a, plan)
    r.commit(b, plan)
    assert phases(r) == (Phase.COMMITTED, True)
    same = full_round(r, [a, b])
    assert not same.new_epoch  # the same members after a commit keep the epoch
    r.begin(a)
    r.begin(b)
    r.commit(a, r.poll(a).plan, ok=False)
    assert phases(r) == (Phase.ABORTED, True)
    again = full_round(r, [a, b])
    assert again.new_epoch and again.epoch == same.epoch + 1  # an abort opens a new epoch


def test_losing_every_in_sync_peer_restarts_and_the_restart_waits_as_a_first_round():
    r = Run(start_peers=3, min_peers=1)
    a, b, c = r.add("a"), r.add("b"), r.add("c")
    full_round(r, [a, b, c])
    r.m.set_restore_point(RestorePoint("/ck", 1), r.now)
    for p in (a, b, c):
        r.m.remove(p, r.now, "killed")
    assert phases(r) == (Phase.COMMITTED, True)  # lazily: nobody to restart with yet
    d = r.add("d")
    assert phases(r) == (Phase.RESTARTING, True) and r.m.restore_wanted() is not None
    # it loaded the checkpoint; alone, below start_peers: it waits for restart_timeout, then
    # the restart forms with min_peers
    assert r.begin(d, revision=1).kind == "wait" and phases(r) == (Phase.RESTARTING, True)
    r.advance(r.m.config.restart_timeout + 0.5)
    plan = r.poll(d).plan
    assert plan is not None and plan.new_epoch and phases(r) == (Phase.RUNNING, True)


def test_members_missing_the_commit_deadline_are_all_evicted_and_the_reporter_stays():
    r = Run(start_peers=3, commit_timeout=10.0, heartbeat_timeout=1000.0)
    a, b, c = r.add("a"), r.add("b"), r.add("c")
    for p in (a, b, c):
        r.begin(p)
    r.commit(c, r.poll(a).plan)  # c reports; a and b never do
    r.now += 11
    r.m.tick(r.now)
    assert {p: r.m.peers[p].state.value for p in (a, b, c)} == {
        a: "dead",
        b: "dead",
        c: "active",
    }
    assert phases(r) == (Phase.ABORTED, True) and r.m.counters["rounds_aborted"] == 1
