"""An elastic, exactly-once sampler: every sample of an epoch is used once by a committed round.

Peers run rounds that commit on every member or abort for all (docs/PROTOCOL.md). Between two
commits a peer trains ``T`` steps (DDP: 1; DiLoCo: H) on batches split by the membership of the
last committed round. If a round commits, the shares of the peers whose work counted in it are
*used*; everything else that was handed out (a dead peer's share, a repaired peer's share, the
batches of the catch-up round before any membership was known) is owed again and handed out
first. So across kills, joins, aborted rounds and resyncs, every sample of an epoch is used by
exactly one committed round.

How (see :mod:`isthmus.data.ledger` for the arithmetic):

* A deterministic order per epoch (a seeded permutation; ``seed`` and the epoch fix it).
* The position in it is *shared state*: tensors registered with the session by :meth:`attach`,
  so they are hashed, repaired and handed to joiners like the model, and saved in checkpoints.
* :meth:`ElasticSampler.indices` gives this peer's share of the next global batch from the
  shared position and the number of batches drawn since the last commit.
* :meth:`ElasticSampler.on_commit` (a commit hook: the session calls it on every member right
  after a commit) marks the contributors' shares used and puts the rest back in the ledger. Every
  member computes the same update from the same shared state and the round's plan.

Shared tensors (int64, on the CPU; names under ``prefix``, default ``data/``)::

    data/epoch         (1,)               oldest epoch with samples still owed
    data/cursor        (1,)               first position never handed out (from epoch's start)
    data/drawn         (1,)               global batches drawn since the last commit
    data/ledger        (ledger_capacity, 2)   (start, length) ranges owed again; zero padded
    data/ledger_count  (1,)               rows of data/ledger in use
    data/assigners     (max_peers,)       members of the last committed round; -1 padded
    data/config        (3,)               num_samples, batch_size, seed (checked, never changed)

Who counts: a peer's share counts in a committed round if it was among the assigners (it drew
its batches under that membership), is a member of the round, and was not resynced in it. A
training loop can ask :meth:`ElasticSampler.assignment` before doing work that must count.

The number of batches drawn is itself shared (``data/drawn``), although each peer advances it
locally: peers that drew the same number of batches hold equal bytes, and a peer whose count is
off (a joiner that drew one batch before its catch-up round while the members drew H) is
repaired by the parity check with the rest of its sampler state, so every member of a round
computes the same commit. The assumption is that all *contributors* between two commits draw
the same number of batches, which the round-based strategies (DDP, local SGD, DiLoCo) do; a
contributor that draws a different number is out-voted at the next parity check, repaired, and
its work does not count in that round. With ``parity_every > 1`` such a difference goes
unnoticed until the next check, as any divergence of shared state does.

Who counts in the run's *first* round depends on the strategy: nobody knew the membership
before it, so every peer drew its first blocks as rank 0 of 1. A strategy whose first step is a
catch-up round (the DiLoCo family) drops that work, and the blocks are owed again; one that
trains on it (DDP) sets ``session.first_round_uses_work``, and the blocks count as used once.
Peers registered after the run started, and peers repaired by an attempt that aborted, are
listed in the plan's ``resynced`` (the coordinator's ``stale``) until they commit a round, so
the strategy and the sampler agree that their work does not count.
"""

from __future__ import annotations

import json
import operator
import os
from collections.abc import Callable, Collection, Mapping, Sequence, Sized
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from isthmus.data.ledger import EpochOrder, Position, Range, commit, draw, share

__all__ = ["ElasticSampler", "LedgerOverflow", "PlanLike", "SessionLike"]

_FIELDS = ("epoch", "cursor", "drawn", "ledger", "ledger_count", "assigners", "config")


class PlanLike(Protocol):
    """What the sampler reads from a committed round's plan (``RoundPlan`` has all of it)."""

    @property
    def round(self) -> int: ...

    @property
    def members(self) -> Sequence[int]: ...

    @property
    def resynced(self) -> Collection[int]: ...


class SessionLike(Protocol):
    """What :meth:`ElasticSampler.attach` needs of a session (``isthmus.comm.Session``)."""

    def register(self, name: str, tensor: torch.Tensor) -> None: ...

    def add_commit_hook(self, fn: Callable[[Any], None]) -> None: ...


class LedgerOverflow(RuntimeError):
    """More separate unused ranges are owed than the ledger can hold."""


