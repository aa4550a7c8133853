"""Checkpoints of islands through `isthmus run --nproc-per-peer`: 2 islands x 2 ranks (FSDP2 on
Gloo inside) write a checkpoint every round, every rank its own shards, and the whole run is
SIGKILLed; the checkpoint resumes on 3 islands of 1 rank and on 1 island of 4, each starting
from exactly the saved state, and training goes on with every sample of the data used once.
Killed whole and restarted by ``--max-restarts``, both islands load the coordinator's restore
point and go on together, ending identical at one revision."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch

from isthmus.checkpoint import CheckpointStore, read_manifest
from isthmus.checkpoint.inspect import templates
from isthmus.checkpoint.load import load_shared
from support.cli import run_cli

SCRIPT = Path(__file__).resolve().parent / "scripts" / "island_ckpt_peer.py"


def _run(tmp: Path, name: str, *args: str, script: tuple[str, ...]) -> tuple[int, Path, str]:
    out = tmp / f"{name}-out"
    out.mkdir()
    run_dir = tmp / name
    # a 10 s heartbeat bound (an island's ranks watch each other with the same bound): the
    # ranks die by SIGKILL or exit here, and under make test's load a live rank of an island of
    # four was once silent for 3 s, so its island left a run that tests checkpoints, not that
    code, said = run_cli(
        "run", "--no-progress", "--quiet", "--heartbeat-timeout", "10",
        "--run-dir", str(run_dir), *args, str(SCRIPT), "--out", str(out), *script,
    )  # fmt: skip
    logs = "".join(f.read_text() for f in sorted(run_dir.glob("peer*.log")))
    return code, out, said + logs


def _used(out: Path, before: int | None = None) -> list[tuple[int, int]]:
    """(epoch, index) of every sample a run's commits used, from one rank's log (every member
    writes the same lines), rounds below ``before`` only when given."""
    first = sorted(out.glob("used-*"))[0]
    lines = [json.loads(line) for line in first.read_text().splitlines()]
    return [
        (d["epoch"], i) for d in lines if before is None or d["round"] < before for i in d["used"]
    ]


def test_a_2x2_island_checkpoint_resumes_as_3x1_and_1x4(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    code, out_a, logs = _run(
        tmp_path, "a", "--peers", "2", "--nproc-per-peer", "2",
        script=("--checkpoint-dir", str(ck), "--exit-at", "7"),
    )  # fmt: skip
    assert code != 0 and not list(out_a.glob("*.pt")), logs  # every rank died at step 7
    store = CheckpointStore(str(ck))
    saved = store.revisions()[-1]
    assert saved >= 2, (store.revisions(), logs)
    m = read_manifest(store, saved)
    assert m.islands == [2, 2] and len(m.shards) == 4 and m.hash_kind == "layout"
    assert m.local == ["peer0.0of2", "peer0.1of2", "peer1.0of2", "peer1.1of2"]
    expect = load_shared(store, m, templates(m.schema))  # assembled and verified, one process
    for name, shape in (("b", "1,1,1"), ("c", "4")):
        peers = "3" if name == "b" else "1"
        code, out, logs = _run(
            tmp_path, name, "--peers", peers, "--nproc-per-peer", shape,
            script=("--resume", str(ck), "--steps", "10"),
        )  # fmt: skip
        assert code == 0, logs
        recs = {f.stem: torch.load(f, weights_only=False) for f in sorted(out.glob("*.pt"))}
        assert len(recs) == (3 if name == "b" else 4), sorted(recs)
        for key, r in recs.items():
            # every rank started from exactly the saved state, whatever its island's shape
            assert r["resumed_from"] == saved and r["start"]["revision"] == saved, (key, r)
            assert sorted(r["start"]["full"]) == sorted(expect)
            for n, t in expect.items():
                assert torch.equal(r["start"]["full"][n], t), (name, key, n)
            assert r["revision"] > saved  # and went on committing rounds
            fresh, final = r["eval"]
            assert final < 0.8 * fresh, (name, r["eval"])  # trained, from the saved model on
        assert len({r["digest"] for r in recs.values()}) == 1
        assert {int(r["full"]["meta/step"]) for r in recs.values()} == {10}
        # every sample once per epoch: what run a committed up to the checkpoint, then this run
        used = Counter(_used(out_a, before=saved) + _used(out))
        assert used and max(used.values()) == 1, [k for k, v in used.items() if v > 1]
        assert sum(1 for e, _ in used if e == 0) == 64  # epoch 0 was used whole


def test_islands_restarted_whole_continue_together_from_the_runs_restore_point(
    tmp_path: Path,
) -> None:
    """Both islands of a run die whole (every rank SIGKILLed) after checkpoints; the launcher
    starts both again, the coordinator answers each registration with the restore point, and
    every rank loads its part of it before any round. The restart round waits for both islands
    (as a first round does), so the run goes on from there as one: every rank ends with the
    same state at the same revision."""
    ck = tmp_path / "ck"
    code, out, logs = _run(
        tmp_path, "r", "--peers", "2", "--nproc-per-peer", "2", "--max-restarts", "1",
        script=("--checkpoint-dir", str(ck), "--exit-at", "5", "--steps", "8"),
    )  # fmt: skip
    assert code == 0, logs
    events = [json.loads(line) for line in (tmp_path / "r" / "events.jsonl").open()]
    restart = [k for k, e in enumerate(events) if e["kind"] == "restart"]
    assert len(restart) == 1, logs
    restored = events[restart[0]]["checkpoint_revision"]
    epochs = [e for e in events[restart[0] :] if e["kind"] == "epoch"]
    assert [e["world"] for e in epochs] == [2], epochs  # restarted together, never apart
    recs = {f.stem: torch.load(f, weights_only=False) for f in sorted(out.glob("*.pt"))}
    assert sorted(recs) == ["0.0", "0.1", "1.0", "1.1"], logs
    for r in recs.values():
        assert r["resumed_from"] == restored == r["start"]["revision"] and r["revision"] > restored
    assert len({r["revision"] for r in recs.values()}) == 1
    assert len({r["digest"] for r in recs.values()}) == 1
    assert {int(r["full"]["meta/step"]) for r in recs.values()} == {8}
