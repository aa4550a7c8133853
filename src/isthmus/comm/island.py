"""Islands: a peer made of N local ranks (FSDP2, DDP or TP inside), one membership slot.

The user's script stays torchrun code: ``torch.distributed.init_process_group()`` from the
environment, then ``fully_shard`` (or DDP), then ``isthmus.Session(SessionConfig.from_env())``
on every rank. ``Session(...)`` finds the island from the default process group (or the
``island=`` group) and builds an :class:`IslandSession` on every rank when it holds several:

* **one slot.** Local rank 0 (the *leader*) registers with the coordinator, heartbeats, begins
  and commits rounds; the other ranks (*followers*) never speak to the coordinator about
  membership: they follow the leader's decisions, broadcast inside the island (registration,
  each round's plan, each round's outcome, a refusal). Every decision is taken by all ranks of
  the island together, in the same order, so the island acts as one peer.
* **traffic by shard.** Each local rank ``i`` builds its own cross-island group for every epoch,
  with rank ``i`` of every other island (on its own store prefix, ``.../epoch<N>/...rank<i>``),
  and runs the round's collectives on its own shard: all of an island's links work at once and
  nothing is gathered to the leader (the HSDP pattern). Islands of one run must have the same
  size for now (the leader checks it when an epoch connects); :mod:`isthmus.comm.layout` holds
  the owner mapping that unequal sizes need.
* **one outcome.** A round commits for the island only if every local rank succeeded: the ranks
  gather their outcomes and the leader reports one (naming each failing rank), then tells the
  followers what the coordinator answered. Byte counts are per rank (each rank's
  :attr:`Session.stats`) and per island (:attr:`IslandSession.island_bytes`, and the leader's
  heartbeats report the island's sum as the peer's ``bytes_sent``).
* **state by layout.** :class:`IslandState` holds each rank's shards with their
  :class:`~isthmus.comm.layout.Placement`; the schema sent to the coordinator carries the full
  shapes (islands whose state differs are refused naming the tensor, as single peers are), and
  every hash is the layout-independent hash summed over the island's ranks.

What happens on failure: a rank whose collective fails reports it through the island's outcome,
which aborts the round for everyone. A rank that dies breaks the island's own process group:
its other ranks' next island collective raises and the processes end, so the launcher restarts
the island as a whole. Not built yet (refused with an error naming it): islands of different
sizes in one run, resyncing a stale island (a joiner of a run that moved on), checkpoints and
restores, link probing.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from isthmus.comm.epoch import connect_epoch
from isthmus.comm.faults import FaultInjector
from isthmus.comm.group import CollectiveError, Group
from isthmus.comm.island_transfer import island_transfers
from isthmus.comm.layout import Placement, hash_hex, layout_hash
from isthmus.comm.session import Round, Session
from isthmus.comm.session_config import IslandDispatch, RoundFailed, SessionConfig
from isthmus.comm.state import SharedState
from isthmus.comm.transfer import TransferError
from isthmus.coordinator.protocol import RoundPlan, TensorSpec

__all__ = ["NPROC_VAR", "Island", "IslandSession", "IslandState", "find_island"]

NPROC_VAR = "ISTHMUS_NPROC_PER_PEER"
"""Set by ``isthmus run --nproc-per-peer N`` for every rank of a peer: how many ranks it has."""


class Island:
    """The local ranks of one peer: ``rank`` of ``size`` in ``group`` (None: the default
    group), with a Gloo group for the island's own decisions (the group itself when it is
    Gloo, else a new one over the same ranks)."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if dist.get_backend(group) == "gloo":
            self.control = group
        else:  # decisions are Python objects: they travel over Gloo, beside NCCL
            self.control = dist.new_group(dist.get_process_group_ranks(group), backend="gloo")

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def broadcast(self, obj: Any = None) -> Any:
        """The leader's ``obj`` on every rank (the followers' argument is ignored)."""
        box = [obj]
        dist.broadcast_object_list(box, group=self.control, group_src=0)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def mean(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The island's elementwise means of replicated floating tensors (fresh tensors, the
        same bits on every rank): what a rank's local copies of buffers contribute."""
        if self.size == 1 or not tensors:
            return tensors
        flat = torch.cat([t.detach().reshape(-1).to(torch.float64).cpu() for t in tensors])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.control)
        flat /= self.size
        out, off = [], 0
        for t in tensors:
            part = flat[off : off + t.numel()].view(t.shape).to(t.dtype).to(t.device)
            out.append(part)
            off += t.numel()
        return out

    def sum_int64(self, values: torch.Tensor) -> torch.Tensor:
        """The island's elementwise sum of an int64 tensor (wrapping mod 2**64)."""
        out = values.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.control)
        return out


