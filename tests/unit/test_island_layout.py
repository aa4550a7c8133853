"""The island-independent layout (comm/layout.py) and the island's state and session choice,
in one process: shard placements, flat spans, the owner mapping of islands of any sizes, the
layout-independent hash, the schema of full shapes, the refusal of a rank without a group."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from isthmus.comm.island import NPROC_VAR, IslandState, find_island
from isthmus.comm.layout import (
    Placement,
    StateLayout,
    hash_hex,
    layout_hash,
    merge,
    owner_pieces,
    piece_groups,
    row_chunk,
    shard_placement,
    tensor_pieces,
)
from isthmus.strategies.sharded import local_view


@pytest.mark.parametrize("rows", [0, 1, 3, 7, 8, 13])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_row_chunks_are_torch_chunks(rows: int, size: int) -> None:
    """FSDP2 shards dim 0 as torch.chunk does, empty trailing ranks included."""
    t = torch.arange(rows)
    chunks = list(torch.chunk(t, size)) if rows else []
    for i in range(size):
        a, b = row_chunk(rows, size, i)
        want = chunks[i].tolist() if i < len(chunks) else []
        assert list(range(a, b)) == want


def test_shard_placements_tile_the_tensor() -> None:
    for size in (1, 2, 3, 4):
        places = [shard_placement((7, 5), size, i) for i in range(size)]
        assert merge([(p.start, p.stop) for p in places]) == [(0, 35)]
        assert sum(p.numel for p in places) == 35
    assert shard_placement((), 2, 1) == Placement((), 0, 0)  # a scalar: rank 0 holds it
    with pytest.raises(ValueError, match="not a rank"):
        row_chunk(4, 2, 2)
    with pytest.raises(ValueError, match="outside"):
        Placement((2, 2), 3, 5)


def _island(layout: StateLayout, shapes: dict[str, tuple[int, ...]], size: int) -> list[Any]:
    """Each rank's flat intervals for an island of ``size`` sharding every tensor on dim 0."""
    return [
        layout.intervals({n: shard_placement(s, size, i) for n, s in shapes.items()})
        for i in range(size)
    ]


def test_layout_spans_and_owners() -> None:
    shapes = {"w": (5, 4), "b": (5,), "step": ()}
    layout = StateLayout([(n, max(1, torch.Size(s).numel())) for n, s in shapes.items()], span=8)
    assert layout.total == 26 and layout.offsets == {"w": 0, "b": 20, "step": 25}
    assert layout.spans() == [(0, 8), (8, 16), (16, 24), (24, 26)]
    two = _island(layout, shapes, 2)
    # rank 0: rows 0-2 of w, 0-2 of b, the scalar; rank 1 the rest
    assert two == [[(0, 12), (20, 23), (25, 26)], [(12, 20), (23, 25)]]
    assert layout.span_owners(two) == [(0,), (0, 1), (0, 1), (0, 1)]
    with pytest.raises(KeyError, match="'b'"):
        layout.intervals({"w": None})
    with pytest.raises(ValueError, match="twice"):
        StateLayout([("a", 1), ("a", 2)])


def test_owner_pieces_equal_sizes_pair_rank_i_with_rank_i() -> None:
    shapes = {"w": (6, 3), "b": (6,)}
    layout = StateLayout([(n, torch.Size(s).numel()) for n, s in shapes.items()])
    islands = [_island(layout, shapes, 3), _island(layout, shapes, 3)]
    pieces = owner_pieces(islands, layout.total)
    assert {owners for _, owners in pieces} == {(0, 0), (1, 1), (2, 2)}
    assert merge([iv for iv, _ in pieces]) == [(0, layout.total)]


