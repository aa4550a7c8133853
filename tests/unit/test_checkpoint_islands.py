"""Checkpoints of islands in one process (isthmus.checkpoint.shards, .island, .load): the pure
shard bookkeeping, then real DCP files written by 2 islands x 2 ranks (threads standing in for
the ranks, a fake island for their collectives, one coordinator book) and read back on islands
of 1 and 3 ranks and by a single peer, bit for bit; corruption and mismatches named."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from isthmus.checkpoint import CheckpointMismatch, CheckpointStore, NoCheckpoint, load_latest
from isthmus.checkpoint.island import IslandCheckpointer, local_tree, merge_local
from isthmus.checkpoint.load import CheckpointCorrupt, load_shared, read_manifest
from isthmus.checkpoint.manifest import ISLAND_FORMAT, Manifest
from isthmus.checkpoint.shards import (
    decode_reports,
    encode_shard,
    part_index,
    reads,
    whole_shards,
)
from isthmus.comm.island_state import IslandState
from isthmus.comm.layout import layout_hash, shard_placement
from isthmus.comm.state import SharedState
from isthmus.coordinator.checkpoints import CheckpointBook, PartReport

# -- pure bookkeeping ------------------------------------------------------------------------------


def test_parts_are_numbered_island_by_island() -> None:
    assert [part_index([2, 1, 3], k, i) for k, n in enumerate([2, 1, 3]) for i in range(n)] == [
        0,
        1,
        2,
        3,
        4,
        5,
    ]
    with pytest.raises(ValueError, match="not in islands"):
        part_index([2, 1], 1, 1)


def test_reports_decode_into_shards_and_summed_layout_hashes() -> None:
    full = torch.arange(12, dtype=torch.float32)
    hashes = dict(
        encode_shard(p, "w", a, b, "x", layout_hash(full[a:b], shard_placement((12,), 2, p)))
        for p, (a, b) in enumerate([(0, 6), (6, 12)])
    )
    shards, sums = decode_reports(hashes, 3)
    assert shards == {"0": {"w": [0, 6, "x"]}, "1": {"w": [6, 12, "x"]}, "2": {}}
    # the sum of the shards' shares is the hash of the whole tensor, however it was split
    assert sums["w"] == layout_hash(full) % (1 << 64)
    with pytest.raises(ValueError, match="malformed shard"):
        decode_reports({"7:w": "0 1 x 0"}, 3)
    with pytest.raises(ValueError, match="malformed shard"):
        decode_reports({"w": "0 1 x 0"}, 3)


def test_reads_cover_a_range_once_across_writers_of_another_shape() -> None:
    # written by 2 islands x 2 ranks as shards of 10 rows (5 + 5 on island 0)
    shards = {"0": {"w": [0, 5, "a"]}, "1": {"w": [5, 10, "b"]}, "2": {}, "3": {}}
    assert reads(shards, "w", 0, 10) == [(0, 0, 5), (1, 5, 10)]
    assert reads(shards, "w", 4, 7) == [(0, 0, 5), (1, 5, 10)]  # a reader of 3 ranks: rows 4-6
    assert reads(shards, "w", 5, 5) == []  # an empty shard reads nothing
    with pytest.raises(ValueError, match=r"tensor 'w': elements \[5, 10\) are in no part"):
        reads({"0": {"w": [0, 5, "a"]}}, "w", 0, 10)
    with pytest.raises(ValueError, match="in two parts"):
        reads({"0": {"w": [0, 6, "a"]}, "1": {"w": [5, 10, "b"]}}, "w", 0, 10)
    whole = whole_shards([["w"], ["v"]], {"w": "h1", "v": "h2"}, {"w": 10, "v": 3})
    assert whole == {"0": {"w": [0, 10, "h1"]}, "1": {"v": [0, 3, "h2"]}}


def test_local_state_goes_through_shards_and_comes_back_whole() -> None:
    class FakeD(torch.Tensor):  # stands in for a DTensor: what local_tree looks for
        pass

    shard = torch.zeros(3)
    d = shard.as_subclass(FakeD)
    d._local_tensor = shard  # type: ignore[attr-defined]
    d.to_local = lambda: shard  # type: ignore[attr-defined]
    template = {"opt": {"state": {0: {"exp_avg": d, "step": torch.tensor(0.0)}}}, "n": 1}
    mirror = local_tree(template)
    assert mirror["opt"]["state"][0]["exp_avg"] is shard
    mirror["opt"]["state"][0]["exp_avg"].fill_(2.0)  # a load writes into the shard
    mirror["n"] = 5  # and replaces plain values in the mirror
    back = merge_local(template, mirror)
    assert back["opt"]["state"][0]["exp_avg"] is d and back["n"] == 5
    assert torch.equal(shard, torch.full((3,), 2.0))


# -- real files: 2 islands x 2 ranks write, other shapes read ------------------------------------


class ThreadIsland:
    """The ranks of one island as threads: gather and sum by a barrier (the real Island does
    them over its process group)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.slots: list[Any] = [None] * size
        self.barrier = threading.Barrier(size)

    def rank(self, r: int) -> Any:
        hub = self

        class Rank:
            rank, size, leader = r, hub.size, r == 0

            def gather(self, obj: Any) -> list[Any]:
                hub.slots[r] = obj
                hub.barrier.wait()
                out = list(hub.slots)
                hub.barrier.wait()
                return out

            def sum_int64(self, t: torch.Tensor) -> torch.Tensor:
                return torch.stack(self.gather(t)).sum(0)

        return Rank()


