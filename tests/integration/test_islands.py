"""Islands through `isthmus run --nproc-per-peer 2`: peers of two local ranks each (FSDP2 on
Gloo inside, one membership slot each), exchanging their shards across islands in parallel.

* DiLoCo on 2 islands x 2 ranks, one rank SIGKILLed inside a cross-island collective: its island
  leaves and rejoins as a whole, resynced shard by shard; every rank of both islands ends with
  the same full gathered state (parameters, buffers, outer optimizer state, counter) and the same
  island digest; each rank sent its own bytes; strategies that cannot run on islands refused,
  naming why.
* DDP across 2 islands x 2 ranks (HSDP) equals 4 single-rank peers with the same global batch,
  to fp32 rounding; across islands of 2 ranks and 1, it equals 2 single peers each drawing one
  island's batches, to fp32 rounding.
* DDP with a fixed global batch on islands of 2 ranks and 1 (the island's share split among its
  ranks, padding passes) equals one process training on the whole batch, to fp32 rounding.
* Streaming DiLoCo with int8 outer gradients on islands of 2 ranks and 1: identical full states.
* DiLoCo with a time budget on islands of 2 ranks and 1: phases end on the leaders' clocks,
  every rank of an island at the same step; identical full states.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import isthmus
from support.cli import run_cli

SCRIPT = Path(__file__).resolve().parent / "scripts" / "island_peer.py"


def _run(
    tmp: Path, name: str, *args: str, strategy: str = "diloco", extra: tuple[str, ...] = ()
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """One `isthmus run` of the island script with ``args`` for the launcher; returns its
    summary and every rank's record (by "peer.rank")."""
    out = tmp / f"{name}-out"
    out.mkdir()
    run_dir = tmp / name
    # a 10 s heartbeat bound (the island's ranks watch each other with it): under make
    # test's load a live rank was silent 3 s and its island left a run that tests results
    code, said = run_cli(
        "run", "--no-progress", "--quiet", "--heartbeat-timeout", "10",
        "--run-dir", str(run_dir), "--summary-json", str(run_dir / "s.json"), *args,
        str(SCRIPT), "--out", str(out), "--strategy", strategy, *extra,
    )  # fmt: skip
    logs = "".join(f.read_text() for f in sorted(run_dir.glob("peer*.log")))
    assert code == 0, said + logs
    records = {f.stem: torch.load(f, weights_only=False) for f in sorted(out.glob("*.pt"))}
    return json.loads((run_dir / "s.json").read_text()), records


def test_diloco_on_two_islands_of_two_ranks_one_killed_and_rejoining(tmp_path: Path) -> None:
    """Rank 1 of island 1 SIGKILLs itself inside the cross-island collective of step 4: its
    island leaves as a whole (the agent stops its other rank), island 0 commits the retried
    round alone, the launcher starts island 1 again, which rejoins, is resynced shard by shard
    (verified by the island's hashes) and trains on; every rank ends on the same state."""
    summary, recs = _run(
        tmp_path, "diloco", "--peers", "2", "--nproc-per-peer", "2", "--max-restarts", "1",
        extra=("--steps", "20", "--delay", "0.3", "--fault", "kill@collective:step=4"),
    )  # fmt: skip
    assert sorted(recs) == ["0.0", "0.1", "1.0", "1.1"]
    assert summary["restarts"] == 1 and summary["exit_codes"]["peer1.1"] == 0, summary
    assert summary["rounds_aborted"] >= 1 and summary["peers_final"] == 2, summary
    events = [json.loads(line) for line in (tmp_path / "diloco" / "events.jsonl").open()]
    resyncs = [e for e in events if e["kind"] == "resync"]
    assert resyncs and all(t["dst"] == 2 for e in resyncs for t in e["transfers"]), resyncs
    assert any(e["kind"] == "commit" and e["world"] == 1 for e in events)  # island 0 alone
    full = {r["full_digest"] for r in recs.values()}
    assert len(full) == 1, full  # every rank of both islands: the same full gathered state
    assert len({r["digest"] for r in recs.values()}) == 1
    state = recs["0.0"]["full"]
    assert state["global/a.weight"].shape == (10, 6)  # full shapes, assembled from shards
    assert {"outer/0/momentum_buffer", "global/seen", "meta/step"} <= set(state)
    assert state["outer/0/momentum_buffer"].abs().sum() > 0  # outer steps happened
    for key, r in recs.items():
        assert r["revision"] == recs["0.0"]["revision"] and r["step"] >= 20
        # traffic by shard: each rank sent its own part, the island counts them all
        rank = int(key.split(".")[1])
        assert r["bytes"] > 0 and r["island_bytes"][rank] == r["bytes"], r
        assert "gossip cannot run on islands" in r["refusals"]["gossip"]
        assert "needs whole tensors" in r["refusals"]["compressed"]
    # rank 0 of an island also carries the replicated tensors (buffers, counter): more bytes
    assert recs["0.0"]["bytes"] > recs["0.1"]["bytes"]


