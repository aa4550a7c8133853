"""Resync of an island, shard by shard: the plan's transfers between islands of one size.

Each local rank ``i`` of a source island sends its own shards of the named tensors to rank ``i``
of the destination island over their cross-island group (the islands are sharded alike, so the
shards match byte for byte); nothing passes through either leader. The destination cannot check
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
from isthmus.comm.layout import hash_hex, layout_hash
from isthmus.comm.transfer import TransferError
from isthmus.coordinator.protocol import RoundPlan

__all__ = ["island_transfers"]


def _pack(state: Any, names: tuple[str, ...]) -> torch.Tensor:
    parts = [state[n].detach().reshape(-1).view(torch.uint8).cpu() for n in names]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def island_transfers(group: Group, plan: RoundPlan, state: Any, peer_id: int) -> int:
    """This rank's part of the plan's transfers into ``state`` (its
    :class:`~isthmus.comm.island.IslandState`) (every rank of the island calls it at the same
    point, sources and destinations alike). Returns the bytes this rank received.

    Raises :class:`~isthmus.comm.group.CollectiveError` when a member fails mid-transfer and
    :class:`TransferError` when what the island received does not match the canonical hashes
    (on every rank of the island, which then changes nothing)."""
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
    # the verdict: each rank's shares of the sharded tensors, its own check of the replicated
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
    return sum(buf.numel() for _, buf in incoming)
