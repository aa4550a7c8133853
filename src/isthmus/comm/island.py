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
* **traffic by shard.** The leaders connect first and compare their islands' sizes. With equal
  sizes each local rank ``i`` builds one cross-island group per epoch, with rank ``i`` of every
  other island (on a store prefix of its own, ``isthmus/<run>/island-rank<i>/epoch<N>/``), and
  runs the round's collectives on its own shards: all of an island's links work at once and
  nothing is gathered to the leader (the HSDP pattern). With different sizes, the owner mapping
  of :mod:`isthmus.comm.layout` gives one group per tuple of owners (``island-g<a>-<b>...``):
  each rank joins those it is part of, in one order everywhere, and :attr:`Round.pieces` maps
  each to its group; a strategy exchanges there the elements that tuple owns.
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
which aborts the round for everyone. Every rank watches the others
(:mod:`isthmus.comm.island_watch`): a rank that dies or is SIGSTOPped is silent, and after the
coordinator's ``heartbeat_timeout`` the ranks that notice exit with :data:`ISLAND_LOST_EXIT`
(nothing else can interrupt a collective blocked on a stopped process), so the launcher's agent
(or torchrun) stops the rest, the leader's heartbeats and every group's sockets end with them,
the other islands abort and retry the round, and ``--max-restarts`` starts the island again as
a whole; it rejoins and is resynced shard by shard (:mod:`isthmus.comm.island_transfer`). The
coordinator's round aborts reach the leader; it relays them to its followers over the same
channel, so every rank cuts its own cross-island groups at once; the other way, each
follower's transfer (whether it moves, the members its data does not reach) reaches the leader
there, and the leader's heartbeats carry the island's merge, so that a link cut between two
followers after the data was handed over aborts the round as it does between plain peers
(docs/PROTOCOL.md, "A link cut after the data was handed over"); a failure that names the
member a rank could not reach (a silent connection's remote) names it in the island's report,
so that a cut between followers marks the pair of islands down; every rank's probe listener
is registered, and a down pair of islands is probed rank to rank
(:mod:`isthmus.comm.island_probe`), so the pair stays down while that path is cut. A
coordinator's ``restore`` reaches the leader; it tells the followers, and every rank loads its
part of the checkpoint together. Not built yet (refused with an error naming it): link probing.
"""

from __future__ import annotations

import functools
import os
import pickle
import time
from typing import Any

import torch

from isthmus.comm.epoch import connect_epoch
from isthmus.comm.faults import FaultInjector
from isthmus.comm.group import CollectiveError, Group
from isthmus.comm.island_probe import IslandProber, group_addresses, rank_unreached
from isthmus.comm.island_state import NPROC_VAR, Island, IslandState, find_island
from isthmus.comm.island_transfer import island_transfers
from isthmus.comm.island_watch import (
    ISLAND_LOST_EXIT,
    IslandWatch,
    bind_watch,
    island_lost,
    island_transfer,
)
from isthmus.comm.layout import piece_groups
from isthmus.comm.session import Round, Session
from isthmus.comm.session_config import IslandDispatch, RoundFailed, SessionConfig
from isthmus.comm.transfer import TransferError
from isthmus.comm.unacked import Groups, transfer_info
from isthmus.coordinator import protocol as msgs
from isthmus.coordinator.protocol import RoundPlan

__all__ = [
    "ISLAND_LOST_EXIT",
    "NPROC_VAR",
    "Island",
    "IslandSession",
    "IslandState",
    "find_island",
]


class IslandSession(Session):
    """The session of one rank of an island (see the module docstring). Built by
    ``Session(config)`` on every rank; the same API as a plain :class:`Session`, plus
    :attr:`island` and :attr:`island_bytes`. ``config.probe_links`` is refused with a
    ValueError (not built for islands yet). Checkpoints (``checkpoint_dir``, ``resume``, a
    coordinator's restore) are written and loaded by every rank
    (:mod:`isthmus.checkpoint.island`)."""

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
        self._watch: IslandWatch | None = None
        self._extra: list[Group] = []  # this epoch's other groups (islands of other sizes)
        self._listeners: list[str | None] | None = None  # every rank's probe listener
        # rank-to-rank probes (its reach and watch are set once they exist); a follower's
        # answer comes over the watch, a few seconds at most after its probes' bound
        shapes, limit = (lambda: self.state.sharded_shapes()), config.probe_timeout + 5.0
        self._prober = IslandProber(size=found.size, shapes=shapes, limit_s=limit)
        self._reach_of: dict[int, str] = {}  # the listeners of the ranks rank i's group holds
        # the (epoch, round) whose outcome this rank has reached: its own part is done
        self._rank_done: tuple[int, int] | None = None
        self.island_sizes: list[int] = []
        """The sizes of the islands of the current epoch, in member order."""
        self.pieces: dict[tuple[int, ...], Group] | None = None
        """With islands of different sizes: this rank's cross-island group for each tuple of
        owners it is part of (:func:`~isthmus.comm.layout.piece_groups`); None when every
        island has this one's size (then :attr:`Round.group` is rank i's group)."""
        super().__init__(config, faults=faults)
        self.state = IslandState(found)

    # -- the island's decisions ---------------------------------------------------------------
    def _tell(self, kind: str, payload: Any = None) -> None:
        if isinstance(payload, BaseException):  # raised again on every follower: must travel
            try:
                pickle.loads(pickle.dumps(payload))
            except Exception:
                payload = RuntimeError(f"{type(payload).__name__}: {payload}")
        self.island.broadcast((kind, payload))

    def _hear(self) -> tuple[str, Any]:
        kind, payload = self.island.broadcast()
        if kind == "error":
            raise payload
        return kind, payload

    def _register(self) -> None:
        if self._listeners is None:  # once, every rank (a leader registering again is alone)
            self._listeners = self.island.gather(self.reach.address)
            self._prober.reach = self.reach
        if not self.island.leader:
            _kind, reply = self._hear()
            self._adopt(reply)
            return
        try:
            info: dict[str, Any] = {"pid": os.getpid(), "host": os.uname().nodename}
            info["island"] = {"size": self.island.size}
            if all(self._listeners):  # the coordinator probes a down pair of islands rank to rank
                info["rank_probes"] = list(self._listeners)
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
        if self._watch is None and self.island.size > 1:  # every rank, at its first registration
            sock, address = bind_watch()
            timeout = reply.heartbeat_timeout or 5.0  # a rank is held to a peer's bound
            self._watch = IslandWatch(
                self.island.rank,
                sock,
                self.island.gather(address),
                interval=min(reply.heartbeat_interval, timeout / 3),
                timeout=timeout,
                on_lost=functools.partial(island_lost, f"{self.name} rank {self.island.rank}"),
                on_abort=self._relayed_abort,
                status=None if self.island.leader else self._rank_transfer,
                on_probe=self._prober.asked,
                on_probed=self._prober.answered,
            )
            self._prober.watch = self._watch

    def _relayed_abort(self, epoch: int, rnd: int, reason: str) -> None:
        self._on_push(msgs.AbortPush(reason=reason, epoch=epoch, round=rnd))

    def _rank_transfer(self) -> dict[str, Any] | None:
        """What this rank's cross-island connections say of the round (``info.transfer`` as
        :func:`~isthmus.comm.unacked.transfer_info` makes it), over every group of the epoch
        the rank is in (beside islands of other sizes, several, seen as one:
        :class:`~isthmus.comm.unacked.Groups`): sent to the leader with each beat, or merged by
        it. A rank that reached the round's outcome has nothing more to send: it moves only
        while one of its groups' transfers still does, not as one about to transfer would."""
        plan, g = self._in_round, self._group
        groups = None
        if g is not None:
            groups = Groups([g, *(x for x in list(self._extra) if x.epoch == g.epoch)])
        info = transfer_info(plan, groups)
        if plan is not None and info is not None and self._rank_done == (plan.epoch, plan.round):
            # transfer_info asked the groups whether they move only where one is busy
            info["moving"] = bool(info["moving"]) and groups is not None and groups.busy()
        return info

    def _transfer_info(self) -> dict[str, Any] | None:
        # the island's transfer: every rank's (the followers' relayed over the watch), the
        # leader's own worked out once a heartbeat
        followers = self._watch.transfers() if self._watch is not None else {}
        return island_transfer(self._rank_transfer(), followers, self.island.size)

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
                if kind == "restore":  # the run restarts from a checkpoint: every rank loads
                    super()._restore(*payload)
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

    def _restore(self, point: Any, reason: str) -> None:
        # the leader heard it; loading a checkpoint is the island's (every rank its part)
        self._tell("restore", (point, reason))
        super()._restore(point, reason)

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
            t0, self._in_round = time.monotonic(), plan  # on every rank: its heartbeat's round
            error, cause = "", None
            try:
                group = self._group_for(plan)
            except (CollectiveError, TransferError) as e:
                error, cause = str(e), e
            # every rank together, whether or not its own group connected (a follower's may fail
            # alone: a cut between followers): a rank that skipped the transfers, or this
            # gather, would meet the others' collectives with a different one
            connected = all(self.island.gather(not error))
            if plan.transfers and connected:  # every rank: the island's verdict is collective
                try:
                    island_transfers(
                        group,
                        plan,
                        self.state,
                        self.peer_id or 0,
                        pieces=self.pieces,
                        sizes=self.island_sizes,
                    )
                    if self.peer_id in plan.resynced:
                        self.revision = plan.round
                except (CollectiveError, TransferError) as e:
                    error, cause = str(e), e  # on every rank (the verdict is the island's)
            if error or not connected:
                self._report_outcome(
                    plan, ok=not error, error=error, t0=t0, stage="setup", cause=cause
                )
                continue
            self.rank, self.world = group.rank, group.world
            rnd = Round(self, plan, group, t0)
            rnd.pieces = self.pieces  # type: ignore[attr-defined]
            return rnd
        raise RoundFailed(f"round could not be set up in {self.config.max_attempts} attempts")

    def _group_for(self, plan: RoundPlan) -> Group:
        name = f"epoch{plan.epoch}"
        g = self._group
        reuse = g is not None and g.name == name and not g.aborted
        # together: a rank whose group was aborted must not reconnect alone
        if all(self.island.gather(reuse)):
            assert g is not None
            return g
        # The leaders connect first (every island has a rank 0) and compare the islands' sizes;
        # only then do the other ranks connect theirs, which depend on the sizes.
        if self.island.leader:
            try:
                g = self._connect(plan, (0,) * len(plan.members))
                sizes = g.all_gather_flat(torch.tensor([float(self.island.size)]))
                sizes = [int(s) for s in sizes.tolist()]
            except BaseException as e:
                self._tell("error", e)
                raise
            self._tell("sizes", sizes)
        else:
            _, sizes = self._hear()
        self.island_sizes = sizes
        self.pieces = None
        if len(set(sizes)) == 1:  # rank i meets rank i of every other island
            if not self.island.leader:
                g = self._connect(plan, (self.island.rank,) * len(plan.members))
            self._set_group(g)
            return g
        # Islands of different sizes: one group per tuple of owners (comm/layout.py), connected
        # in the same order everywhere, so that no two ranks wait for each other in a cycle.
        shapes = self.state.sharded_shapes()
        me = plan.rank_of(self.peer_id or 0)
        pieces: dict[tuple[int, ...], Group] = {}
        for owners in piece_groups(shapes, sizes):
            if owners[me] != self.island.rank:
                continue
            if self.island.leader and not any(owners):
                pieces[owners] = g  # rank 0 of every island: the group the leaders just made
            else:
                pieces[owners] = self._connect(plan, owners, piece=True)
        if not pieces:
            raise RoundFailed(
                f"rank {self.island.rank} of an island of {self.island.size} holds no part of "
                f"the shared state beside islands of {sizes} ranks: nothing to exchange"
            )
        primary, *extra = pieces.values()
        self._set_group(primary)
        self._extra = extra
        self.pieces = pieces
        return primary

    def _connect(self, plan: RoundPlan, owners: tuple[int, ...], *, piece: bool = False) -> Group:
        key = "g" + "-".join(map(str, owners)) if piece else f"rank{owners[0]}"
        reach = group_addresses(plan, self.peer_id or 0, owners)
        self._reach_of = {} if piece else reach  # where a silent connection's remote is named
        g, _agreed = connect_epoch(
            plan,
            peer_id=self.peer_id or 0,
            owner=f"{self.name}.rank{self.island.rank}",
            # each set of ranks (one per island) meets on a store prefix of its own
            run_id=f"{self.run_id}/island-{key}",
            config=self.config,
            backend=self._backend(),
            stats=self.stats,
            stores=self._stores,  # type: ignore[arg-type]
            aborted=lambda: plan.epoch in self._aborted_epochs,
            graveyard=self._graveyard,
            reach_source=self.reach.source,
            reach=reach,
        )
        if plan.epoch in self._aborted_epochs:
            g.abort(f"epoch {plan.epoch} was aborted")
        return g

    def _set_group(self, g: Group | None) -> None:
        # a new epoch (or none): the other groups of the old one are retired with it
        if g is not self._group:
            self._abort_extra("superseded by a new epoch", park=True)
        super()._set_group(g)

    def _abort_extra(self, reason: str, *, park: bool = False) -> None:
        for x in self._extra:
            x.abort(reason)
            if park:
                self._graveyard.park(x)
        if park:
            self._extra = []

    def _on_push(self, msg: Any) -> None:
        if isinstance(msg, msgs.ProbePush) and self._prober.start(msg):
            return  # probed rank to rank: one outcome when every rank has answered
        super()._on_push(msg)
        if isinstance(msg, msgs.AbortPush) and self.island.leader and self._watch is not None:
            self._watch.tell_abort(msg.epoch, msg.round, msg.reason)  # followers cut theirs too
        g = self._group
        if isinstance(msg, msgs.AbortPush) and g is not None and g.name == f"epoch{msg.epoch}":
            self._abort_extra(f"round {msg.round} aborted by the coordinator: {msg.reason}")

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
        self._rank_done = (plan.epoch, plan.round)
        # the members this rank's failure names (a silent connection's remote, by its rank in
        # the round plan's order, which every cross-island group keeps): a cut between two
        # followers is named by them only, the leaders' connections being clean
        named = tuple(getattr(cause, "unreached", ()) or ()) if not ok else ()
        named = rank_unreached(named, plan, self._reach_of)  # at the listener of that rank
        outcomes = self.island.gather((ok, error, self.stats.bytes_sent, named))
        self.island_bytes = [int(b) for _, _, b, _ in outcomes]
        all_ok = all(o for o, _, _, _ in outcomes)
        failed = [(i, e) for i, (o, e, _, _) in enumerate(outcomes) if not o]
        if len({e for _, e in failed}) == 1 and len(failed) == self.island.size:
            why = failed[0][1]  # the island's own verdict (a resync), the same on every rank
        else:
            why = "; ".join(f"rank {i}: {e}" for i, e in failed)
        if self.island.leader:
            unreached = list(dict.fromkeys(u for *_, us in outcomes for u in us))
            failure = CollectiveError(why, unreached=unreached) if unreached else cause
            try:
                committed = super()._report_outcome(
                    plan,
                    ok=all_ok,
                    error=why,
                    t0=t0,
                    stage=stage,
                    cause=None if all_ok else failure,
                )
            except BaseException as e:
                self._tell("error", e)
                raise
            self._tell("outcome", committed)
            if not committed:
                self._abort_extra(f"round {plan.round} aborted")
            return committed
        _, committed = self._hear()
        self._in_round = None  # the island reported (the leader's report cleared its own)
        if not committed:
            self._abort_extra(f"round {plan.round} aborted")
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
        if self._watch is not None:  # this rank's exit is no failure of the island
            self._watch.close()
        if leave and not self._asking:
            self.state.prepare()
        super().close(leave=leave and self.island.leader)


def _session_class(island: Any) -> type[Session] | None:
    """A rank of an island builds an :class:`IslandSession` (an explicit ``island=`` group
    always: even of one rank)."""
    return IslandSession if island is not None or find_island(None) is not None else None


IslandDispatch.island_factory = _session_class
