"""`isthmus coordinator`'s heartbeat bounds: the flags reach MembershipConfig, the transfer bound
defaults to 10 s (or the heartbeat bound where longer) and is never shorter than it. Parsing
only: no coordinator is started."""

from __future__ import annotations

import pytest

from isthmus.cli import build_parser, main
from isthmus.cli.runs import membership_config
from isthmus.coordinator.peers import MembershipConfig


def _membership(*flags: str) -> MembershipConfig:
    return membership_config(build_parser().parse_args(["coordinator", *flags]))


def test_the_transfer_heartbeat_bound_defaults_to_ten_seconds() -> None:
    m = _membership()
    assert (m.heartbeat_timeout, m.transfer_heartbeat_timeout) == (5.0, 10.0)
    assert m.silence_bound(True) == 10.0 and m.silence_bound(False) == 5.0


def test_the_flag_sets_the_bound_a_member_inside_a_transfer_gets() -> None:
    m = _membership("--transfer-heartbeat-timeout", "45", "--commit-timeout", "7200")
    assert m.transfer_heartbeat_timeout == 45.0 and m.commit_timeout == 7200.0
    assert m.silence_bound(True) == 45.0 and m.silence_bound(False) == 5.0


def test_a_longer_heartbeat_bound_raises_the_default_transfer_bound_with_it() -> None:
    m = _membership("--heartbeat-timeout", "15")
    assert m.transfer_heartbeat_timeout == 15.0


def test_a_transfer_bound_below_the_heartbeat_bound_is_refused_naming_both(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(ValueError, match=r"--transfer-heartbeat-timeout .* --heartbeat-timeout"):
        _membership("--heartbeat-timeout", "8", "--transfer-heartbeat-timeout", "4")
    # the command itself says so and exits 2 before it listens anywhere
    assert main(["coordinator", "--token", "t", "--transfer-heartbeat-timeout", "2"]) == 2
    err = capsys.readouterr().err
    assert "isthmus coordinator: --transfer-heartbeat-timeout (2s)" in err
    assert "--heartbeat-timeout (5s)" in err


def test_the_help_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["coordinator", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--transfer-heartbeat-timeout S" in out and "queue behind the round's data" in out