def test_island_with_a_sigstopped_rank_leaves_and_is_replaced(tmp_path: Path) -> None:
    """Rank 1 of island 1 SIGSTOPs itself inside a cross-island collective: its leader finds it
    silent for the heartbeat timeout and ends itself, so the agent ends the island (the stopped
    rank included) and the launcher starts it again; island 0 commits the retried round alone,
    and every rank ends on the same state."""
    summary, recs = _run(
        tmp_path, "stopped", "--peers", "2", "--nproc-per-peer", "2", "--max-restarts", "1",
        extra=("--steps", "20", "--delay", "0.3", "--fault", "stop@collective:step=4"),
    )  # fmt: skip
    assert sorted(recs) == ["0.0", "0.1", "1.0", "1.1"]
    assert summary["restarts"] == 1 and summary["peers_final"] == 2, summary
    events = [json.loads(line) for line in (tmp_path / "stopped" / "events.jsonl").open()]
    assert any(e["kind"] == "commit" and e["world"] == 1 for e in events)  # island 0 alone
    assert any(e["kind"] == "resync" for e in events)  # the new island 1 was resynced
    logs = (tmp_path / "stopped" / "peer1.log").read_text()
    assert "rank(s) [1] of the island silent" in logs, logs[-2000:]
    assert len({r["full_digest"] for r in recs.values()}) == 1
    assert len({r["digest"] for r in recs.values()}) == 1


def test_ddp_across_islands_equals_four_single_peers(tmp_path: Path) -> None:
    _, islands = _run(tmp_path, "hsdp", "--peers", "2", "--nproc-per-peer", "2", strategy="ddp")
    _, singles = _run(tmp_path, "single", "--peers", "4", strategy="ddp")
    assert len({r["full_digest"] for r in islands.values()}) == 1
    a, b = islands["0.0"]["full"], singles["0.0"]["full"]
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].shape == b[name].shape, name
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)
    assert a["opt/0/momentum_buffer"].abs().sum() > 0  # it trained: the comparison means something
    assert islands["0.0"]["step"] == singles["0.0"]["step"] == 4


def test_diloco_on_islands_of_two_ranks_and_one(tmp_path: Path) -> None:
    """Islands sharded differently (2 ranks and 1) in one run: each rank of the island of 2
    exchanges its rows with the matching rows of the island of 1, which takes part in both
    exchanges; the islands' hashes (summed over the layout) agree at every parity check. The
    island of 1 is killed inside a collective, restarts and is resynced piece by piece from the
    two ranks of the other island (verified by hash); every rank ends with the same full state."""
    summary, recs = _run(
        tmp_path, "mixed", "--peers", "2", "--nproc-per-peer", "2,1", "--max-restarts", "1",
        extra=("--steps", "16", "--delay", "0.3", "--fault", "kill@collective:step=4",
               "--fault-rank", "peer1.0"),
    )  # fmt: skip
    assert sorted(recs) == ["0.0", "0.1", "1.0"]
    assert len({r["full_digest"] for r in recs.values()}) == 1
    assert len({r["digest"] for r in recs.values()}) == 1
    assert summary["parity_checks"] >= 3 and summary["parity_failures"] == 0, summary
    assert summary["restarts"] == 1 and summary["peers_final"] == 2, summary
    events = [json.loads(line) for line in (tmp_path / "mixed" / "events.jsonl").open()]
    resyncs = [e for e in events if e["kind"] == "resync"]
    assert resyncs and all(t["dst"] == 2 for e in resyncs for t in e["transfers"]), resyncs
    assert recs["1.0"]["full"]["outer/0/momentum_buffer"].abs().sum() > 0
    # each rank of the island of two sent its own part (the new island of one counts only the
    # rounds since its restart, so the sizes of the figures are not comparable here)
    assert min(recs["0.0"]["bytes"], recs["0.1"]["bytes"], recs["1.0"]["bytes"]) > 0


# islands of equal sizes against single peers run in make test; the by-piece reduction of
# unequal sizes is checked bit for bit in one process (test_island_reduce_gloo)
@pytest.mark.slow
def test_ddp_across_islands_of_two_ranks_and_one_equals_two_single_peers(tmp_path: Path) -> None:
    """HSDP between islands sharded differently: each rank reduces its rows of the gradient by
    piece with the matching rows of the other island. Every rank ends with the same full state,
    which equals that of 2 single peers where peer p draws the batches of island p's ranks (its
    gradient is theirs: the mean over the island's batches), to fp32 rounding (the island's
    gradient is averaged by FSDP2, a single peer's by its loss)."""
    summary, islands = _run(
        tmp_path, "hsdp21", "--peers", "2", "--nproc-per-peer", "2,1", strategy="ddp"
    )
    _, singles = _run(
        tmp_path, "single2", "--peers", "2", strategy="ddp", extra=("--island-sizes", "2,1")
    )
    assert sorted(islands) == ["0.0", "0.1", "1.0"]
    assert len({r["full_digest"] for r in islands.values()}) == 1
    assert summary["parity_failures"] == 0, summary
    a, b = islands["1.0"]["full"], singles["0.0"]["full"]
    assert sorted(a) == sorted(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)
    assert a["opt/0/momentum_buffer"].abs().sum() > 0
    assert islands["1.0"]["step"] == singles["0.0"]["step"] == 4


