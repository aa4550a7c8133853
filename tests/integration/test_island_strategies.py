"""SparseLoCo, DeMo and ZO on islands (`isthmus run --nproc-per-peer 2,1` or `2`, FSDP2 on
Gloo inside), against two unsharded peers computed in this process (threads over in-process
Gloo groups, stand-in sessions whose rounds commit).

Each rank of an island draws its island's batch, so an island's mean gradient, loss and buffers
are exactly one unsharded peer's on that batch. The whole-tensor messages (SparseLoCo's chunked
top-k with its quantizer over a chunk grid that the shards' bounds cut, DeMo's DCT tile that
the shards' rows cut in two, ZO's perturbations drawn over whole tensors) are then the unsharded
peers' bytes, and every rank of both islands ends with the unsharded peers' full state bit for
bit. One run checks: every rank of every island holds the same full state and island digest;
that state equals the unsharded peers', every tensor to the bit; the model trained; the
message has the unsharded size; it crosses islands cut across the ranks of islands of one
size, through the leaders between islands of different sizes.

Slow (``make test-slow``): a follower of an island killed while its part of the exchange is in
flight (both islands abort, the island restarts and rejoins, every rank ends on one state); a
SparseLoCo checkpoint of 2 x 2 islands resumed on islands of 2 ranks and 1.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import isthmus
from isthmus.testing import local_groups, run_parallel
from support.cli import run_cli
from support.sessions import CommittedRound, Rounds

pytestmark = pytest.mark.usefixtures("one_thread")  # the peers' processes run one thread too

SCRIPT = Path(__file__).resolve().parent / "scripts" / "island_strategy_peer.py"
STEPS = 4


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("island_strategy_peer", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class PipelinedRounds(Rounds):
    """:class:`Rounds` with the begin/commit pair the round pipeline (SparseLoCo) uses."""

    def begin(self) -> CommittedRound:
        rnd = CommittedRound(self.group, self.revision)

        def commit(ok: bool = True, error: str = "") -> bool:
            assert ok, error
            self.revision += 1
            for hook in self.hooks:
                hook(rnd.plan)
            return True

        rnd.commit = commit  # type: ignore[attr-defined]
        return rnd


def _unsharded(name: str) -> tuple[dict[str, torch.Tensor], int]:
    """The shared state two unsharded peers end with, peer ``p`` training on batches ``p``,
    and the size of their message."""
    script = _script()
    groups = local_groups(2)
    models = []
    for _ in groups:  # built here, one after the other: one global RNG
        torch.manual_seed(0)
        models.append(script.Net())

    def peer(g: Any) -> tuple[dict[str, torch.Tensor], int]:
        model = models[g.rank]
        session = PipelinedRounds(g)
        opt = script.optimizer(model)
        strategy = isthmus.make_strategy(name, session, model, opt, **script.OPTIONS[name])
        script.train(strategy, model, opt, name, g.rank, STEPS)
        return session.state.snapshot(), strategy.payload_bytes

    (state, size), (other, _) = run_parallel(groups, peer)
    for n, t in other.items():
        assert torch.equal(t, state[n]), n
    return state, size


def _islands(
    tmp: Path, name: str, sizes: str, *extra: str, steps: int = STEPS
) -> dict[str, dict[str, Any]]:
    out, run_dir = tmp / "out", tmp / "run"
    out.mkdir(parents=True)
    code, said = run_cli(
        "run", "--no-progress", "--quiet",
        "--run-dir", str(run_dir), "--peers", "2", "--nproc-per-peer", sizes, str(SCRIPT),
        "--out", str(out), "--strategy", name, "--steps", str(steps), *extra,
    )  # fmt: skip
    logs = "".join(f.read_text() for f in sorted(run_dir.glob("peer*.log")))
    assert code == 0, said + logs
    return {f.stem: torch.load(f, weights_only=False) for f in sorted(out.glob("*.pt"))}


# islands of one size exchange the message cut across their ranks, of different sizes through
# their leaders: DeMo runs the first way, SparseLoCo and ZO the second
@pytest.mark.parametrize(
    ("name", "sizes"),
    [
        ("sparseloco", "2,1"),
        # make test's budget: DeMo's and ZO's shard windows are checked bit for bit in one
        # process (test_shard_windows); their runs on islands go with make test-slow
        pytest.param("decoupled_momentum", "2", marks=pytest.mark.slow),
        pytest.param("zo", "2,1", marks=pytest.mark.slow),
    ],
)
def test_whole_tensor_strategies_on_islands_have_the_unsharded_bits(
    tmp_path: Path, name: str, sizes: str
) -> None:
    recs = _islands(tmp_path, name, sizes)
    assert sorted(recs) == ["0.0", "0.1", "1.0"] + (["1.1"] if sizes == "2" else [])
    assert len({r["full_digest"] for r in recs.values()}) == 1
    assert len({r["digest"] for r in recs.values()}) == 1
    ref, size = _unsharded(name)
    full = recs["0.0"]["full"]
    assert sorted(full) == sorted(ref)
    for n, t in ref.items():
        assert full[n].shape == t.shape, n
        assert torch.equal(full[n], t), f"{n}: {(full[n].double() - t.double()).abs().max()}"
    prefix = "global" if name == "sparseloco" else "model"
    for key in ("a.weight", "b.weight", "norm.weight"):  # it trained: equality means something
        assert not torch.equal(full[f"{prefix}/{key}"], recs["0.0"]["init"][key]), key
    assert all(r["step"] == STEPS for r in recs.values())
    key = "zo_payload_bytes" if name == "zo" else "payload_bytes"
    # the whole tensors' message, whatever the island's size
    assert {r["metrics"][key] for r in recs.values()} == {size}
    sent = recs["0.1"]["island_bytes"]
    assert sent == recs["0.0"]["island_bytes"] and sent[0] > 0
    if sizes == "2":  # every rank sent its part of the island's message
        assert sent[1] > 0
    else:  # the leader sent the whole message
        assert sent[1] == 0 and recs["1.0"]["bytes"] > 0


# the failure of an island is covered for every strategy by test_islands (DiLoCo); this adds
# the exchange of a whole-tensor message aborted on both islands
@pytest.mark.slow
def test_sparseloco_island_with_a_rank_killed_in_the_exchange_rejoins(tmp_path: Path) -> None:
    """Rank 1 of island 1 SIGKILLs itself while its part of the island's message is being
    all-gathered across islands: its island leaves, rank 1 of the other island sees its part
    fail and its island agrees to abort, the round is retried by that island alone, island 1
    restarts, rejoins, and every rank ends on one state."""
    out, run_dir = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    code, said = run_cli(
        "run", "--no-progress", "--quiet",
        "--run-dir", str(run_dir), "--summary-json", str(tmp_path / "s.json"), "--peers", "2",
        "--nproc-per-peer", "2", "--max-restarts", "1", str(SCRIPT), "--out", str(out),
        "--strategy", "sparseloco", "--steps", "16", "--delay", "0.3",
        "--fault", "kill@collective:step=5", "--fault-rank", "peer1.1",
    )  # fmt: skip
    logs = "".join(f.read_text() for f in sorted(run_dir.glob("peer*.log")))
    assert code == 0, said + logs
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["restarts"] == 1 and summary["rounds_aborted"] >= 1, summary
    assert summary["peers_final"] == 2 and summary["parity_failures"] == 0, summary
    recs = {f.stem: torch.load(f, weights_only=False) for f in sorted(out.glob("*.pt"))}
    assert sorted(recs) == ["0.0", "0.1", "1.0", "1.1"]
    assert len({r["full_digest"] for r in recs.values()}) == 1
    assert len({r["digest"] for r in recs.values()}) == 1
    assert all(r["step"] == 16 for r in recs.values())


@pytest.mark.slow
def test_a_sparseloco_island_checkpoint_resumes_on_islands_of_other_sizes(tmp_path: Path) -> None:
    """2 islands x 2 ranks write a checkpoint every round (each rank its shards, its own
    accumulators as local state); 2 islands of 2 ranks and 1 resume from it (the shared state
    by layout, the accumulators afresh on the shapes that changed) and train on to one state."""
    ck = tmp_path / "ck"
    first = _islands(tmp_path / "a", "sparseloco", "2", "--checkpoint-dir", str(ck), steps=8)
    assert len({r["full_digest"] for r in first.values()}) == 1
    revision = first["0.0"]["revision"]
    later = _islands(tmp_path / "b", "sparseloco", "2,1", "--resume", str(ck), steps=12)
    assert sorted(later) == ["0.0", "0.1", "1.0"]
    assert {r["resumed_from"] for r in later.values()} == {revision}
    assert len({r["full_digest"] for r in later.values()}) == 1
    assert len({r["digest"] for r in later.values()}) == 1
    assert all(r["step"] == 12 and r["revision"] > revision for r in later.values())
