"""Fault specs (isthmus.comm.faults): the one spec grammar with the point or step after '@'."""

from __future__ import annotations

import pytest

from isthmus.comm.faults import FAULT_ACTIONS, Fault, FaultInjector


def test_fault_specs_parse_in_all_three_forms() -> None:
    assert Fault.parse("kill@20") == Fault(action="kill", point="step", step=20)
    assert Fault.parse("kill@collective:step=20") == Fault(
        action="kill", point="collective", step=20
    )
    assert Fault.parse(" Fail@Commit:round=3 ") == Fault(action="fail", point="commit", round=3)
    assert Fault.parse("stop@step:step=5,round=2") == Fault(
        action="stop", point="step", step=5, round=2
    )
    assert FAULT_ACTIONS.names() == ["kill", "stop", "fail", "corrupt"]


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("kil@20", r"unknown fault action 'kil' \(did you mean 'kill'\?\)"),
        ("kill@colective:step=2", r"point: .* got 'colective' \(did you mean 'collective'\?\)"),
        (
            "kill@collective:stp=2",
            r"stp: .*unknown option 'stp' for kill \(did you mean 'step'\?\)",
        ),
        ("kill@collective:step=x", r"step: .* must be an integer, got 'x'"),
        ("kill@collective", "needs a step or a round"),
        ("kill", "needs @POINT or @STEP"),
        ("kill@20:step=3", "takes no arguments"),
        ("kill@step:step=-1", "step must be >= 0"),
        ("kill@3+stop@4", "one fault per spec"),
    ],
)
def test_bad_fault_specs_name_the_key_and_suggest(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match) as e:
        Fault.parse(spec)
    assert "ACTION@POINT:step=N" in str(e.value)  # every error shows the accepted forms


def test_injector_fires_at_the_first_check_past_the_step() -> None:
    inj = FaultInjector([Fault.parse("fail@commit:round=2")])
    inj.check("commit", round=1)
    assert inj.faults and not inj.fired
    with pytest.raises(Exception, match="injected failure"):
        inj.check("commit", round=2)
    assert not inj.faults and len(inj.fired) == 1


def test_slow_specs_parse_as_a_state_over_steps() -> None:
    whole = Fault.parse("slow:3")
    assert (whole.action, whole.factor, whole.step, whole.until) == ("slow", 3.0, 0, None)
    bout = Fault.parse("slow:2.5@20-60")
    assert (bout.factor, bout.step, bout.until) == (2.5, 20, 60)
    inj = FaultInjector([bout])
    assert [inj.slow_factor(s) for s in (19, 20, 59, 60)] == [1.0, 2.5, 2.5, 1.0]
    inj.check("step", step=30)  # a slow fault is never fired away
    assert inj.faults == [bout] and inj.fired == []
    assert inj.pace(10, 1.0) == 0.0  # outside the bout: no sleep
    assert inj.pace(30, 0.004) == pytest.approx(0.006)  # 2.5x: 1.5 times the work more


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("slow:x", r"factor 'x' is not a number"),
        ("slow:0.5", r"factor must be a number >= 1"),
        ("slow:3@60-20", r"must end after it starts"),
        ("slow:3@20", r"slow:FACTOR@START-END"),
        ("slow", r"slow:FACTOR or slow:FACTOR@START-END"),
    ],
)
def test_bad_slow_specs_say_what_to_write(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Fault.parse(spec)
