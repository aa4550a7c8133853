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