def full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(10, 6, generator=g),
        "b": torch.randn(7, generator=g),
        "h": torch.randn(5, 4, generator=g).to(torch.bfloat16),
        "buf": torch.randn(3, generator=g),  # replicated on every rank
        "meta/step": torch.tensor(8, dtype=torch.int64),  # replicated
    }


REPLICATED = {"buf", "meta/step"}


def island_state(island: Any, full: dict[str, torch.Tensor]) -> IslandState:
    st = IslandState(island)
    for n, t in full.items():
        if n in REPLICATED:
            st.register(n, t.clone())
            continue
        p = shard_placement(tuple(t.shape), island.size, island.rank)
        rows = p.numel // max(1, t[0].numel())
        st.register(n, t.reshape(-1)[p.start : p.stop].clone().view(rows, *t.shape[1:]), p)
    return st


class FakeSession:
    """What the checkpointer reads of a rank of an island; reports go to one shared book."""

    def __init__(self, island: Any, k: int, sizes: list[int], book: Any, full: Any) -> None:
        self.island, self.rank, self.world = island, k, len(sizes)
        self.island_sizes = sizes
        self.name, self.run_id, self.revision = f"peer{k}", "run", 0
        self.state = island_state(island, full)
        self.book = book

    def report_checkpoint(self, body: dict[str, Any]) -> dict[str, Any]:
        book, lock = self.book
        with lock:
            if "manifest" in body:
                book.manifest(body["revision"], body["manifest"], 0.0)
                return {"ok": True}
            return book.part(
                PartReport(
                    body["revision"], body["part"], body["parts"], body["ok"],
                    body.get("hashes", {}), body.get("bytes", 0), body.get("writer", ""),
                    body.get("local", ""), body.get("error", ""),
                ),
                0.0,
            )  # fmt: skip


