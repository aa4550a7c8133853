"""Checkpoints in one process (isthmus.checkpoint): parts, manifests, verification, fall-back,
export, staging buffers and background copies. Peers are simulated by fake sessions sharing one
coordinator book; the files are real (a tmp directory, and fsspec's in-memory file system)."""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from isthmus.checkpoint import (
    Checkpointer,
    CheckpointMismatch,
    CheckpointStore,
    Manifest,
    NoCheckpoint,
    StorageError,
    assign_parts,
    export,
    inspect,
    load_latest,
)
from isthmus.checkpoint.staging import Staging
from isthmus.comm.state import SharedState
from isthmus.coordinator.checkpoints import CheckpointBook, PartReport


def test_parts_are_disjoint_balanced_and_the_same_everywhere() -> None:
    sizes = {"a": 400, "b": 100, "c": 300, "d": 200, "e": 100}
    parts = assign_parts(sizes, 2)
    assert sorted(n for p in parts for n in p) == sorted(sizes)
    loads = sorted(sum(sizes[n] for n in p) for p in parts)
    assert loads == [500, 600]  # 1100 bytes cannot split closer with these sizes
    assert parts == assign_parts(dict(sizes), 2)  # every peer computes the same split
    assert all(p == sorted(p, key=list(sizes).index) for p in parts)  # schema order inside
    assert assign_parts(sizes, 1) == [list(sizes)]
    assert assign_parts({"a": 1}, 3) == [["a"], [], []]
    with pytest.raises(ValueError):
        assign_parts(sizes, 0)


def test_the_book_asks_exactly_one_writer_for_the_manifest() -> None:
    book = CheckpointBook("x")
    r0 = book.part(PartReport(4, 0, 2, True, {"a": "1"}, 10, "peer0", "peer0"), 1.0)
    assert r0 == {"complete": False, "write_manifest": False}
    r1 = book.part(PartReport(4, 1, 2, True, {"b": "2"}, 20, "peer1", "peer1"), 2.0)
    assert r1["write_manifest"] and r1["hashes"] == {"a": "1", "b": "2"}
    assert r1["writers"] == {"0": "peer0", "1": "peer1"} and r1["local"] == ["peer0", "peer1"]
    assert book.latest is None  # not complete until the manifest is written
    book.manifest(4, "/ck/rev-00000004/manifest.json", 3.0)
    assert book.status()["latest"]["revision"] == 4 and book.written == 1
    # a failed part: that checkpoint never completes
    book.part(PartReport(6, 0, 2, False, error="disk full"), 4.0)
    assert not book.part(PartReport(6, 1, 2, True, {"a": "x"}), 5.0)["complete"]
    assert book.failures == 1 and book.latest["revision"] == 4


class FakeSession:
    """What the checkpointer needs of a session, with the coordinator's book in-process."""

    def __init__(
        self, book: CheckpointBook, lock: threading.Lock, name: str, rank: int, world: int
    ) -> None:
        self.book, self.lock = book, lock
        self.state = SharedState()
        self.revision = 0
        self.rank, self.world, self.name = rank, world, name
        self.run_id = "run1"

    def report_checkpoint(self, body: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            if "manifest" in body:
                self.book.manifest(body["revision"], body["manifest"], 0.0)
                return {"ok": True}
            r = PartReport(
                body["revision"], body["part"], body["parts"], body["ok"], body.get("hashes", {}),
                body.get("bytes", 0), body.get("writer", ""), body.get("local", ""), body.get("error", ""),
            )  # fmt: skip
            return self.book.part(r, 0.0)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "global/w": torch.randn(64, 32, generator=g),
        "global/b": torch.randn(32, generator=g).to(torch.bfloat16),
        "outer/0/momentum_buffer": torch.randn(64, 32, generator=g),
        "meta/step": torch.tensor(7, dtype=torch.int64),
    }


def _peers(url: str, world: int, tensors: dict[str, torch.Tensor], **kw: Any) -> list[Checkpointer]:
    book, lock = CheckpointBook(url), threading.Lock()
    out = []
    for rank in range(world):
        s = FakeSession(book, lock, f"peer{rank}", rank, world)
        for n, t in tensors.items():
            s.state.register(n, t.clone())
        moments = {"inner": {"exp_avg": torch.full((3,), float(rank))}, "note": f"slot {rank}"}
        out.append(
            Checkpointer(
                s,
                url,
                every=2,
                keep=2,
                local_state=lambda m=moments: m,
                model_keys={"w": "global/w", "w_tied": "global/w", "b": "global/b"},
                **kw,
            )  # type: ignore[misc]
        )
    return out


