"""What a checkpoint costs the training thread, and what it must still guarantee: staging buffers
reused between saves (each save keeps its own values once training moved on), the cheap walk
(deferred tensors, plain values), the cached split into parts, the writer thread started with
the checkpointer, and the stall's split. Real files in a tmp directory; one fake peer."""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from isthmus.checkpoint import Checkpointer, load_latest
from isthmus.checkpoint.save import STALL_PARTS
from isthmus.checkpoint.staging import DeferredChanged, Staging
from isthmus.comm.state import SharedState
from isthmus.coordinator.checkpoints import CheckpointBook, PartReport


class _Peer:
    """The one member of its rounds: its part report completes every checkpoint."""

    def __init__(self, url: str) -> None:
        self.book = CheckpointBook(url)
        self.state = SharedState()
        self.revision, self.rank, self.world = 0, 0, 1
        self.name, self.run_id = "peer0", "run1"

    def report_checkpoint(self, body: dict[str, Any]) -> dict[str, Any]:
        if "manifest" in body:
            self.book.manifest(body["revision"], body["manifest"], 0.0)
            return {"ok": True}
        r = PartReport(
            body["revision"], body["part"], body["parts"], body["ok"], body.get("hashes", {}),
            body.get("bytes", 0), body.get("writer", ""), body.get("local", ""),
        )  # fmt: skip
        return self.book.part(r, 0.0)


def _local(fill: float) -> dict[str, Any]:
    """A DiLoCo-like local state (inner AdamW's state and param groups, the local model with a
    floating buffer, the RNG state and counters), every tensor holding ``fill``."""
    return {
        "rng": torch.full((16,), int(fill), dtype=torch.uint8),
        "progress": {"local_steps": int(fill)},
        "optimizer": {
            "state": {0: {"step": torch.tensor(fill), "exp_avg": torch.full((64, 64), fill)}},
            "param_groups": [{"lr": fill / 100, "betas": (0.9, 0.95), "params": [0]}],
        },
        "model": {"w": torch.full((64, 64), fill), "buf": torch.full((8,), fill)},
    }


def _stepped(path: tuple[Any, ...]) -> bool:  # what the inner optimizer's step() writes
    return path[0] == "optimizer" or path == ("model", "w")


