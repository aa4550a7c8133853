"""Resync of an island, shard by shard: the plan's transfers between islands.

Between islands of one size, each local rank ``i`` of a source island sends its own shards of
the named tensors to rank ``i`` of the destination island over their cross-island group (the
islands are sharded alike, so the shards match byte for byte); nothing passes through either
leader. Between islands of different sizes, the same happens piece by piece: in each group of a
tuple of owners, the source's member sends the elements that tuple holds to the destination's
member, and replicated tensors go leader to leader, then to the destination's followers. The destination cannot check
a shard against the canonical hash alone: the hash of a sharded tensor is the sum of its ranks'
shares (:func:`~isthmus.comm.layout.layout_hash`), so the destination's ranks sum their shares
of what they received and compare the island's hash with the plan's; a replicated tensor is
checked by every rank on its own. Only when every tensor of every rank matched does any rank
copy what it received into its state; otherwise every rank raises :class:`TransferError` and
the state is untouched, so the round aborts and the repair is retried.
"""

from __future__ import annotations

from typing import Any

import torch

from isthmus.comm.group import Group
from isthmus.comm.layout import hash_hex, layout_hash, tensor_pieces
from isthmus.comm.transfer import TransferError
from isthmus.coordinator.protocol import RoundPlan

__all__ = ["island_transfers"]


def _pack(state: Any, names: tuple[str, ...]) -> torch.Tensor:
    parts = [state[n].detach().reshape(-1).view(torch.uint8).cpu() for n in names]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def island_transfers(
    group: Group,
    plan: RoundPlan,
    state: Any,
    peer_id: int,
    *,
    pieces: dict[tuple[int, ...], Group] | None = None,
    sizes: list[int] | None = None,
) -> int:
    """This rank's part of the plan's transfers into ``state`` (its
    :class:`~isthmus.comm.island.IslandState`) (every rank of the island calls it at the same
    point, sources and destinations alike). Returns the bytes this rank received. With islands
    of different ``sizes``, ``pieces`` (this rank's group per tuple of owners) carry the
    transfers piece by piece instead (:func:`_transfers_by_piece`).

    Raises :class:`~isthmus.comm.group.CollectiveError` when a member fails mid-transfer and
    :class:`TransferError` when what the island received does not match the canonical hashes
    (on every rank of the island, which then changes nothing)."""
    if pieces is not None:
        assert sizes is not None
        return _transfers_by_piece(pieces, sizes, plan, state, peer_id)
    sends, recvs = [], []
    incoming: list[tuple[tuple[str, ...], torch.Tensor]] = []
    error = ""
    received: dict[str, torch.Tensor] = {}
    try:  # every rank must reach the island's verdict below, whatever fails here
        for i, t in enumerate(plan.transfers):
            tag = 3000 + i
            if t.src == peer_id:
                sends.append(
                    group.send(_pack(state, t.names), plan.rank_of(t.dst), tag, async_op=True)
                )
            elif t.dst == peer_id:
                nbytes = sum(state[n].numel() * state[n].element_size() for n in t.names)
                buf = torch.empty(nbytes, dtype=torch.uint8)
                recvs.append(group.recv(buf, plan.rank_of(t.src), tag, async_op=True))
                incoming.append((t.names, buf))
        for h in sends + recvs:
            h.wait()
        for names, buf in incoming:
            offset = 0
            for n in names:
                target = state[n]
                nb = target.numel() * target.element_size()
                value = buf[offset : offset + nb].clone().view(target.dtype).view(target.shape)
                offset += nb
                received[n] = value
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    _verdict(plan, state, received, error)
    return sum(buf.numel() for _, buf in incoming)


