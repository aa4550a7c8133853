"""Strategies whose round sends a message computed over whole tensors (SparseLoCo's and DeMo's
compressed updates, ZO's projected gradients), on a rank of an island.

Such a message cannot be cut by shard: a top-k picks over a whole chunk or tile, a quantizer's
statistics span a whole tensor, a perturbation is drawn over a whole tensor. It is small beside
the state, so an island builds it the way an unsharded peer does and exchanges it whole:

1. each rank computes its shards of the message's input elementwise (an accumulator, a
   momentum); :func:`whole_on_leader` gathers them into whole tensors on the island's leader,
   inside the island (never the state: only this round's input, once);
2. the leader encodes the message, as an unsharded peer holding those whole tensors would, and
   :func:`leader_message` gives its bytes to every rank, so the island's ranks hold one message
   whatever their arithmetic (nothing is computed twice and compared);
3. :class:`IslandGather` exchanges the messages across islands: with islands of one size,
   rank ``i`` of every island all-gathers the ``i``-th run of the message's bytes, so every
   link of an island carries a part, and the ranks share their parts inside the island; with
   islands of different sizes (whose ranks' groups do not line up) the leaders all-gather whole
   messages in the group every island's rank 0 shares (their primary group: it holds the tuple
   of owners ``(0, ..., 0)`` whatever the sizes) and hand the result to their ranks. A failed
   collective fails the round on every rank of the island alike;
4. every rank decodes the messages and applies the part of the result that falls in its own
   shards (:func:`windows`).

ZO gathers nothing: its message is a few codes of the island's mean losses, which every rank
computes alike, so only steps 3 and 4 apply to it.

The cross-island bytes are the message's alone, what an unsharded peer sends: spread over the
island's ranks with equal sizes, all on the leader's link with different sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from isthmus.comm.group import CollectiveError
from isthmus.comm.layout import Placement

__all__ = ["IslandGather", "Later", "island_of", "leader_message", "whole_on_leader", "windows"]


def island_of(session: Any) -> Any:
    """The :class:`~isthmus.comm.island_state.Island` of ``session``'s rank, or None for a
    plain peer (or no session)."""
    return getattr(session, "island", None)


def windows(placements: Sequence[Placement | None], sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Per tensor, the flat elements ``[a, b)`` of the whole tensor this rank holds: its
    placement's, or all ``sizes[k]`` of them for a tensor held whole."""
    return [
        (0, n) if p is None else (p.start, p.stop)
        for p, n in zip(placements, sizes, strict=True)
    ]  # fmt: skip


def whole_on_leader(
    island: Any, shards: Sequence[torch.Tensor], placements: Sequence[Placement | None]
) -> list[torch.Tensor] | None:
    """The whole tensors (flat fp32) of the island's ``shards`` on its leader, None on the
    other ranks (see :meth:`~isthmus.comm.island_state.Island.gather_whole`). Every rank of
    the island calls it at the same point."""
    return island.gather_whole(list(shards), list(placements))  # type: ignore[no-any-return]


def leader_message(island: Any, message: torch.Tensor | None, size: int) -> torch.Tensor | None:
    """The leader's ``message`` (uint8, ``size`` bytes, or None: none) on every rank of the
    island. Every rank calls it at the same point; only the leader's argument counts."""
    box = torch.zeros(size + 1, dtype=torch.uint8)
    if island.leader and message is not None:
        box[0] = 1
        box[1:] = message.reshape(-1).cpu()
    island.broadcast_tensor(box)
    return box[1:].clone() if int(box[0]) else None


class IslandGather:
    """One round's all-gather of fixed-size messages across islands, and its result on every
    rank of the island. Built on every rank at the same point (the collectives are issued here,
    from the training thread); :meth:`wait` (every rank, at the same point) returns the
    messages in member order, ``[world, size]``, or raises
    :class:`~isthmus.comm.group.CollectiveError` on every rank when any rank's collective
    failed (at issue or later), so that the island fails the round as one.

    With islands of one size, the message is cut into one contiguous run of bytes per local
    rank and rank ``i`` all-gathers run ``i`` with rank ``i`` of the other islands, so all of
    an island's links carry a part; the ranks then share their parts inside the island. With
    islands of different sizes the runs would not line up, so the leaders all-gather whole
    messages in the group every island's rank 0 shares and hand the result to their ranks."""

    def __init__(self, island: Any, rnd: Any, mine: torch.Tensor) -> None:
        self.island, self.world = island, rnd.world
        self.handle: Any = None
        self.error = ""
        self.size = mine.numel()
        self.split = island.size > 1 and not getattr(rnd, "pieces", None)
        send: torch.Tensor | None = mine
        if self.split:
            self.run = -(-self.size // island.size)  # bytes per rank (the last run shorter)
            a, b = self.span(island.rank)
            send = torch.zeros(self.run, dtype=mine.dtype, device=mine.device)
            send[: b - a] = mine.reshape(-1)[a:b]
        elif not island.leader:
            send = None
        if send is not None:
            try:
                self.handle = rnd.group.all_gather_flat(send, async_op=True)
            except CollectiveError as e:  # told to the island in wait(), not raised here
                self.error = str(e)

    def span(self, rank: int) -> tuple[int, int]:
        """The bytes ``[a, b)`` of the message local rank ``rank`` exchanges (split mode)."""
        a = min(rank * self.run, self.size)
        return a, min(a + self.run, self.size)

    def _mine(self) -> torch.Tensor | None:
        if self.handle is None or self.error:
            return None
        try:
            return self.handle.wait().cpu()  # type: ignore[no-any-return]
        except CollectiveError as e:
            self.error = str(e)
            return None

    def wait(self) -> torch.Tensor:
        island = self.island
        flat = self._mine()
        if self.split:
            errors = [e for e in island.gather(self.error) if e]  # one verdict for the island
            if errors:
                raise CollectiveError(f"the island's exchange failed: {'; '.join(errors)}")
            assert flat is not None
            parts = island.all_gather_tensor(flat.view(self.world, self.run))
            out = torch.empty(self.world, self.size, dtype=flat.dtype)
            for r, part in enumerate(parts):
                a, b = self.span(r)
                out[:, a:b] = part[:, : b - a]
            return out
        if island.leader:
            island.broadcast(("error", self.error) if self.error else ("ok", flat))
        else:
            kind, payload = island.broadcast()
            if kind == "error":
                self.error = str(payload)
            else:
                flat = payload
        if self.error:
            raise CollectiveError(f"the island's leader's exchange failed: {self.error}")
        assert flat is not None
        return flat.view(self.world, -1)


class Later:
    """A result computed when waited for (from the training thread: an island's exchange
    waits on collectives inside the island, which must be issued in one order on every rank,
    so it cannot run on the reducer's worker)."""

    def __init__(self, finish: Callable[[], Any]) -> None:
        self._finish: Callable[[], Any] | None = finish

    def wait(self) -> Any:
        if self._finish is None:
            raise RuntimeError("this reduction was already waited for")
        finish, self._finish = self._finish, None
        return finish()