def run_ranks(sizes: list[int], fn: Any) -> list[Any]:
    """``fn(k, island rank)`` on a thread per rank of islands of ``sizes``; results in order."""
    islands = [ThreadIsland(n) for n in sizes]
    out: dict[tuple[int, int], Any] = {}
    errors: list[BaseException] = []

    def body(k: int, r: int) -> None:
        try:
            out[(k, r)] = fn(k, islands[k].rank(r))
        except BaseException as e:
            errors.append(e)
            for isl in islands:
                isl.barrier.abort()

    threads = [
        threading.Thread(target=body, args=(k, r)) for k, n in enumerate(sizes) for r in range(n)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return [out[key] for key in sorted(out)]


def write_islands(
    url: str, full: dict[str, torch.Tensor], sizes: tuple[int, ...] = (2, 2)
) -> list[FakeSession]:
    book = (CheckpointBook(url), threading.Lock())

    def write(k: int, island: Any) -> FakeSession:
        s = FakeSession(island, k, list(sizes), book, full)
        ck = IslandCheckpointer(
            s, url, every=2, local_state=lambda: {"rng": torch.full((2,), float(island.rank))}
        )
        s.revision = 4
        assert ck.maybe_save()
        ck.wait()
        assert ck.failures == 0
        s.state.prepare()  # the island's parity hashes, to compare with the manifest's
        return s

    return run_ranks(list(sizes), write)


def test_two_islands_of_two_write_shards_that_any_shape_reads_back_bit_for_bit(
    tmp_path: Path,
) -> None:
    full = full_state()
    url = str(tmp_path / "ck")
    writers = write_islands(url, full)
    store = CheckpointStore(url)
    assert store.revisions() == [4]
    m = read_manifest(store, 4)
    assert m.format == ISLAND_FORMAT and m.hash_kind == "layout" and m.islands == [2, 2]
    assert sorted(m.shards) == ["0", "1", "2", "3"]
    # no gather: every element of every tensor was written exactly once, by the rank holding it
    for n, t in full.items():
        assert reads(m.shards, n, 0, t.numel())
    assert m.schema == [[n, list(t.shape), str(t.dtype)] for n, t in full.items()]
    assert m.local == [f"peer{k}.{r}of2" for k in range(2) for r in range(2)]
    assert m.writers == {str(2 * k + r): f"peer{k} rank {r}" for k in range(2) for r in range(2)}
    # the manifest's hashes are the islands' own parity hashes (layout-independent)
    assert m.hashes == writers[0].state.hashes() == writers[3].state.hashes()

    def read(k: int, island: Any) -> dict[str, torch.Tensor]:
        st = island_state(island, {n: torch.zeros_like(t) for n, t in full.items()})
        got, local = load_latest(url, st, slot=f"peer{k}.{island.rank}of{island.size}",
                                 local_template={"rng": torch.zeros(2)})  # fmt: skip
        assert got.revision == 4 and local is None  # another island shape: no local state
        return st.gathered() if island.size > 1 else dict(st.items())

    for sizes in ([1, 1, 1], [3]):  # islands of one rank, one island of three
        for state in run_ranks(sizes, read):
            for n, t in full.items():
                assert torch.equal(state[n].reshape(t.shape), t), (sizes, n)
    plain = SharedState()
    for n, t in full.items():
        plain.register(n, torch.zeros_like(t))
    assert load_latest(url, plain)[0].revision == 4  # a single peer reads it too
    assert all(torch.equal(plain[n], t) for n, t in full.items())

    # the same shape and slot gets its own local state back
    def same(k: int, island: Any) -> torch.Tensor:
        st = island_state(island, full)
        _, local = load_latest(url, st, slot=f"peer{k}.{island.rank}of2",
                               local_template={"rng": torch.zeros(2)})  # fmt: skip
        return local["rng"]

    assert [float(t[0]) for t in run_ranks([2, 2], same)] == [0.0, 1.0, 0.0, 1.0]


def test_a_corrupt_or_mismatched_island_checkpoint_is_named(tmp_path: Path) -> None:
    full = full_state()
    url = str(tmp_path / "ck")
    write_islands(url, full)
    store = CheckpointStore(url)
    m = read_manifest(store, 4)
    templates = {n: torch.empty_like(t) for n, t in full.items()}
    # a tensor of another shape in the reading run: refused naming it and both shapes
    plain = SharedState()
    for n, t in full.items():
        plain.register(n, torch.zeros(11, 6) if n == "w" else torch.zeros_like(t))
    with pytest.raises(CheckpointMismatch, match=r"'w' is \[10, 6\] torch.float32 in the check"):
        load_latest(url, plain)
    # a shard whose bytes changed on disk: named by its part and tensor
    p = next(k for k, ts in m.shards.items() if "w" in ts)
    a, b, _ = m.shards[p]["w"]
    part = {n: torch.empty(e - s, dtype=full[n].dtype) for n, (s, e, _) in m.shards[p].items()}
    store.load(part, store.dirname(4), f"shared-{p}")
    part["w"][0] += 1.0
    store.save(part, store.dirname(4), f"shared-{p}")
    with pytest.raises(CheckpointCorrupt, match=rf"shared-{p}: tensor 'w' \(elements \[{a}, {b}"):
        load_shared(store, m, templates)
    with pytest.raises(NoCheckpoint, match="all 1 failed to verify"):
        load_latest(url, _plain(full))

    # on an island the verdict is the island's: the rank that reads no bad shard refuses too,
    # and a model of another shape is refused on every rank, naming the tensor
    def corrupt(_k: int, island: Any) -> str:
        st = island_state(island, {n: torch.zeros_like(t) for n, t in full.items()})
        with pytest.raises(NoCheckpoint, match="all 1 failed to verify"):
            load_latest(url, st)
        other = {
            n: torch.zeros(11, 6) if n == "w" else torch.zeros_like(t) for n, t in full.items()
        }
        with pytest.raises(CheckpointMismatch, match=r"'w' is \[10, 6\] torch.float32 in the"):
            load_latest(url, island_state(island, other))
        return "refused"

    assert run_ranks([2], corrupt) == ["refused", "refused"]
    # a manifest whose shards do not add up: the missing elements named
    del m.shards[p]["w"]
    with pytest.raises(CheckpointCorrupt, match=r"tensor 'w': elements \[\d+, \d+\) are in no"):
        load_shared(store, m, templates)
    # a newer format than this reader knows
    raw = Manifest.from_bytes(store.read(store.path(store.dirname(4), "manifest.json")))
    raw.format = 3
    with pytest.raises(ValueError, match="checkpoint format 3; this isthmus reads up to 2"):
        Manifest.from_bytes(raw.to_bytes())


def _plain(full: dict[str, torch.Tensor]) -> SharedState:
    st = SharedState()
    for n, t in full.items():
        st.register(n, torch.zeros_like(t))
    return st


def test_a_checkpoint_of_single_peers_loads_on_an_island(tmp_path: Path) -> None:
    """Whole tensors (format 1) read by the ranks of an island of 2, each its own rows."""
    full = full_state()
    url = str(tmp_path / "plain")
    store = CheckpointStore(url, create=True)
    store.save({n: t.clone() for n, t in full.items()}, store.dirname(2), "shared-0")
    from isthmus.comm.state import tensor_hash

    m = Manifest(run_id="r", revision=2, schema=[[n, list(t.shape), str(t.dtype)] for n, t in
                 full.items()], hashes={n: tensor_hash(t) for n, t in full.items()},
                 parts=[list(full)])  # fmt: skip
    store.write_atomic(store.path(store.dirname(2), "manifest.json"), m.to_bytes())

    def read(_k: int, island: Any) -> dict[str, torch.Tensor]:
        st = island_state(island, {n: torch.zeros_like(t) for n, t in full.items()})
        assert load_latest(url, st)[0].revision == 2
        st.prepare()
        return st.gathered()

    for state in run_ranks([2], read):
        assert all(torch.equal(state[n].reshape(t.shape), t) for n, t in full.items())


def test_islands_of_two_and_one_write_a_checkpoint_an_island_of_three_reads(
    tmp_path: Path,
) -> None:
    """Writers sharded two ways at once (each island its own rows): the parts still cover
    every element once, and a reader of a third shape gets the same bits."""
    full = full_state()
    url = str(tmp_path / "ck")
    writers = write_islands(url, full, sizes=(2, 1))
    m = read_manifest(CheckpointStore(url), 4)
    assert m.islands == [2, 1] and sorted(m.shards) == ["0", "1", "2"]
    assert m.hashes == writers[0].state.hashes() == writers[2].state.hashes()

    def read(_k: int, island: Any) -> dict[str, torch.Tensor]:
        st = island_state(island, {n: torch.zeros_like(t) for n, t in full.items()})
        load_latest(url, st)
        return st.gathered()

    for state in run_ranks([3], read):
        assert all(torch.equal(state[n].reshape(t.shape), t) for n, t in full.items())