def _int(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class ElasticSampler:
    """Splits a fixed global batch of sample indices among the current peers, exactly once.

    ``data`` is the dataset (anything with ``len``) or its length; ``batch_size`` is the
    *global* batch B, split among peers. ``seed`` fixes the per-epoch orders. ``used_log``, if
    given, is a file to which every commit appends one JSON line per epoch touched,
    ``{"round": r, "epoch": e, "used": [indices...]}`` (every member writes the same lines:
    give each peer its own path).

    Use: create it on every peer with the same arguments, call :meth:`attach` with the session
    before the first round (with the strategy's other shared state), then each training step
    ``idx = sampler.indices(rank, world)`` with this peer's rank and world size in the last
    round it was in (``session.rank``, ``session.world``), and train on ``dataset.batch(idx)``.

    Without :meth:`attach` (one process with no session, or a fixed-size torch job where every
    rank calls it with its own rank) each :meth:`indices` call consumes its whole block at once.

    Failures: bad arguments raise ValueError; a peer whose dataset length, batch size or seed
    differs from the run's raises ValueError at its next :meth:`indices` or commit, naming both;
    a commit that would owe more than ``ledger_capacity`` separate ranges raises
    :class:`LedgerOverflow` (on every member alike); more than ``max_peers`` members raises
    ValueError.
    """

    def __init__(
        self,
        data: int | Sized,
        batch_size: int,
        *,
        seed: int = 0,
        ledger_capacity: int = 4096,
        max_peers: int = 1024,
        used_log: str | os.PathLike[str] | None = None,
        prefix: str = "data/",
    ) -> None:
        n = len(data) if isinstance(data, Sized) else operator.index(data)
        self.num_samples = _int("the dataset's length", n, 1)
        self.batch_size = _int("batch_size", batch_size, 1)
        self.seed = _int("seed", seed, 0)
        if seed >= 1 << 63:
            raise ValueError(f"seed must be below 2^63 (it is stored as int64), got {seed}")
        self.ledger_capacity = _int("ledger_capacity", ledger_capacity, 1)
        self.max_peers = _int("max_peers", max_peers, 1)
        self.used_log = None if used_log is None else Path(used_log)
        self.prefix = prefix
        self.order = EpochOrder(self.num_samples, self.seed)
        self._config = (self.num_samples, self.batch_size, self.seed)
        z = torch.zeros
        self._t: dict[str, torch.Tensor] = {
            "epoch": z(1, dtype=torch.int64),
            "cursor": z(1, dtype=torch.int64),
            "drawn": z(1, dtype=torch.int64),
            "ledger": z(self.ledger_capacity, 2, dtype=torch.int64),
            "ledger_count": z(1, dtype=torch.int64),
            "assigners": torch.full((self.max_peers,), -1, dtype=torch.int64),
            "config": torch.tensor(self._config, dtype=torch.int64),
        }
        self.attached = False
        self._session: SessionLike | None = None
        self.commits = 0
        self.last_used: list[int] = []
        """Dataset indices used by the last commit this peer saw (in order)."""

    # -- wiring ---------------------------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        """The shared tensors by registered name (the live objects, not copies)."""
        return {self.prefix + k: v for k, v in self._t.items()}

    def attach(self, session: SessionLike) -> None:
        """Register the shared tensors and :meth:`on_commit` as a commit hook with ``session``.

        Call it once, before the first round, in the same order relative to other shared state
        on every peer. Raises RuntimeError if already attached; the session raises if its first
        round has begun.
        """
        if self.attached:
            raise RuntimeError("ElasticSampler.attach called twice")
        for name, t in self.tensors().items():
            session.register(name, t)
        session.add_commit_hook(self.on_commit)
        self._session = session
        self.attached = True

    # -- reading the shared position ------------------------------------------------------------
    def _check_config(self) -> None:
        shared = tuple(int(v) for v in self._t["config"].tolist())
        if shared != self._config:
            raise ValueError(
                "this peer's ElasticSampler(num_samples, batch_size, seed) = "
                f"{self._config} but the run's is {shared}: every peer must use the same "
                "dataset, global batch size and seed"
            )

    @property
    def position(self) -> Position:
        """The shared position as plain ints (a snapshot)."""
        count = int(self._t["ledger_count"][0])
        rows = self._t["ledger"][:count].tolist()
        return Position(
            epoch=int(self._t["epoch"][0]),
            cursor=int(self._t["cursor"][0]),
            ledger=tuple((int(s), int(n)) for s, n in rows),
            assigners=tuple(int(p) for p in self._t["assigners"].tolist() if p >= 0),
        )

    def _store(self, pos: Position) -> None:
        if len(pos.ledger) > self.ledger_capacity:
            raise LedgerOverflow(
                f"the sampler owes {len(pos.ledger)} separate ranges of samples but its ledger "
                f"holds {self.ledger_capacity}: peers keep leaving rounds before their batches "
                f"count; create ElasticSampler(..., ledger_capacity=N) with a larger N on every "
                f"peer (a checkpoint taken with the old size cannot be loaded into it)"
            )
        if len(pos.assigners) > self.max_peers:
            raise ValueError(
                f"the round has {len(pos.assigners)} members but the sampler holds at most "
                f"{self.max_peers}: create ElasticSampler(..., max_peers=N) larger on every peer"
            )
        self._t["epoch"][0] = pos.epoch
        self._t["cursor"][0] = pos.cursor
        ledger = self._t["ledger"]
        ledger.zero_()  # unused rows stay zero, so equal positions hash equal
        if pos.ledger:
            ledger[: len(pos.ledger)] = torch.tensor(pos.ledger, dtype=torch.int64)
        self._t["ledger_count"][0] = len(pos.ledger)
        assigners = self._t["assigners"]
        assigners.fill_(-1)
        if pos.assigners:
            assigners[: len(pos.assigners)] = torch.tensor(pos.assigners, dtype=torch.int64)

    @property
    def epoch(self) -> int:
        """The oldest epoch with samples not yet used by a committed round."""
        return int(self._t["epoch"][0])

    @property
    def drawn(self) -> int:
        """Global batches handed out since the last commit (``t``)."""
        return int(self._t["drawn"][0])

    @property
    def batches_per_epoch(self) -> int:
        """Blocks in an epoch when no batch is lost: ``ceil(num_samples / batch_size)``."""
        return -(-self.num_samples // self.batch_size)

    def assignment(self, peer_id: int) -> tuple[int, int] | None:
        """``(rank, world)`` of ``peer_id`` among the assigners, or None if its work until the
        next commit cannot count (a joiner, a peer that re-registered, or any peer before the
        run's first commit): such a peer's batches are handed out again after the commit."""
        assigners = self.position.assigners
        if peer_id not in assigners:
            return None
        return assigners.index(peer_id), len(assigners)

    # -- drawing and committing -----------------------------------------------------------------
    def _indices_of(self, base_epoch: int, ranges: Sequence[Range]) -> list[tuple[int, list[int]]]:
        """Dataset indices of position ranges (relative to ``base_epoch``), grouped by epoch."""
        n = self.num_samples
        groups: list[tuple[int, list[int]]] = []
        for start, length in ranges:
            s, stop = start, start + length
            while s < stop:  # merged ranges may run on into the next epoch's positions
                e, off = divmod(s, n)
                end = min(stop, (e + 1) * n)
                idx = self.order(base_epoch + e, np.arange(off, off + end - s)).tolist()
                if groups and groups[-1][0] == base_epoch + e:
                    groups[-1][1].extend(idx)
                else:
                    groups.append((base_epoch + e, idx))
                s = end
        return groups

    def indices(
        self, rank: int, world: int, *, local_rank: int = 0, local_world: int = 1
    ) -> list[int]:
        """This peer's share of the next global batch: dataset indices, in order.

        Call once per training step, with this peer's rank and world size in the last round it
        was in. Each call draws the next block (``drawn`` rises by one). A block is
        ``batch_size`` samples split into ``world`` contiguous shares (the first
        ``batch_size % world`` ranks one larger); the last block of an epoch may be short, so a
        share may be small or even empty when the block is smaller than ``world``.

        On a peer that is an island of ``local_world`` ranks (each rank holds the sampler's
        shared state, and every rank calls this at every step), ``local_rank`` gets its part of
        the island's share, split the same way: the island's ranks together use the island's
        share once, whatever the island sizes of the run.

        Raises ValueError for ``rank`` outside ``[0, world)``, ``local_rank`` outside
        ``[0, local_world)``, or a run whose sampler settings differ from this peer's.
        """
        if not isinstance(world, int) or world < 1 or not isinstance(rank, int):
            raise ValueError(f"world must be an int >= 1 and rank an int, got {rank!r}, {world!r}")
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, world={world}), got {rank}")
        if not isinstance(local_world, int) or local_world < 1 or not 0 <= local_rank < local_world:
            raise ValueError(
                f"local_rank must be in [0, local_world={local_world}), got {local_rank}"
            )
        self._check_config()
        pos = self.position
        t = self.drawn if self.attached else 0
        block = draw(pos.ledger, pos.cursor, self.num_samples, self.batch_size, t + 1)[t]
        mine = share(share(block, rank, world), local_rank, local_world)
        out = [i for _, idx in self._indices_of(pos.epoch, mine) for i in idx]
        if self.attached:
            self._t["drawn"][0] = t + 1
        else:
            # No session: nobody else can fail, so the whole block is used at once.
            new, _ = commit(
                Position(pos.epoch, pos.cursor, pos.ledger, tuple(range(world))),
                n=self.num_samples,
                batch_size=self.batch_size,
                drawn=1,
                members=tuple(range(world)),
                resynced=(),
            )
            self._store(Position(new.epoch, new.cursor, new.ledger, pos.assigners))
        return out

    def on_commit(self, plan: PlanLike) -> None:
        """Account for a committed round this peer was a member of (the session's commit hook).

        Marks the contributors' shares of the ``drawn`` blocks used, puts every other drawn
        sample back in the ledger, sets the assigners to ``plan.members`` and ``drawn`` to 0,
        and advances the epoch when nothing of it is owed. Appends to ``used_log`` if set.

        Raises ValueError if the run's sampler settings differ from this peer's,
        :class:`LedgerOverflow` if too many separate ranges are owed; the shared tensors are
        left unchanged in both cases.
        """
        self._check_config()
        pos = self.position
        members = tuple(int(m) for m in plan.members)
        if not pos.assigners and getattr(self._session, "first_round_uses_work", False):
            # Before the run's first commit every peer drew as rank 0 of 1 (nobody knew the
            # membership) and the strategy trained on it (DDP): the whole blocks were used once.
            everyone = (-2,)
            new, used = commit(
                Position(pos.epoch, pos.cursor, pos.ledger, everyone),
                n=self.num_samples,
                batch_size=self.batch_size,
                drawn=self.drawn,
                members=everyone,
                resynced=frozenset(),
            )
            new = Position(new.epoch, new.cursor, new.ledger, members)
        else:
            new, used = commit(
                pos,
                n=self.num_samples,
                batch_size=self.batch_size,
                drawn=self.drawn,
                members=members,
                resynced=frozenset(int(p) for p in plan.resynced),
            )
        self._store(new)
        self._t["drawn"][0] = 0
        self.commits += 1
        groups = self._indices_of(pos.epoch, used)
        self.last_used = [i for _, idx in groups for i in idx]
        if self.used_log is not None:
            lines = [{"round": int(plan.round), "epoch": e, "used": idx} for e, idx in groups]
            if not lines:
                lines = [{"round": int(plan.round), "epoch": pos.epoch, "used": []}]
            with self.used_log.open("a") as f:
                f.writelines(json.dumps(line) + "\n" for line in lines)

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the shared tensors, keyed without the prefix (``epoch``, ``cursor``, ...)."""
        return {k: v.clone() for k, v in self._t.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Overwrite the shared tensors in place from :meth:`state_dict`'s output.

        Raises ValueError, leaving this sampler unchanged, for a missing or extra key, a shape
        or dtype that differs (another ``ledger_capacity`` or ``max_peers``), other settings
        (dataset length, batch size, seed), or an inconsistent position.
        """
        if set(state) != set(_FIELDS):
            raise ValueError(f"sampler state must have keys {sorted(_FIELDS)}, got {sorted(state)}")
        for k in _FIELDS:
            mine, theirs = self._t[k], state[k]
            if not isinstance(theirs, torch.Tensor) or theirs.shape != mine.shape:
                got = tuple(theirs.shape) if isinstance(theirs, torch.Tensor) else type(theirs)
                raise ValueError(
                    f"sampler state {k!r} has shape {got}, this sampler {tuple(mine.shape)}: "
                    f"create the sampler with the same ledger_capacity and max_peers"
                )
            if theirs.dtype != mine.dtype:
                raise ValueError(f"sampler state {k!r} is {theirs.dtype}, expected {mine.dtype}")
        cfg = tuple(int(v) for v in state["config"].tolist())
        if cfg != self._config:
            raise ValueError(
                f"the saved sampler had (num_samples, batch_size, seed) = {cfg}, this one "
                f"{self._config}: use the same dataset, global batch size and seed"
            )
        count = int(state["ledger_count"][0])
        if not 0 <= count <= self.ledger_capacity:
            raise ValueError(f"sampler state: ledger_count {count} out of range")
        rows = [(int(s), int(n)) for s, n in state["ledger"][:count].tolist()]
        cursor = int(state["cursor"][0])
        ends = [s + n for s, n in rows]
        ok = all(n > 0 and s >= 0 for s, n in rows) and all(
            ends[i] < rows[i + 1][0] for i in range(len(rows) - 1)
        )
        if not ok or (rows and ends[-1] >= cursor) or int(state["drawn"][0]) < 0:
            raise ValueError(
                "sampler state: the ledger is not sorted, disjoint and below the cursor"
            )
        if bool(state["ledger"][count:].any()) or int(state["epoch"][0]) < 0:
            raise ValueError("sampler state: unused ledger rows must be zero and epoch >= 0")
        for k in _FIELDS:
            self._t[k].copy_(state[k])