def find_island(island: Any = None) -> Island | None:
    """The island of this process: ``island`` (a process group) or the default group when one
    is initialized; None for a plain peer (no group, or a group of one rank).

    Raises RuntimeError when the launcher started this process as one of several ranks of a
    peer (``isthmus run --nproc-per-peer N``) and no process group is initialized: the script
    must call ``torch.distributed.init_process_group()`` before building the session."""
    nproc = int(os.environ.get(NPROC_VAR, "1") or "1")
    if island is None and not (dist.is_available() and dist.is_initialized()):
        if nproc > 1:
            raise RuntimeError(
                f"this process is rank {os.environ.get('RANK', '?')} of a peer of {nproc} "
                f"ranks (isthmus run --nproc-per-peer {nproc}), but the script never called "
                "torch.distributed.init_process_group() before isthmus.Session(...): call "
                "it first (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set), or run "
                "with --nproc-per-peer 1"
            )
        return None
    size = dist.get_world_size(island)
    if nproc > 1 and size != nproc:
        raise RuntimeError(
            f"a rank of a peer of {nproc} ranks cannot register on its own: its island group "
            f"has {size} rank(s); pass the group of all {nproc} (or none: the default group)"
        )
    return Island(island) if size > 1 or island is not None else None


class IslandState(SharedState):
    """The shared state of one rank of an island: local shards with their placements.

    :meth:`schema` names full shapes; :meth:`prepare` (every rank together) computes the
    layout-independent hashes (:func:`~isthmus.comm.layout.layout_hash`, summed over the island)
    that :meth:`hashes` and :meth:`digest` then return. A replicated tensor (no placement)
    counts once, the leader's copy."""

    def __init__(self, island: Island) -> None:
        super().__init__()
        self.island = island
        self.placements: dict[str, Placement | None] = {}
        self._hashes: dict[str, str] | None = None

    def register(self, name: str, tensor: torch.Tensor, placement: Placement | None = None) -> None:
        """As :meth:`SharedState.register`; ``placement``: the part of the full tensor this rank
        holds (None: all of it, replicated on every rank). Raises ValueError when the placement
        does not match the tensor's size."""
        if placement is not None and placement.numel != tensor.numel():
            raise ValueError(
                f"shared tensor {name!r}: {tensor.numel()} elements, its placement says "
                f"{placement.numel}"
            )
        super().register(name, tensor)
        self.placements[name] = placement

    def unregister_prefix(self, prefix: str) -> None:
        super().unregister_prefix(prefix)
        self.placements = {n: p for n, p in self.placements.items() if n in self}

    def full_shape(self, name: str) -> tuple[int, ...]:
        p = self.placements.get(name)
        return tuple(self[name].shape) if p is None else p.full_shape

    def schema(self) -> list[TensorSpec]:
        return [TensorSpec(n, self.full_shape(n), str(t.dtype)) for n, t in self.items()]

    def prepare(self) -> dict[str, str]:
        """Hash the island's state (every rank calls it at the same point); returns the hashes."""
        mine = []
        for n, t in self.items():
            p = self.placements[n]
            counts = p is not None or self.island.leader
            mine.append(layout_hash(t, p) if counts else 0)
        totals = self.island.sum_int64(torch.tensor(mine, dtype=torch.int64)).tolist()
        self._hashes = {
            n: hash_hex(h, self.full_shape(n), str(t.dtype))
            for (n, t), h in zip(self.items(), totals, strict=True)
        }
        return dict(self._hashes)

    def hashes(self) -> dict[str, str]:
        if self._hashes is None:
            raise RuntimeError("an island's hashes are computed by all its ranks: prepare() first")
        return dict(self._hashes)

    def digest(self) -> str:
        """One hash of the whole state as of the last :meth:`prepare` (names and hashes): the
        same on every rank of every island that holds the same full state."""
        import xxhash

        h = xxhash.xxh3_64()
        for n, v in self.hashes().items():
            h.update(f"{n}={v};".encode())
        return h.hexdigest()

    def gathered(self) -> dict[str, torch.Tensor]:
        """The full tensors, assembled from every rank's shards (every rank calls it; meant for
        checks and exports of small states: each rank ends holding all of it). Raises
        ValueError naming a replicated tensor whose copies differ between ranks."""
        mine = {n: (t.detach().cpu(), self.placements[n]) for n, t in self.items()}
        ranks = self.island.gather(mine)
        out: dict[str, torch.Tensor] = {}
        for n, t in self.items():
            if self.placements[n] is None:
                copies = [r[n][0] for r in ranks]
                differ = [i for i, c in enumerate(copies) if not torch.equal(c, copies[0])]
                if differ:
                    raise ValueError(
                        f"replicated tensor {n!r} differs between the island's ranks 0 and "
                        f"{differ}: its ranks did not apply the same update"
                    )
                out[n] = copies[0].clone()
                continue
            full = torch.empty(self.full_shape(n), dtype=t.dtype).reshape(-1)
            for shard, p in (r[n] for r in ranks):
                full[p.start : p.stop] = shard.reshape(-1)
            out[n] = full.view(self.full_shape(n))
        return out


