"""The churn schedule as a pure state machine (isthmus.lab.churn_plan): no processes, no clocks."""

from __future__ import annotations

from isthmus.lab.churn_plan import ChurnPlan, Planned, starting_slots


def _p(
    action: str, slot: int, when: float, clock: str = "step", source: str = "scenario"
) -> Planned:
    return Planned(action=action, slot=slot, clock=clock, when=when, source=source)  # type: ignore[arg-type]


def test_starting_slots_leave_out_those_that_join_first() -> None:
    events = [_p("join", 2, 10), _p("kill", 1, 5), _p("join", 1, 20), _p("kill", 3, 2.0, "seconds")]
    assert starting_slots(4, events) == [0, 1, 3]


def test_each_incarnation_carries_the_faults_of_its_lifetime() -> None:
    """Slot 1 is killed at 10, rejoins at 20, is stopped at 25 and killed at 30: the first process
    carries only the first kill; the one started at 20 the stop and the second kill."""
    plan = ChurnPlan(
        [
            _p("kill", 1, 10),
            _p("join", 1, 20),
            _p("stop", 1, 25),
            _p("cont", 1, 27),
            _p("kill", 1, 30),
        ]
    )
    assert plan.faults_for(1, 0) == ["kill@step:step=10"]
    assert plan.faults_for(0, 0) == []
    assert plan.faults_for(1, 20) == ["stop@step:step=25", "kill@step:step=30"]
    assert [p.action for p in plan.pending] == ["join", "cont"]


def test_due_events_and_the_decisions_on_them() -> None:
    plan = ChurnPlan(
        [
            _p("join", 1, 20),
            _p("kill", 0, 5.0, "seconds"),
            _p("stop", 2, 1.0, "seconds", "random"),
            _p("cont", 2, 3.0, "seconds", "random"),
            _p("join", 3, 2.0, "seconds", "random"),
        ]
    )
    join = next(p for p in plan.pending if p.slot == 1)
    assert plan.due(run_step=25, elapsed=None) == [join]  # no timed event before the first round
    due = plan.due(run_step=0, elapsed=3.5)
    assert {(p.action, p.slot) for p in due} == {("stop", 2), ("cont", 2), ("join", 3)}
    # a scenario join waits while its slot still runs (its kill fault has not fired yet)
    assert plan.decide(join, "running", run_step=25).kind == "wait"
    d = plan.decide(join, "exited", run_step=25)
    assert (d.kind, d.from_step) == ("apply", 20)
    # a random join of a running peer is skipped, with the reason
    rjoin = next(p for p in plan.pending if p.slot == 3)
    assert plan.decide(rjoin, "running", run_step=0).reason == "the peer is running"
    d = plan.decide(rjoin, "absent", run_step=7)
    assert (d.kind, d.from_step) == ("apply", 7)
    kill = next(p for p in plan.pending if p.action == "kill")
    assert plan.decide(kill, "exited", run_step=0).reason == "the peer is not running"
    assert plan.decide(kill, "stopped", run_step=0).kind == "apply"
    stop = next(p for p in plan.pending if p.action == "stop")
    assert plan.decide(stop, "stopped", run_step=0).reason == "the peer is already stopped"
    cont = next(p for p in plan.pending if p.action == "cont")
    assert plan.decide(cont, "stopped", run_step=0).kind == "apply"
    assert plan.decide(cont, "running", run_step=0).reason == "the peer is not stopped"
    plan.done(cont)
    assert cont not in plan.pending


def test_observed_faults_and_what_never_happened() -> None:
    plan = ChurnPlan(
        [
            _p("kill", 1, 10),
            _p("stop", 2, 5),
            _p("join", 1, 40),
            _p("kill", 0, 9.0, "seconds", "random"),
        ]
    )
    plan.faults_for(1, 0)
    plan.faults_for(2, 0)
    assert plan.observed(1, "stop") is None
    seen = plan.observed(1, "kill")
    assert seen is not None and seen.when == 10
    assert plan.observed(1, "kill") is None  # recorded once
    left = {(p.action, p.slot): why for p, why in plan.leftovers()}
    # the stop handed to slot 2 never fired; the join never came; the random kill is dropped
    assert left == {
        ("stop", 2): "the peer never reached that step",
        ("join", 1): "the run ended first",
    }


def test_a_frozen_run_can_be_woken_only_by_a_planned_cont() -> None:
    plan = ChurnPlan([_p("cont", 1, 50)])
    assert not plan.can_wake(run_step=10)  # a step-clock cont cannot come: the step is stuck
    assert plan.can_wake(run_step=50)
    assert ChurnPlan([_p("cont", 1, 9.0, "seconds")]).can_wake(run_step=0)
    assert not ChurnPlan([]).can_wake(run_step=0)
