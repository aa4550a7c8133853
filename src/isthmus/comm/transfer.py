"""Resync: move the tensors a plan names from in-sync peers to peers that need them, verified.

Each (source, destination) pair exchanges one flat byte buffer over the epoch's process group
(point-to-point send/recv). The destination checks every received tensor against the canonical
hash the coordinator put in the plan and only then copies it into its state, so a corrupted or
truncated transfer never enters the shared state: it raises :class:`TransferError`, the round
aborts, and the next round retries the repair.

Catch-up by replay: when the state has a :class:`~isthmus.comm.state.CatchUp` (a strategy whose
rounds can be replayed from a small log) and a destination receives from one source, the pair
first agrees on how: the destination sends its protocol version, revision and wish, the source
answers with its version and a mode (either side refuses a version it does not speak, naming
both). In replay mode the source sends the log of the missed rounds and the tensors a replay does not
cover; the destination replays into new tensors, checks *every* tensor against the canonical
hashes, and tells the source whether they matched; if not (its state at its revision was not the
run's, a log it could not read), the source sends the tensors after all. Either way only
verified tensors enter the state. Messages (tags ``2000 + 8 i + k`` for the plan's transfer
``i``): ``k=0`` destination -> source int64 ``[protocol, revision, wish]``; ``k=1`` source ->
destination int64 ``[protocol, mode, nbytes]``; ``k=2`` the payload; ``k=3`` destination ->
source int64 ``[ok]`` (replay mode only); ``k=4`` the tensors (only after a replay that did not
match). Both sides check the other's protocol version first: on a mismatch the source answers
mode ``-1`` and sends nothing more, and both raise :class:`TransferError` naming both versions.
"""

from __future__ import annotations

import logging

import torch

from isthmus.comm.group import Group, Handle
from isthmus.comm.state import CatchUp, SharedState, tensor_hash
from isthmus.coordinator.protocol import RoundPlan, Transfer
from isthmus.coordinator.wire import PROTOCOL_VERSION, refusal

__all__ = ["TransferError", "apply_transfers"]

log = logging.getLogger("isthmus.transfer")


class TransferError(RuntimeError):
    """A resync transfer arrived with a hash that differs from the canonical one, or the two
    peers of a catch-up speak different protocol versions."""


def _pack(state: SharedState, names: tuple[str, ...], device: torch.device) -> torch.Tensor:
    parts = [state[n].detach().reshape(-1).view(torch.uint8).to(device) for n in names]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)


def _nbytes(state: SharedState, names: tuple[str, ...]) -> int:
    return sum(state[n].numel() * state[n].element_size() for n in names)


def _unpack(
    buf: torch.Tensor, names: tuple[str, ...], state: SharedState, plan: RoundPlan
) -> dict[str, torch.Tensor]:
    """The tensors ``names`` read from ``buf`` (packed in that order), each verified against the
    plan's canonical hash. Raises :class:`TransferError` at the first mismatch."""
    received: dict[str, torch.Tensor] = {}
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
        _verify(n, value, plan)
        received[n] = value
    return received


def _verify(name: str, value: torch.Tensor, plan: RoundPlan) -> None:
    got = tensor_hash(value)
    if got != plan.expected.get(name):
        raise TransferError(
            f"resync of {name!r} arrived with hash {got}, expected {plan.expected.get(name)}"
        )


def apply_transfers(group: Group, plan: RoundPlan, state: SharedState, peer_id: int) -> int:
    """Run this peer's part of the plan's transfers. Returns the bytes received.

    Raises :class:`isthmus.comm.group.CollectiveError` if a peer fails mid-transfer and
    :class:`TransferError` if a received tensor does not match its canonical hash; in both cases
    this peer's state is left untouched.
    """
    if not plan.transfers:
        return 0
    device = next(iter(state.items()))[1].device if len(state) else torch.device("cpu")
    incoming_count: dict[int, int] = {}
    for t in plan.transfers:
        incoming_count[t.dst] = incoming_count.get(t.dst, 0) + 1
    handles = []
    incoming: list[tuple[tuple[str, ...], torch.Tensor, Handle]] = []
    received: dict[str, torch.Tensor] = {}
    total = 0
    for i, t in enumerate(plan.transfers):
        # the same decision on both sides, from the plan alone: a replay needs the one source
        if state.catch_up is not None and incoming_count[t.dst] == 1:
            if t.src == peer_id:
                _serve(group, plan, state, state.catch_up, i, t, device)
            elif t.dst == peer_id:
                got, nbytes = _catch_up(group, plan, state, state.catch_up, i, t, device)
                received.update(got)
                total += nbytes
            continue
        # Tags keep the pairs apart when one peer takes part in several transfers.
        tag = 1000 + i
        if t.src == peer_id:
            buf = _pack(state, t.names, device)
            handles.append(group.send(buf, plan.rank_of(t.dst), tag, async_op=True))
        elif t.dst == peer_id:
            buf = torch.empty(_nbytes(state, t.names), dtype=torch.uint8, device=device)
            h = group.recv(buf, plan.rank_of(t.src), tag, async_op=True)
            incoming.append((t.names, buf, h))
    for h in handles:
        h.wait()
    for names, buf, h in incoming:
        h.wait()
        total += buf.numel()
        received.update(_unpack(buf, names, state, plan))
    for n, value in received.items():
        state[n].copy_(value)
    return total


