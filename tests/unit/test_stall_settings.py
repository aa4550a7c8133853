"""The bounds of stuck transfers and of the run: their defaults hold for a 10B-parameter model
over 100 Mbit/s, they are validated, they reach the built-in job's session, and `isthmus run`
sets no wall-clock limit unless asked."""

from __future__ import annotations

import argparse

import pytest

from isthmus.comm.session_config import SessionConfig
from isthmus.run.builtin_run import demo_config
from isthmus.run.config import TimeoutConfig
from isthmus.run.flags import add_config_flags, overrides_from
from isthmus.run.script_run import script_config
from isthmus.spec import SpecError
from isthmus.strategies.base import CHECKPOINT_MIN_RATE, final_checkpoint_wait_s

# A 10B-parameter model's fp32 outer gradient over 100 Mbit/s (95 Mbit/s of goodput): a ring
# all-reduce of 2 members moves it once each way, about an hour.
SYNC_10B_S = 40e9 * 8 / 95e6


def test_session_defaults_wait_on_progress_not_on_the_transfers_length() -> None:
    cfg = SessionConfig(coordinator="h:1", token="t")
    assert (cfg.stall_s, cfg.late_s) == (10.0, 600.0)
    # nothing in the session bounds the whole transfer: the bounds that remain are far shorter
    # than an hour-long sync and only count while nothing moves
    assert cfg.late_s < SYNC_10B_S and cfg.stall_s < cfg.late_s


@pytest.mark.parametrize(
    ("field", "value"),
    [("stall_s", 0), ("stall_s", -1.0), ("late_s", float("nan")), ("late_s", float("inf"))],
)
def test_session_rejects_bad_bounds(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SessionConfig(coordinator="h:1", token="t", **{field: value})


def test_late_s_must_be_at_least_stall_s() -> None:
    with pytest.raises(ValueError, match="late_s"):
        SessionConfig(coordinator="h:1", token="t", stall_s=30.0, late_s=20.0)
    with pytest.raises(SpecError, match=r"timeouts\.late_s"):
        TimeoutConfig(stall_s=30.0, late_s=20.0)


def test_the_run_config_carries_the_bounds_as_flags() -> None:
    p = argparse.ArgumentParser()
    add_config_flags(p, include=("stall_s", "late_s", "timeout"))
    args = p.parse_args(["--stall-s", "4", "--late-s", "90"])
    cfg = script_config(overrides_from(args))
    assert (cfg.timeouts.stall_s, cfg.timeouts.late_s) == (4.0, 90.0)


def test_isthmus_run_has_no_wall_clock_limit_unless_asked() -> None:
    assert script_config({}).timeouts.run_timeout is None
    assert script_config({"steps": 3}).timeouts.run_timeout is None
    assert script_config({"timeout": 60}).timeouts.run_timeout == 60.0
    assert script_config({"timeouts.run_timeout": "90"}).timeouts.run_timeout == 90.0


def test_isthmus_run_flags_without_timeout_give_no_limit() -> None:
    from isthmus.cli.runs import RUN_FLAGS

    p = argparse.ArgumentParser()
    add_config_flags(p, include=RUN_FLAGS)
    assert script_config(overrides_from(p.parse_args([]))).timeouts.run_timeout is None
    given = p.parse_args(["--timeout", "2400"])
    assert script_config(overrides_from(given)).timeouts.run_timeout == 2400.0


def test_the_demo_keeps_its_limit() -> None:
    assert demo_config().timeouts.run_timeout == 1800.0


def test_a_script_gets_the_bounds_through_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ISTHMUS_COORDINATOR", "h:1")
    monkeypatch.setenv("ISTHMUS_TOKEN", "t")
    monkeypatch.setenv("ISTHMUS_STALL_S", "4.5")
    monkeypatch.setenv("ISTHMUS_LATE_S", "120")
    cfg = SessionConfig.from_env()
    assert (cfg.stall_s, cfg.late_s) == (4.5, 120.0)
    assert SessionConfig.from_env(late_s=300.0).late_s == 300.0  # the script's own word wins
    monkeypatch.setenv("ISTHMUS_LATE_S", "soon")
    with pytest.raises(ValueError, match="ISTHMUS_LATE_S"):
        SessionConfig.from_env()


def test_the_final_checkpoint_wait_grows_with_the_state() -> None:
    assert final_checkpoint_wait_s(0, 30.0) == 60.0  # a tiny model: the old floor
    assert final_checkpoint_wait_s(0, 120.0) == 120.0
    # a 10B-parameter fp32 state (40 GB) at the slowest store allowed for
    assert final_checkpoint_wait_s(40 * 10**9, 30.0) == 60.0 + 40 * 10**9 / CHECKPOINT_MIN_RATE
    assert final_checkpoint_wait_s(40 * 10**9, 30.0) > 3600.0