class IslandSession(Session):
    """The session of one rank of an island (see the module docstring). Built by
    ``Session(config)`` on every rank; the same API as a plain :class:`Session`, plus
    :attr:`island` and :attr:`island_bytes`. ``config.probe_links`` is refused (not built for
    islands yet)."""

    def __init__(
        self, config: SessionConfig, *, faults: FaultInjector | None = None, island: Any = None
    ) -> None:
        found = find_island(island)
        if found is None:  # an explicit group of one rank: an island of one
            found = Island(island)
        if config.probe_links:
            raise ValueError("probe_links is not built for islands yet: leave it off")
        self.island = found
        self.island_bytes: list[int] = [0] * found.size
        """Bytes each local rank sent across islands, as of the last round's outcome."""
        self._asking = False
        super().__init__(config, faults=faults)
        self.state = IslandState(found)

    # -- the island's decisions ---------------------------------------------------------------
    def _tell(self, kind: str, payload: Any = None) -> None:
        self.island.broadcast((kind, payload))

    def _hear(self) -> tuple[str, Any]:
        kind, payload = self.island.broadcast()
        if kind == "error":
            raise payload
        return kind, payload

    def _register(self) -> None:
        if not self.island.leader:
            _kind, reply = self._hear()
            self._adopt(reply)
            return
        try:
            info: dict[str, Any] = {"pid": os.getpid(), "host": os.uname().nodename}
            info["island"] = {"size": self.island.size}
            if self.reach.address is not None:
                info["probe"] = self.reach.address
            reply = self._client.register(self.name, info)
        except BaseException as e:
            self._tell("error", e)
            raise
        self._tell("registered", reply)
        self._adopt(reply)
        self._client.start_heartbeat(
            self.peer_id or 0,
            reply.heartbeat_interval,
            self._heartbeat_info,
            self._on_push,
            run_id=self.run_id,
        )

    def _adopt(self, reply: Any) -> None:
        from isthmus.comm.connect import rendezvous

        self.peer_id = reply.peer_id
        self.run_id = reply.run_id
        self.parity_every = reply.parity_every
        self.restore_point = reply.restore
        self._fresh = True
        self._set_group(None)
        self._stores = rendezvous(
            self._client, reply, self.peer_id or 0, self.run_id, self.config.collective_timeout
        )

    def _heartbeat_info(self) -> dict[str, Any]:
        info = super()._heartbeat_info()
        info["island"] = {"size": self.island.size, "bytes_sent": list(self.island_bytes)}
        info["bytes_sent"] = sum(self.island_bytes)  # the peer's figure is the island's
        return info

    def report(self, **info: Any) -> None:
        if self.island.leader:
            super().report(**info)

    # -- rounds ---------------------------------------------------------------------------------
    def _ask_for_round(self, deadline: float) -> RoundPlan | None:
        self.state.prepare()  # every rank: the hashes the leader may be asked for
        if not self.island.leader:
            while True:
                kind, payload = self._hear()
                if kind == "registered":  # the leader was evicted and registered again
                    self._adopt(payload)
                    continue
                return payload  # type: ignore[no-any-return]
        self._asking = True
        try:
            plan = super()._ask_for_round(deadline)
        except BaseException as e:
            self._tell("error", e)
            raise
        finally:
            self._asking = False
        self._tell("plan", plan)
        return plan

    def begin(self) -> Round:
        """As :meth:`Session.begin`, on every rank of the island together: the round is set
        up (each rank's cross-island group connected) on all of them or reported failed."""
        if self._closed:
            raise RuntimeError("session is closed")
        self._graveyard.reap()
        deadline = time.monotonic() + self.config.round_timeout
        for _attempt in range(self.config.max_attempts):
            plan = self._ask_for_round(deadline)
            if plan is None:
                continue
            t0 = time.monotonic()
            error = ""
            try:
                group = self._group_for(plan)
            except (CollectiveError, TransferError) as e:
                error = str(e)
            if plan.transfers and not error:  # every rank: the island's verdict is collective
                try:
                    island_transfers(group, plan, self.state, self.peer_id or 0)
                    if self.peer_id in plan.resynced:
                        self.revision = plan.round
                except (CollectiveError, TransferError) as e:
                    error = str(e)
            if error or not all(ok for ok in self.island.gather(not error)):
                self._report_outcome(plan, ok=not error, error=error, t0=t0, stage="setup")
                continue
            self.rank, self.world = group.rank, group.world
            return Round(self, plan, group, t0)
        raise RoundFailed(f"round could not be set up in {self.config.max_attempts} attempts")

    def _group_for(self, plan: RoundPlan) -> Group:
        name = f"epoch{plan.epoch}"
        g = self._group
        reuse = g is not None and g.name == name and not g.aborted
        # together: a rank whose group was aborted must not reconnect alone
        if all(self.island.gather(reuse)):
            assert g is not None
            return g
        # The leader connects first and checks the islands' sizes with its peers (every island
        # has a rank 0); only then do the followers connect theirs, which would otherwise wait
        # for ranks that an island of another size does not have.
        if self.island.leader:
            try:
                g = self._connect(plan)
                sizes = g.all_gather_flat(torch.tensor([float(self.island.size)]))
                sizes = [int(s) for s in sizes.tolist()]
                if len(set(sizes)) > 1:
                    raise RoundFailed(
                        f"islands of different sizes in one run ({sizes} ranks) are not built "
                        "yet: give every peer the same --nproc-per-peer"
                    )
            except BaseException as e:
                self._tell("error", e)
                raise
            self._tell("connected")
            return g
        self._hear()
        return self._connect(plan)

    def _connect(self, plan: RoundPlan) -> Group:
        g, _agreed = connect_epoch(
            plan,
            peer_id=self.peer_id or 0,
            owner=f"{self.name}.rank{self.island.rank}",
            # each local rank meets the same rank of the other islands on a prefix of its own
            run_id=f"{self.run_id}/island-rank{self.island.rank}",
            config=self.config,
            backend=self._backend(),
            stats=self.stats,
            stores=self._stores,  # type: ignore[arg-type]
            aborted=lambda: plan.epoch in self._aborted_epochs,
            graveyard=self._graveyard,
            reach_source=self.reach.source if self.island.leader else None,
        )
        self._set_group(g)
        if plan.epoch in self._aborted_epochs:
            g.abort(f"epoch {plan.epoch} was aborted")
        return g

    def _report_outcome(
        self,
        plan: RoundPlan,
        *,
        ok: bool,
        error: str,
        t0: float,
        stage: str = "round",
        cause: BaseException | None = None,
    ) -> bool:
        outcomes = self.island.gather((ok, error, self.stats.bytes_sent))
        self.island_bytes = [int(b) for _, _, b in outcomes]
        all_ok = all(o for o, _, _ in outcomes)
        failed = [(i, e) for i, (o, e, _) in enumerate(outcomes) if not o]
        if len({e for _, e in failed}) == 1 and len(failed) == self.island.size:
            why = failed[0][1]  # the island's own verdict (a resync), the same on every rank
        else:
            why = "; ".join(f"rank {i}: {e}" for i, e in failed)
        if self.island.leader:
            try:
                committed = super()._report_outcome(
                    plan, ok=all_ok, error=why, t0=t0, stage=stage, cause=None if ok else cause
                )
            except BaseException as e:
                self._tell("error", e)
                raise
            self._tell("outcome", committed)
            return committed
        _, committed = self._hear()
        if committed:
            self.revision = plan.round + 1
            for hook in self._commit_hooks:
                hook(plan)
        else:
            with self._push_lock:
                self._aborted_epochs.add(plan.epoch)
            if self._group is not None and self._group.name == f"epoch{plan.epoch}":
                self._group.abort(f"round {plan.round} aborted: {why}")
        self.rounds.append(
            {
                "round": plan.round,
                "epoch": plan.epoch,
                "world": len(plan.members),
                "outcome": "committed" if committed else "aborted",
                "stage": stage,
                "bytes_sent": self.stats.bytes_sent,
            }
        )
        return bool(committed)

    def close(self, *, leave: bool = True) -> None:
        """Leave the run (every rank together: the final digest is the island's)."""
        if self._closed:
            return
        if leave and not self._asking:
            self.state.prepare()
        super().close(leave=leave and self.island.leader)


def _session_class(island: Any) -> type[Session] | None:
    """A rank of an island builds an :class:`IslandSession` (an explicit ``island=`` group
    always: even of one rank)."""
    return IslandSession if island is not None or find_island(None) is not None else None


IslandDispatch.island_factory = _session_class