def test_reused_buffers_keep_each_saves_values_once_training_moved_on(tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    peer = _Peer(url)
    theta = torch.zeros(32, 32)
    sampler = torch.zeros(1, dtype=torch.int64)
    peer.state.register("global/w", theta)  # only rounds write it: copied on the writer thread
    peer.state.register("sampler/drawn", sampler)  # every step moves it: copied at once
    live = _local(0.0)
    ck = Checkpointer(
        peer, url, every=1, keep=3, local_state=lambda: live,
        background_shared={"global/w"}, background_local=_stepped,
    )  # fmt: skip
    buffers: list[dict[tuple[Any, ...], int]] = []
    for revision in (1, 2, 3):
        v = float(revision)
        peer.revision = revision
        theta.fill_(v)
        sampler.fill_(10 * revision)
        live = _local(v)  # what the strategy's local_state returns at this step
        live["optimizer"]["param_groups"][0]["params"] = [0]
        assert ck.maybe_save()
        # training goes on at once: a forward pass writes the buffer, the sampler moves, a
        # scheduler changes the live param groups and the counters go on; only then (after
        # settle, as the optimizer's pre-hook and the round do) the step and the round write
        live["model"]["buf"].fill_(-1.0)
        sampler.add_(1)
        live["optimizer"]["param_groups"][0]["params"].append(99)
        live["progress"]["local_steps"] = -1
        ck.settle()
        live["optimizer"]["state"][0]["exp_avg"].fill_(-1.0)
        live["model"]["w"].fill_(-1.0)
        theta.fill_(-1.0)
        ck.wait(30)
        buffers.append({p: b.data_ptr() for p, b in ck._local_staging._buffers.items()})
    assert ck.failures == 0 and ck.written == 3
    # the later saves deferred the optimizer's state whole (the writer thread walked it)
    assert ("optimizer", "state") in ck._local_staging._whole
    # the same buffers served every save (nothing was allocated after the first)
    assert buffers[0] == buffers[1] == buffers[2]
    assert ("optimizer", "state", 0, "exp_avg") in buffers[0] and ("model", "buf") in buffers[0]
    # and yet every checkpoint holds its own step's values, every one of them
    for revision in (1, 2, 3):
        v = float(revision)
        fresh = SharedState()
        fresh.register("global/w", torch.zeros(32, 32))
        fresh.register("sampler/drawn", torch.zeros(1, dtype=torch.int64))
        m, local = load_latest(url, fresh, upto=revision, slot="peer0", local_template=_local(7))
        assert m.revision == revision and local is not None
        assert torch.equal(fresh["global/w"], torch.full((32, 32), v))
        assert int(fresh["sampler/drawn"]) == 10 * revision
        assert torch.equal(local["optimizer"]["state"][0]["exp_avg"], torch.full((64, 64), v))
        assert float(local["optimizer"]["state"][0]["step"]) == v
        assert torch.equal(local["model"]["w"], torch.full((64, 64), v))
        assert torch.equal(local["model"]["buf"], torch.full((8,), v))
        assert torch.equal(local["rng"], torch.full((16,), revision, dtype=torch.uint8))
        assert local["progress"]["local_steps"] == revision
        group = local["optimizer"]["param_groups"][0]
        assert group["params"] == [0] and math.isclose(group["lr"], v / 100)


def test_plain_values_are_kept_when_immutable_and_copied_when_not() -> None:
    st = Staging()
    name, betas, ids, nested = "slot 0", (0.9, 0.95), [1, 2, 3], {"seen": [1, [2]], "s": {4}}
    out = st.copy({"name": name, "betas": betas, "ids": ids, "nested": nested, "none": None})
    assert out["name"] is name and out["betas"] is betas and out["none"] is None
    ids.append(4)
    nested["seen"][1].append(3)
    nested["s"].add(5)
    assert out["ids"] == [1, 2, 3] and isinstance(out["ids"], list)
    assert out["nested"] == {"seen": [1, [2]], "s": {4}}


def test_deferred_tensors_are_copied_by_finish_views_and_autograd_leaves_too() -> None:
    st = Staging()
    p = torch.nn.Parameter(torch.ones(4))  # a trainable parameter, copied at once
    m = torch.zeros(4, 3)
    view = m.t()  # not contiguous: deferred all the same, and cloned by finish
    live = {"model": {"p": p}, "optimizer": {"m": m, "view": view}}
    out = st.copy(live, lambda path: path[0] == "optimizer")
    assert st.pending and out["optimizer"]["m"] is m  # only recorded so far
    assert not out["model"]["p"].requires_grad and out["model"]["p"].grad_fn is None
    m.fill_(2.0)  # what it holds when the writer thread copies it is what is saved
    st.finish()
    assert not st.pending
    held, held_view = out["optimizer"]["m"], out["optimizer"]["view"]
    assert held is not m and torch.equal(held, torch.full((4, 3), 2.0))
    assert held_view.data_ptr() != m.data_ptr() and torch.equal(held_view, view)
    m.fill_(3.0)  # training moves on: the staged copies keep the values of the save
    assert torch.equal(held, torch.full((4, 3), 2.0)) and torch.equal(held_view, held.t())
    # the next save reuses the buffer of the contiguous one, with the values of its moment
    second = st.copy(live, lambda path: path[0] == "optimizer")
    st.finish()
    assert second["optimizer"]["m"] is held and torch.equal(held, torch.full((4, 3), 3.0))


def test_the_split_into_parts_is_computed_again_only_when_it_changes(tmp_path: Path) -> None:
    peer = _Peer(str(tmp_path / "ck"))
    for n in ("a", "b", "c"):
        peer.state.register(n, torch.zeros(10 + ord(n)))
    ck = Checkpointer(peer, str(tmp_path / "ck"), every=1)
    _, first, names = ck._assignment()
    _, again, _ = ck._assignment()
    assert again is first and names == ["a", "b", "c"]
    peer.world, peer.rank = 2, 1  # another round's members: split again
    rank, two, mine = ck._assignment()
    assert (
        rank == 1
        and len(two) == 2
        and mine == two[1]
        and sorted(two[0] + two[1]) == ["a", "b", "c"]
    )
    peer.state.register("d", torch.zeros(1000))  # another tensor: split again
    _, three, _ = ck._assignment()
    assert sorted(three[0] + three[1]) == ["a", "b", "c", "d"]


def test_the_writer_thread_is_up_before_the_first_save_and_the_stall_is_split(
    tmp_path: Path,
) -> None:
    url = str(tmp_path / "ck")
    peer = _Peer(url)
    peer.state.register("global/w", torch.zeros(16))
    ck = Checkpointer(
        peer, url, every=1, local_state=lambda: _local(1.0), background_local=_stepped
    )
    assert ck._background.running
    assert any(t.name == "isthmus-checkpoint" for t in threading.enumerate())
    for revision in (1, 2):
        peer.revision = revision
        assert ck.maybe_save()
        ck.settle()
        ck.wait(30)
    assert ck.written == 2 and ck.failures == 0
    split = ck.metrics()["checkpoint_stall_split_s"]
    assert tuple(split) == STALL_PARTS and all(v >= 0 for v in split.values())
    assert sum(ck.stall_split.values()) == pytest.approx(ck.stall_s, abs=1e-9)
    assert ck.stall_split["local"] > 0 and ck.stall_split["hand_over"] > 0


def test_a_mapping_deferred_whole_that_changed_fails_that_save_and_is_walked_again(
    tmp_path: Path,
) -> None:
    st = Staging()
    live = {"opt": {"m": torch.zeros(3)}, "n": 1}
    deferred = {("opt", "m")}
    st.copy(live, lambda p: p in deferred)
    st.finish()  # "opt" held only deferred tensors: the next save defers it whole
    live["opt"]["x"] = torch.ones(2)  # something the deferral does not cover appears under it
    out = st.copy(live, lambda p: p in deferred)
    assert out["opt"] is live["opt"]  # recorded, not walked, on the training thread
    with pytest.raises(DeferredChanged, match="opt/x"):
        st.finish()
    out = st.copy(live, lambda p: p in deferred)  # walked again: x is copied at once
    assert out["opt"] is not live["opt"] and torch.equal(out["opt"]["x"], torch.ones(2))
    st.finish()
    assert torch.equal(out["opt"]["m"], torch.zeros(3))
    # through a checkpointer: that save counts as failed, the next one is written whole
    url = str(tmp_path / "ck")
    peer = _Peer(url)
    peer.state.register("global/w", torch.zeros(4))
    state = {"opt": {"m": torch.zeros(3)}}
    ck = Checkpointer(
        peer, url, every=1, local_state=lambda: state, background_local=lambda p: p in deferred
    )
    for revision in (1, 2, 3):
        peer.revision = revision
        if revision == 2:
            state["opt"]["plain"] = 5  # a plain value: not something to copy after the cut
        if revision == 3:
            del state["opt"]["plain"]
        assert ck.maybe_save()
        ck.settle()
        ck.wait(30)
    assert ck.failures == 1 and ck.written == 2 and ck.store.revisions() == [1, 3]


def test_dilocos_deferral_leaves_a_tensor_lr_to_the_training_thread() -> None:
    from isthmus.strategies import make_strategy

    model = torch.nn.Linear(4, 2)
    lr = torch.tensor(0.01)  # a tensor lr: a scheduler writes it in place, between steps
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    strategy = make_strategy("diloco", None, model, opt, sync_every=2)
    settled: list[int] = []
    stepped = strategy.step_written_local(lambda: settled.append(1))
    assert stepped(("optimizer", "state", 0, "exp_avg")) and stepped(("model", "weight"))
    assert not stepped(("optimizer", "param_groups", 0, "lr"))
    st = Staging()
    for _ in range(2):  # the second save defers the optimizer's state whole
        lr.fill_(0.01)
        out = st.copy(strategy.local_state(), stepped)
        lr.fill_(0.5)  # the scheduler's step, before the next optimizer step (and settle)
        st.finish()
        assert float(out["optimizer"]["param_groups"][0]["lr"]) == pytest.approx(0.01)
    opt.step()  # the step pre-hook settles first
    assert settled == [1]