def _verdict(plan: RoundPlan, state: Any, received: dict[str, torch.Tensor], error: str) -> None:
    """Every rank of the island together: check what the island received against the plan's
    hashes (each rank's shares of the sharded tensors summed, the replicated ones on their
    own) and copy it into ``state`` only when all of it matched; else raise TransferError."""
    shares: dict[str, int] = {}
    for n, value in received.items():
        p = state.placements[n]
        if p is None:
            got = hash_hex(layout_hash(value), tuple(value.shape), str(value.dtype))
            if got != plan.expected.get(n) and not error:
                error = f"resync of {n!r} arrived with hash {got}, expected {plan.expected.get(n)}"
        else:
            shares[n] = layout_hash(value, p)
    verdicts = state.island.gather((error, shares))
    errors = [f"rank {r}: {e}" for r, (e, _) in enumerate(verdicts) if e]
    if not errors:
        for n in shares:
            total = sum(s[n] for _, s in verdicts)
            got = hash_hex(total, state.full_shape(n), str(state[n].dtype))
            if got != plan.expected.get(n):
                errors.append(f"resync of {n!r} arrived with hash {got}, expected "
                              f"{plan.expected.get(n)}")  # fmt: skip
    if errors:
        raise TransferError("; ".join(errors))
    with torch.no_grad():
        for n, value in received.items():
            state[n].copy_(value)


def _transfers_by_piece(
    pieces: dict[tuple[int, ...], Group],
    sizes: list[int],
    plan: RoundPlan,
    state: Any,
    peer_id: int,
) -> int:
    """The plan's transfers between islands of different sizes. Every rank holds the pieces of
    its groups' tuples of owners (:func:`~isthmus.comm.layout.tensor_pieces`), which together
    make its shard; in each group the source island's member sends those elements to the
    destination island's member, so each rank of the destination fills its own shard from the
    ranks of the source that hold its parts. Replicated tensors go from leader to leader (the
    group of every island's rank 0) and the destination's leader hands them to its followers."""
    island = state.island
    sends, recvs = [], []
    incoming: list[tuple[list[tuple[str, int, int]], torch.Tensor]] = []
    error = ""
    received: dict[str, torch.Tensor] = {}
    whole: dict[str, torch.Tensor] = {}  # replicated tensors the destination's leader received
    try:
        for i, t in enumerate(plan.transfers):
            if peer_id not in (t.src, t.dst):
                continue
            for owners, g in pieces.items():
                segs = [(n, a, b) for n in t.names for a, b in _segments(state, n, owners, sizes)]
                if island.leader and not any(owners):  # rank 0 of every island: replicated too
                    segs += [(n, 0, state[n].numel()) for n in t.names if not state.placements[n]]
                if not segs:
                    continue
                if t.src == peer_id:
                    parts = [state[n].detach().reshape(-1)[a:b].cpu() for n, a, b in segs]
                    flat = torch.cat([x.contiguous().view(torch.uint8) for x in parts])
                    sends.append(g.send(flat, plan.rank_of(t.dst), 3000 + i, async_op=True))
                else:
                    nbytes = sum((b - a) * state[n].element_size() for n, a, b in segs)
                    buf = torch.empty(nbytes, dtype=torch.uint8)
                    recvs.append(g.recv(buf, plan.rank_of(t.src), 3000 + i, async_op=True))
                    incoming.append((segs, buf))
        for h in sends + recvs:
            h.wait()
        for segs, buf in incoming:
            offset = 0
            for n, a, b in segs:
                target = state[n]
                nb = (b - a) * target.element_size()
                if n not in received:
                    received[n] = target.detach().cpu().clone()
                flat = received[n].view(-1)
                flat[a:b] = buf[offset : offset + nb].clone().view(target.dtype)
                offset += nb
                if state.placements[n] is None:
                    whole[n] = received[n]
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    if any(peer_id == t.dst for t in plan.transfers):  # the destination's ranks, together
        whole = island.broadcast(whole if island.leader else None) or {}
        received.update({n: v.clone() for n, v in whole.items()} if not island.leader else {})
    _verdict(plan, state, received, error)
    return sum(buf.numel() for _, buf in incoming)


def _segments(
    state: Any, name: str, owners: tuple[int, ...], sizes: list[int]
) -> list[tuple[int, int]]:
    """The elements (local offsets) of this rank's shard of ``name`` that ``owners`` hold."""
    p = state.placements[name]
    if p is None:
        return []
    return [(a - p.start, b - p.start)
            for (a, b), own in tensor_pieces(p.full_shape, sizes) if own == owners]  # fmt: skip