def _save_all(cks: list[Checkpointer], revision: int) -> None:
    for c in cks:
        c.session.revision = revision  # type: ignore[attr-defined]
        assert c.maybe_save()
    for c in cks:
        c.wait(30)


def test_three_writers_one_checkpoint_resumed_by_any_number(tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    tensors = _state(0)
    cks = _peers(url, 3, tensors)
    _save_all(cks, 2)
    assert sum(c.manifests for c in cks) == 1 and all(c.written == 1 for c in cks)
    store = CheckpointStore(url)
    assert store.revisions() == [2]
    m = Manifest.from_bytes(store.read(store.path("rev-00000002", "manifest.json")))
    assert m.revision == 2 and sorted(n for p in m.parts for n in p) == sorted(tensors)
    assert m.local == ["peer0", "peer1", "peer2"] and m.run_id == "run1"
    # each peer wrote about a third: no part holds everything
    assert all(len(p) < len(tensors) for p in m.parts)
    # resume into a fresh state (other values), as one peer of a smaller or larger run
    fresh = SharedState()
    for n, t in _state(1).items():
        fresh.register(n, t.clone())
    template = {"inner": {"exp_avg": torch.zeros(3)}, "note": ""}
    m2, local = load_latest(url, fresh, slot="peer1", local_template=template)
    assert m2.revision == 2
    for n, t in tensors.items():
        assert torch.equal(fresh[n], t), n
    assert local is not None and torch.equal(local["inner"]["exp_avg"], torch.full((3,), 1.0))
    assert local["note"] == "slot 1"
    # a slot the checkpoint does not know starts afresh
    assert load_latest(url, fresh, slot="peer7", local_template=template)[1] is None


def test_keep_prunes_and_an_unfinished_checkpoint_is_never_listed(tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    cks = _peers(url, 2, _state(0))
    for rev in (2, 4, 6):
        _save_all(cks, rev)
    store = CheckpointStore(url)
    assert store.revisions() == [4, 6]  # keep=2
    # a writer that died mid-save: its part exists, the manifest never does
    cks[0].session.revision = 8  # type: ignore[attr-defined]
    cks[0].maybe_save()
    cks[0].wait(30)
    assert store.incomplete() == [8] and store.revisions() == [4, 6]
    fresh = SharedState()
    for n, t in _state(3).items():
        fresh.register(n, t.clone())
    assert load_latest(url, fresh)[0].revision == 6


def test_a_revision_written_again_is_unlisted_until_its_new_manifest(tmp_path: Path) -> None:
    # every peer died after writing revision 4 unreported; the run restarted from 2 and now
    # writes 4 again with other values: until all its new parts are in, 4 is not a checkpoint
    url = str(tmp_path / "ck")
    for rev in (2, 4):
        _save_all(_peers(url, 2, _state(0)), rev)
    store = CheckpointStore(url)
    assert store.revisions() == [2, 4]
    again = _state(5)
    cks = _peers(url, 2, again)
    cks[0].session.revision = 4  # type: ignore[attr-defined]
    assert cks[0].maybe_save()
    cks[0].wait(30)  # one new part written, the other writer not yet
    assert store.revisions() == [2] and store.incomplete() == [4]
    fresh = SharedState()
    for n, t in _state(3).items():
        fresh.register(n, t.clone())
    assert load_latest(url, fresh)[0].revision == 2  # never old and new parts as one
    cks[1].session.revision = 4  # type: ignore[attr-defined]
    assert cks[1].maybe_save()
    cks[1].wait(30)
    assert store.revisions() == [2, 4]
    assert load_latest(url, fresh)[0].revision == 4
    for n, t in again.items():
        assert torch.equal(fresh[n], t), n


def test_a_corrupted_part_falls_back_and_another_model_is_refused(tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    tensors = _state(0)
    cks = _peers(url, 2, tensors)
    _save_all(cks, 2)
    for c in cks:
        c.session.state["meta/step"].fill_(9)  # type: ignore[attr-defined]
    _save_all(cks, 4)
    # flip bytes in the middle of every data file of revision 4's parts
    for f in (tmp_path / "ck" / "rev-00000004").glob("shared-*/*.distcp"):
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    fresh = SharedState()
    for n, t in _state(5).items():
        fresh.register(n, t.clone())
    m, _ = load_latest(url, fresh)
    assert m.revision == 2 and int(fresh["meta/step"]) == 7  # the previous one, verified
    report = inspect(url, revision=4)
    verdict = report["verified"]
    assert isinstance(verdict, str) and ("does not match" in verdict or "cannot be read" in verdict)
    other = SharedState()
    for n, t in _state(0).items():
        other.register(n, t.clone() if n != "global/w" else torch.zeros(64, 16))
    with pytest.raises(
        CheckpointMismatch,
        match=r"'global/w' is \[64, 32\] torch.float32 in the checkpoint but \[64, 16\]",
    ):
        load_latest(url, other)
    with pytest.raises(StorageError, match="no checkpoint directory"):
        load_latest(str(tmp_path / "nowhere"), fresh)
    (tmp_path / "empty").mkdir()
    with pytest.raises(NoCheckpoint):
        load_latest(str(tmp_path / "empty"), fresh)


def test_export_is_a_plain_state_dict_and_fsspec_memory_works(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    url = f"memory://isthmus-test-{uuid.uuid4().hex}/ck"
    tensors = _state(0)
    cks = _peers(url, 2, tensors)
    _save_all(cks, 2)
    info = inspect(url)
    assert info["verified"] is True and info["revision"] == 2 and info["tensors"] == 4
    out = export(url, tmp_path / "model.safetensors")
    loaded = load_file(str(out["path"]))
    assert set(loaded) == {"w", "w_tied", "b"}
    assert torch.equal(loaded["w"], tensors["global/w"]) and torch.equal(
        loaded["w_tied"], tensors["global/w"]
    )
    assert loaded["b"].dtype == torch.bfloat16 and torch.equal(loaded["b"], tensors["global/b"])
    assert json.loads(json.dumps(info["manifest"]))["revision"] == 2


# -- staging buffers, and shared tensors copied on the writer thread ---------------------------


def test_staging_reuses_its_buffers_and_copies_the_values_of_the_moment() -> None:
    st = Staging()
    w, m = torch.arange(6.0).view(2, 3), torch.ones(4)
    first = st.copy({"model": {"w": w}, "opt": [m, 3], "note": "n"})
    held = first["model"]["w"]
    assert torch.equal(held, w) and held.data_ptr() != w.data_ptr()
    assert first["opt"][1] == 3 and first["note"] == "n" and isinstance(first["opt"], list)
    allocated = st.allocated
    w.add_(1)
    m.mul_(2)
    second = st.copy({"model": {"w": w}, "opt": [m, 3], "note": "n"})
    assert second["model"]["w"] is held and st.allocated == allocated  # the same buffer again
    assert torch.equal(held, w) and torch.equal(second["opt"][0], m)
    # a new shape gets a new buffer; a tensor that is gone lets its buffer go
    third = st.copy({"model": {"w": torch.zeros(3, 3)}})
    assert third["model"]["w"].shape == (3, 3) and st.allocated > allocated
    assert len(st._buffers) == 1
    # a strided view is cloned as it is, never staged through a buffer of another layout
    v = torch.arange(12.0).view(3, 4).t()
    assert torch.equal(st.copy({"v": v})["v"], v)


def _one_peer(url: str, background: set[str]) -> tuple[Checkpointer, FakeSession]:
    s = FakeSession(CheckpointBook(url), threading.Lock(), "peer0", 0, 1)
    s.state.register("global/w", torch.zeros(256, 256))
    s.state.register("sampler/drawn", torch.zeros(1, dtype=torch.int64))
    local = {"inner": {"exp_avg": torch.zeros(64)}}
    ck = Checkpointer(
        s, url, every=1, keep=3, local_state=lambda: local, background_shared=background
    )
    return ck, s


def _saved(url: str, revision: int) -> dict[str, torch.Tensor]:
    fresh = SharedState()
    fresh.register("global/w", torch.full((256, 256), -1.0))
    fresh.register("sampler/drawn", torch.full((1,), -1, dtype=torch.int64))
    m, _ = load_latest(url, fresh, upto=revision)
    assert m.revision == revision
    return {n: t.clone() for n, t in fresh.items()}


def test_a_named_shared_tensor_is_copied_in_the_background_and_settled_before_a_write(
    tmp_path: Path,
) -> None:
    url = str(tmp_path / "ck")
    ck, s = _one_peer(url, {"global/w"})
    for revision in (1, 2, 3):
        s.revision = revision
        s.state["global/w"].fill_(float(revision))
        s.state["sampler/drawn"].fill_(10 * revision)
        assert ck.maybe_save()
        # training goes on at once: the sampler moves (it is copied on this thread, so the
        # checkpoint keeps the value of the save), then a round would write the shared state,
        # once the strategy has settled the copy
        s.state["sampler/drawn"].add_(1)
        ck.settle()
        s.state["global/w"].fill_(-7.0)
        ck.wait(30)
        saved = _saved(url, revision)
        assert torch.equal(saved["global/w"], torch.full((256, 256), float(revision)))
        assert int(saved["sampler/drawn"]) == 10 * revision
    assert ck.failures == 0 and ck.written == 3


def test_local_tensors_picked_are_copied_in_the_background_and_settled_before_a_step(
    tmp_path: Path,
) -> None:
    url = str(tmp_path / "ck")
    s = FakeSession(CheckpointBook(url), threading.Lock(), "peer0", 0, 1)
    s.state.register("global/w", torch.zeros(8))
    live = {
        "optimizer": {"m": torch.zeros(128, 128)},
        "model": {"w": torch.zeros(64), "buf": torch.zeros(4)},
    }

    def picked(path: tuple) -> bool:  # what an optimizer's step writes; not the buffer
        return path[0] == "optimizer" or path == ("model", "w")

    ck = Checkpointer(s, url, every=1, keep=3, local_state=lambda: live, background_local=picked)
    template = {
        "optimizer": {"m": torch.zeros(128, 128)},
        "model": {"w": torch.zeros(64), "buf": torch.zeros(4)},
    }
    for revision in (1, 2):
        s.revision = revision
        for t in (live["optimizer"]["m"], live["model"]["w"], live["model"]["buf"]):
            t.fill_(float(revision))
        assert ck.maybe_save()
        live["model"]["buf"].fill_(-1.0)  # a forward pass: the buffer was copied on this thread
        ck.settle()  # the optimizer's step pre-hook
        live["optimizer"]["m"].fill_(-1.0)
        live["model"]["w"].fill_(-1.0)
        ck.wait(30)
        fresh = SharedState()
        fresh.register("global/w", torch.zeros(8))
        _, local = load_latest(url, fresh, upto=revision, slot="peer0", local_template=template)
        assert local is not None
        assert torch.equal(local["optimizer"]["m"], torch.full((128, 128), float(revision)))
        assert torch.equal(local["model"]["w"], torch.full((64,), float(revision)))
        assert torch.equal(local["model"]["buf"], torch.full((4,), float(revision)))
    assert ck.failures == 0


def _hanging_writer(ck: Checkpointer, chunks: int, release: threading.Event) -> list[int]:
    """Make ``ck``'s store write a part in ``chunks`` appends (a few ms apart), then hang until
    ``release``; returns the count of chunks written so far (one item, updated)."""
    written = [0]
    store = ck.store

    def save(state: dict[str, Any], *parts: str) -> None:
        path = store.path(*parts)
        store.fs.makedirs(path, exist_ok=True)
        for _ in range(chunks):
            with store.fs.open(f"{path}/data", "ab") as f:
                f.write(b"x" * 4096)
            written[0] += 1
            release.wait(0.02)
        release.wait(60)

    store.save = save  # type: ignore[method-assign]
    return written


def test_the_final_wait_lasts_while_the_write_progresses_and_ends_once_it_stops(
    tmp_path: Path,
) -> None:
    (ck,) = _peers(str(tmp_path / "ck"), 1, _state(0))
    release = threading.Event()
    written = _hanging_writer(ck, 100, release)
    ck.session.revision = 2  # type: ignore[attr-defined]
    assert ck.maybe_save()
    # the write adds bytes for longer than idle_s, then hangs: waited through, then given up
    assert not ck.wait_progressing(idle_s=1.0, limit_s=600.0, poll_s=0.05)
    assert written[0] == 100
    release.set()  # the store answers again: the write completes, and a wait sees it end
    assert ck.wait_progressing(idle_s=1.0, limit_s=600.0, poll_s=0.05)
    assert ck.store.revisions() == [2]
    assert ck.wait_progressing(idle_s=1.0, limit_s=600.0)  # no write running


def test_a_store_that_shows_no_bytes_before_a_file_completes_gets_its_size_bound() -> None:
    (ck,) = _peers(f"memory://isthmus-ck-{uuid.uuid4().hex}", 1, _state(0))
    release = threading.Event()
    _hanging_writer(ck, 0, release)  # no bytes show until the write completes: the mark stays
    ck.session.revision = 2  # type: ignore[attr-defined]
    assert ck.maybe_save()
    # idle_s alone would give up long before the write ends; the size bound waits it out
    threading.Timer(0.5, release.set).start()
    assert ck.wait_progressing(idle_s=0.1, limit_s=600.0, unseen_min_s=60.0, poll_s=0.05)
    assert ck.store.revisions() == [2]
    # a write that never completes is given up once that bound passed
    release.clear()
    ck.session.revision = 4  # type: ignore[attr-defined]
    assert ck.maybe_save()
    assert not ck.wait_progressing(idle_s=0.1, limit_s=600.0, unseen_min_s=0.5, poll_s=0.05)
    assert ck.store.revisions() == [2]
    release.set()
    ck.wait(30)