def test_owner_pieces_unequal_sizes() -> None:
    """Islands of 4, 2 and 1: every element has one owner per island, and a rank of the small
    island meets the ranks of the larger ones each on its own part."""
    shapes = {"w": (8, 2), "b": (3,)}
    layout = StateLayout([(n, torch.Size(s).numel()) for n, s in shapes.items()])
    islands = [_island(layout, shapes, n) for n in (4, 2, 1)]
    pieces = owner_pieces(islands, layout.total)
    assert merge([iv for iv, _ in pieces]) == [(0, 19)]
    assert [owners for _, owners in pieces] == [
        (0, 0, 0), (1, 0, 0), (2, 1, 0), (3, 1, 0), (0, 0, 0), (1, 0, 0), (2, 1, 0),
    ]  # fmt: skip
    for (a, b), owners in pieces:
        for j, i in enumerate(owners):
            assert any(x <= a and b <= y for x, y in islands[j][i])
    with pytest.raises(ValueError, match="ranks \\[0, 1\\] of island 0"):
        owner_pieces([[[(0, 4)], [(2, 6)]]], 6)
    with pytest.raises(ValueError, match="no rank of island 0"):
        owner_pieces([[[(0, 2)], [(3, 6)]]], 6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_layout_hash_does_not_depend_on_the_sharding(dtype: torch.dtype) -> None:
    full = (torch.randn(7, 5, generator=torch.Generator().manual_seed(3)) * 50).to(dtype)
    whole = layout_hash(full)
    for size in (1, 2, 3, 4):
        shares = 0
        for i in range(size):
            p = shard_placement(full.shape, size, i)
            shares += layout_hash(full.reshape(-1)[p.start : p.stop], p)
        assert shares % 2**64 == whole % 2**64
    changed = full.clone()
    changed.view(-1)[17] += 1
    assert layout_hash(changed) % 2**64 != whole % 2**64
    swapped = full.clone()
    swapped[[0, 1]] = full[[1, 0]]
    assert torch.equal(swapped, full) or layout_hash(swapped) % 2**64 != whole % 2**64
    assert hash_hex(whole, (7, 5), str(dtype)) != hash_hex(whole, (5, 7), str(dtype))


class OneRank:
    """An island of one rank, in this process (the collectives are identities)."""

    rank, size, leader = 0, 1, True

    def sum_int64(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    def gather(self, obj: Any) -> list[Any]:
        return [obj]


def test_island_state_reports_full_shapes_and_layout_hashes() -> None:
    state = IslandState(OneRank())  # type: ignore[arg-type]
    full = torch.randn(7, 5)
    p = shard_placement((7, 5), 2, 1)  # rows 4-6: what rank 1 of 2 holds
    shard = full[4:].clone()
    state.register("w", shard, p)
    state.register("step", torch.zeros((), dtype=torch.int64))
    with pytest.raises(ValueError, match="placement says"):
        state.register("bad", torch.zeros(3), p)
    assert [(s.name, tuple(s.shape)) for s in state.schema()] == [("w", (7, 5)), ("step", ())]
    with pytest.raises(RuntimeError, match="prepare"):
        state.hashes()
    hashes = state.prepare()
    assert hashes["w"] == hash_hex(layout_hash(shard, p), (7, 5), "torch.float32")
    assert state.digest() == state.digest()
    gathered = state.gathered()
    assert torch.equal(gathered["w"].reshape(-1)[p.start :], shard.reshape(-1))


def test_a_rank_without_a_process_group_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NPROC_VAR, "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RuntimeError, match=r"never called torch\.distributed\.init_process_group"):
        find_island()
    monkeypatch.setenv(NPROC_VAR, "1")
    assert find_island() is None  # a plain peer


def test_plain_tensors_are_their_own_local_view() -> None:
    t = torch.zeros(3)
    assert local_view(t) == (t, None)


def test_piece_groups_of_islands_of_two_and_one() -> None:
    """An island of 2 beside one of 1: rank 0 of each meets on the first rows of every tensor,
    rank 1 of the first meets rank 0 of the second on the rest; with equal sizes, rank i with
    rank i."""
    assert tensor_pieces((5, 3), (2, 1)) == [((0, 9), (0, 0)), ((9, 15), (1, 0))]
    assert tensor_pieces((), (2, 1)) == [((0, 1), (0, 0))]
    assert piece_groups([(5, 3), (4,), ()], (2, 1)) == [(0, 0), (1, 0)]
    assert piece_groups([(5, 3)], (3, 3)) == [(0, 0), (1, 1), (2, 2)]
    assert piece_groups([(1, 3)], (2, 2)) == [(0, 0)]  # one row: rank 1 holds nothing


def test_session_builds_the_islands_class_only_for_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Session(config)`` builds what the island factory names (an island's session on a rank
    of an island); a subclass built on purpose is never redirected."""
    from isthmus.comm.session import Session
    from isthmus.comm.session_config import IslandDispatch, SessionConfig

    class Made(Session):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.args = args

    class Mine(Session):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

    seen: list[Any] = []

    def factory(island: Any) -> type | None:
        seen.append(island)
        return Made

    monkeypatch.setattr(IslandDispatch, "island_factory", factory)
    config = SessionConfig(coordinator="127.0.0.1:1", token="t")
    made = Session(config, island="group")
    assert type(made) is Made and made.args == (config,) and seen == ["group"]
    assert type(Mine(config)) is Mine and seen == ["group"]
