"""Resync: move the tensors a plan names from in-sync peers to peers that need them, verified.

Each (source, destination) pair exchanges one flat byte buffer over the epoch's process group
(point-to-point send/recv). The destination checks every received tensor against the canonical
hash the coordinator put in the plan and only then copies it into its state, so a corrupted or
truncated transfer never enters the shared state: it raises :class:`TransferError`, the round
aborts, and the next round retries the repair.
"""

from __future__ import annotations

import torch

from isthmus.comm.group import Group, Handle
from isthmus.comm.state import SharedState, tensor_hash
from isthmus.coordinator.protocol import RoundPlan

__all__ = ["TransferError", "apply_transfers"]


class TransferError(RuntimeError):
    """A resync transfer arrived with a hash that differs from the canonical one."""


def _pack(state: SharedState, names: tuple[str, ...], device: torch.device) -> torch.Tensor:
    parts = [state[n].detach().reshape(-1).view(torch.uint8).to(device) for n in names]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)


def apply_transfers(group: Group, plan: RoundPlan, state: SharedState, peer_id: int) -> int:
    """Run this peer's part of the plan's transfers. Returns the bytes received.

    Raises :class:`isthmus.comm.group.CollectiveError` if a peer fails mid-transfer and
    :class:`TransferError` if a received tensor does not match its canonical hash; in both cases
    this peer's state is left untouched.
    """
    if not plan.transfers:
        return 0
    device = next(iter(state.items()))[1].device if len(state) else torch.device("cpu")
    handles = []
    incoming: list[tuple[tuple[str, ...], torch.Tensor, Handle]] = []
    for i, t in enumerate(plan.transfers):
        # Tags keep the pairs apart when one peer takes part in several transfers.
        tag = 1000 + i
        if t.src == peer_id:
            buf = _pack(state, t.names, device)
            handles.append(group.send(buf, plan.rank_of(t.dst), tag, async_op=True))
        elif t.dst == peer_id:
            size = sum(state[n].numel() * state[n].element_size() for n in t.names)
            buf = torch.empty(size, dtype=torch.uint8, device=device)
            h = group.recv(buf, plan.rank_of(t.src), tag, async_op=True)
            incoming.append((t.names, buf, h))
    for h in handles:
        h.wait()
    received: dict[str, torch.Tensor] = {}
    total = 0
    for names, buf, h in incoming:
        h.wait()
        total += buf.numel()
        offset = 0
        for n in names:
            target = state[n]
            nb = target.numel() * target.element_size()
            chunk = buf[offset : offset + nb]
            if offset % target.element_size():
                # tensors of mixed dtypes share one byte buffer: a view needs aligned storage
                chunk = chunk.clone()
            value = chunk.view(target.dtype).reshape(target.shape)
            offset += nb
            got = tensor_hash(value)
            if got != plan.expected.get(n):
                raise TransferError(
                    f"resync of {n!r} arrived with hash {got}, expected {plan.expected.get(n)}"
                )
            received[n] = value
    for n, value in received.items():
        state[n].copy_(value)
    return total