def _ints(*values: int, device: torch.device) -> torch.Tensor:
    # on the state's device: NCCL moves only accelerator tensors
    return torch.tensor(values, dtype=torch.int64, device=device)


def _serve(
    group: Group,
    plan: RoundPlan,
    state: SharedState,
    cu: CatchUp,
    i: int,
    t: Transfer,
    device: torch.device,
) -> None:
    """The source's side of one transfer with a catch-up handshake (see the module docstring)."""
    dst, tag = plan.rank_of(t.dst), 2000 + 8 * i
    head = _ints(0, 0, 0, device=device)
    group.recv(head, dst, tag)
    why = refusal(int(head[0]), them=f"peer {t.dst}", us="this peer")
    if why is not None:  # answer first: the destination waits for the mode
        group.send(_ints(PROTOCOL_VERSION, -1, 0, device=device), dst, tag + 1)
        raise TransferError(f"cannot catch peer {t.dst} up: {why}")
    since, wish = int(head[1]), int(head[2])
    covered = [n for n in t.names if n in cu.covers()]
    rest = tuple(n for n in t.names if n not in covered)
    history = cu.offer(since, plan.round, _nbytes(state, t.names), wish) if covered else None
    if history is None:
        payload = _pack(state, t.names, device)
        group.send(_ints(PROTOCOL_VERSION, 0, payload.numel(), device=device), dst, tag + 1)
        group.send(payload, dst, tag + 2)
        return
    raw = torch.tensor(list(history), dtype=torch.uint8, device=device)
    payload = torch.cat(
        [_ints(len(history), device=device).view(torch.uint8), raw, _pack(state, rest, device)]
    )
    group.send(_ints(PROTOCOL_VERSION, 1, payload.numel(), device=device), dst, tag + 1)
    group.send(payload, dst, tag + 2)
    ok = _ints(0, device=device)
    group.recv(ok, dst, tag + 3)
    if not int(ok[0]):
        log.info("peer %d's replay did not match the run's state: sending the tensors", t.dst)
        group.send(_pack(state, t.names, device), dst, tag + 4)


def _catch_up(
    group: Group,
    plan: RoundPlan,
    state: SharedState,
    cu: CatchUp,
    i: int,
    t: Transfer,
    device: torch.device,
) -> tuple[dict[str, torch.Tensor], int]:
    """The destination's side: returns the verified tensors (not yet copied into the state) and
    the bytes received. Raises :class:`TransferError` if the tensors sent as they are do not
    match their hashes."""
    src, tag = plan.rank_of(t.src), 2000 + 8 * i
    since = cu.revision()
    group.send(_ints(PROTOCOL_VERSION, since, cu.wish(), device=device), src, tag)
    head = _ints(0, 0, 0, device=device)
    group.recv(head, src, tag + 1)
    why = refusal(int(head[0]), them=f"peer {t.src}", us="this peer")
    if why is not None:
        raise TransferError(f"cannot catch up from peer {t.src}: {why}")
    mode, nbytes = int(head[1]), int(head[2])
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    group.recv(buf, src, tag + 2)
    if mode == 0:
        return _unpack(buf, t.names, state, plan), nbytes
    covered = [n for n in t.names if n in cu.covers()]
    rest = tuple(n for n in t.names if n not in covered)
    size = int(buf[:8].cpu().view(torch.int64)[0])
    history = bytes(buf[8 : 8 + size].cpu().tolist())
    got: dict[str, torch.Tensor] | None = None
    try:
        replayed = cu.replay(history, since, plan.round)
        for n in covered:
            _verify(n, replayed[n], plan)
        got = {n: replayed[n] for n in covered}
        got.update(_unpack(buf[8 + size :], rest, state, plan))
    except (ValueError, KeyError, TransferError) as e:
        log.warning(
            "replay of rounds %d to %d did not match (%s): asking for the tensors",
            since,
            plan.round - 1,
            e,
        )
        got = None
    group.send(_ints(int(got is not None), device=device), src, tag + 3)
    if got is not None:
        cu.adopt(history)
        log.info(
            "caught up from revision %d to %d by replaying %d bytes", since, plan.round, nbytes
        )
        return got, nbytes
    full = torch.empty(_nbytes(state, t.names), dtype=torch.uint8, device=device)
    group.recv(full, src, tag + 4)
    return _unpack(full, t.names, state, plan), nbytes + full.numel()
