"""A member SIGSTOPped inside a collective, with ``collective_timeout`` far beyond the test's own
bounds: the survivors commit the retried round anyway, so it is the coordinator's abort that
released them (their groups' connections are cut), not the timeout; after SIGCONT the stopped
peer is resynced and never corrupts the state."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from conftest import assert_bitwise_equal

# Whatever ends the survivors' wait in these tests, it is not this timeout: every wait_until
# below gives up long before it.
TIMEOUT = 600.0
STOP_STEP = 8


def _state(pid: int) -> str:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text.rsplit(")", 1)[1].split()[0]


@pytest.mark.parametrize("compression", [None, "int8"], ids=["ddp", "ddp-int8"])
def test_survivors_commit_while_a_member_is_stopped_in_a_collective(cluster, compression):
    c = cluster(start_peers=3, heartbeat_timeout=3.0)
    job = {
        "steps": 80,
        "step_delay": 0.1,  # the survivors are still training when the stopped peer resumes
        "collective_timeout": TIMEOUT,
        "round_timeout": TIMEOUT,
        "compression": compression,
    }
    c.spawn("a", **job)
    c.spawn("b", **job)
    c.spawn("s", faults=[f"stop@collective:step={STOP_STEP}"], **job)
    stopped = c.procs["s"]
    c.wait_until(lambda st: _state(stopped.pid) in ("T", "t"), "s to stop itself", timeout=120)

    # The survivors were inside the round's collective with s. They get out when the
    # coordinator evicts s (heartbeat_timeout) and aborts the round, and commit the retry.
    def retried(st: dict) -> bool:
        return any(
            e["kind"] == "commit" and e["round"] == STOP_STEP and e["world"] == 2
            for e in st["events"]
        )

    st = c.wait_until(retried, "the survivors to commit the retried round", timeout=120)
    assert _state(stopped.pid) in ("T", "t"), "s resumed before the survivors committed"
    aborts = [e for e in st["events"] if e["kind"] == "abort" and e["round"] == STOP_STEP]
    assert aborts and "no heartbeat" in aborts[0]["reason"], aborts
    c.wait_until(lambda st: st["revision"] >= STOP_STEP + 3, "rounds after the retry", timeout=60)

    # SIGCONT: s finds its connections closed, is told it was evicted, registers again and is
    # resynced before it takes part.
    stopped.send_signal(signal.SIGCONT)
    assert c.wait(timeout=240) == {"a": 0, "b": 0, "s": 0}, c.log("s")
    fs = c.final("s")
    assert fs["evictions"] >= 1
    assert any(r["resynced"] and r["outcome"] == "committed" for r in fs["rounds"]), fs["rounds"]
    st = c.coord.status(events=2000)
    assert st["counters"]["parity_failures"] == 0
    fa = c.final("a")
    assert fa["step"] == 80 and fa["revision"] == 80
    assert fa["digest"] == c.final("b")["digest"] == fs["digest"]
    assert_bitwise_equal(c.state("a"), c.state("s"))
    assert_bitwise_equal(c.state("a"), c.state("b"))