def test_streaming_with_int8_on_islands_of_two_ranks_and_one(tmp_path: Path) -> None:
    """Streaming DiLoCo (two fragments packed by the full tensors' sizes, one step of overlap)
    with int8 outer gradients on islands of 2 ranks and 1: every fragment round reduces its
    tensors' pieces across the islands, and every rank ends with the same full state, checked
    at every parity check on the way."""
    summary, recs = _run(
        tmp_path, "stream21", "--peers", "2", "--nproc-per-peer", "2,1", strategy="streaming",
        extra=("--steps", "8", "--compression", "int8"),
    )  # fmt: skip
    assert sorted(recs) == ["0.0", "0.1", "1.0"]
    assert len({r["full_digest"] for r in recs.values()}) == 1
    assert len({r["digest"] for r in recs.values()}) == 1
    assert summary["parity_checks"] >= 2 and summary["parity_failures"] == 0, summary
    state = recs["0.0"]["full"]
    assert state["outer/0/momentum_buffer"].shape == (10, 6)  # full shapes, by placement
    assert all(state[f"outer/{i}/momentum_buffer"].abs().sum() > 0 for i in range(6))
    assert recs["1.0"]["step"] >= 8


# the time budget runs on single peers in make test (test_elastic_runs); this adds its island
# broadcast
@pytest.mark.slow
def test_diloco_with_a_time_budget_on_islands_of_two_ranks_and_one(tmp_path: Path) -> None:
    """Phases end on the clock (0.5 s, steps of 0.2 s, at most 4 steps): each island's leader
    decides when its phase ends and its ranks follow, the leaders' step counts and rates make
    the round's table, and every rank ends on the same state and step."""
    summary, recs = _run(
        tmp_path, "timed21", "--peers", "2", "--nproc-per-peer", "2,1",
        extra=("--steps", "12", "--phase-seconds", "0.5", "--delay", "0.2"),
    )  # fmt: skip
    assert sorted(recs) == ["0.0", "0.1", "1.0"]
    assert len({r["full_digest"] for r in recs.values()}) == 1
    assert summary["parity_failures"] == 0, summary
    assert len({r["step"] for r in recs.values()}) == 1
    phases = [r["phase_steps"] for r in recs.values()]
    assert phases[0] == phases[1]  # the two ranks of island 0 ended every phase together
    assert any(n < 4 for p in phases for n in p), phases  # the clock, not H, ended some


def test_ddp_with_a_global_batch_on_islands_of_two_ranks_and_one(tmp_path: Path) -> None:
    """A fixed global batch of 10 (micro-batches of 2) on islands of 2 ranks and 1: each island
    takes 5 samples a step, split 3 and 2 on the island of two, whose second rank pads with a
    pass of no weight so that both run the same FSDP2 collectives. Every rank ends with the same
    full state, whose parameters and momentum are those of one process training on the 10
    samples a step, to fp32 rounding, and so is every step's loss."""
    summary, recs = _run(
        tmp_path, "gb21", "--peers", "2", "--nproc-per-peer", "2,1", strategy="ddp",
        extra=("--global-batch", "10", "--micro-batch", "2"),
    )  # fmt: skip
    assert sorted(recs) == ["0.0", "0.1", "1.0"]
    assert len({r["full_digest"] for r in recs.values()}) == 1
    assert len({r["digest"] for r in recs.values()}) == 1
    assert summary["parity_failures"] == 0, summary
    # equal passes on the island of two (2 a step: rank 1's one micro-batch and a padding pass)
    assert recs["0.0"]["calls"] == recs["0.1"]["calls"] == 8 and recs["1.0"]["calls"] == 12
    spec = importlib.util.spec_from_file_location("island_peer", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    torch.manual_seed(0)
    model = script.Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    one = isthmus.DDP(None, model, opt, isthmus.DDPConfig(global_batch=10))
    for _ in range(4):
        one.step(script.position_loss(model))
    full = recs["1.0"]["full"]
    for i, (name, p) in enumerate(model.named_parameters()):
        torch.testing.assert_close(full[f"model/{name}"], p.detach(), rtol=1e-5, atol=1e-6)
        momentum = opt.state[p]["momentum_buffer"]
        torch.testing.assert_close(full[f"opt/{i}/momentum_buffer"], momentum, rtol=1e-5, atol=1e-6)
    assert full["opt/0/momentum_buffer"].abs().sum() > 0
    assert all(r["loss"] == pytest.approx(one.last_loss, rel=1e-5) for r in recs.values())
