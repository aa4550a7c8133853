"""A run outlives every peer: when each peer holding the run's state is SIGKILLed while the
coordinator runs, new peers (started with no ``resume`` of their own) continue from the latest
complete checkpoint the dead ones wrote; a coordinator started with ``--resume`` does the same
for a run whose coordinator is gone too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conftest import assert_bitwise_equal
from isthmus.checkpoint import CheckpointStore
from isthmus.cli import main as cli_main
from isthmus.coordinator.protocol import RestorePoint

STEPS = 16
KILL_AT = 9
JOB: dict[str, Any] = {"steps": STEPS, "step_delay": 0.02, "checkpoint_every": 2}


def _commits_after_restart(events: list[dict[str, Any]]) -> list[int]:
    restarts = [k for k, e in enumerate(events) if e["kind"] == "restart"]
    assert len(restarts) == 1, [e for e in events if e["kind"] == "restart"]
    return [e["round"] for e in events[restarts[0] :] if e["kind"] == "commit"]


def test_new_peers_continue_from_the_checkpoint_when_every_peer_died(cluster, tmp_path: Path):
    ck = str(tmp_path / "ck")
    c = cluster(start_peers=2, min_peers=2)  # a restart forms with min_peers restored peers
    for name in ("a", "b"):
        c.spawn(name, checkpoint_dir=ck, faults=[f"kill@step:step={KILL_AT}"], **JOB)
    assert c.wait(timeout=120) == {"a": -9, "b": -9}
    on_disk = CheckpointStore(ck).revisions()
    assert 0 < on_disk[-1] <= KILL_AT

    # Both evicted: nobody holds the run's state, and the coordinator knows a checkpoint: the
    # last one a peer reported. The kill can land between a checkpoint's last write and its
    # report, so the newest on disk may be one the coordinator never heard of.
    st = c.wait_until(lambda st: st["world"] == 0, "both peers to be evicted")
    assert st["restore_point"]["url"] == ck, st["restore_point"]
    latest = st["restore_point"]["revision"]
    assert latest in on_disk, (latest, on_disk)

    # New processes under the same names, no resume of their own: told at registration, they
    # load the checkpoint (shared and their slots' local state) and the run goes on from there.
    for name in ("a", "b"):
        c.spawn(name, checkpoint_dir=ck, **JOB)
    assert c.wait(timeout=120) == {"a": 0, "b": 0}, c.log("a")
    fa, fb = c.final("a"), c.final("b")
    assert fa["resumed_from"] == fb["resumed_from"] == latest
    assert fa["revision"] == fb["revision"] == STEPS
    assert fa["digest"] == fb["digest"]
    assert_bitwise_equal(c.state("a"), c.state("b"))
    st = c.coord.status(events=2000)
    assert st["counters"]["parity_failures"] == 0
    rounds = _commits_after_restart(st["events"])
    assert rounds == list(range(latest, STEPS)), rounds  # on from the checkpoint, not from 0

    # The coordinator is gone too: a new one started with --resume DIR hands the checkpoint to
    # peers that start without one.
    assert cli_main(["coordinator", "--token", "t", "--resume", str(tmp_path / "none")]) == 2
    end = CheckpointStore(ck).revisions()[-1]
    assert end == STEPS  # the run's last checkpoint, written as it finished
    c2 = cluster(start_peers=1, restore_from=RestorePoint(ck, end))
    c2.spawn("a", **{**JOB, "steps": STEPS + 4})
    assert c2.wait(timeout=120) == {"a": 0}, c2.log("a")
    f = c2.final("a")
    assert f["resumed_from"] == STEPS and f["revision"] == STEPS + 4
    events = c2.coord.status(events=500)["events"]
    assert [e["round"] for e in events if e["kind"] == "commit"] == list(range(STEPS, STEPS + 4))
