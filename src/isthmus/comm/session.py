"""The peer side of a run: membership, per-epoch process groups, rounds, parity, resync.

A :class:`Session` registers with the coordinator, keeps a heartbeat, and runs *rounds*:

1. :meth:`Session.begin` tells the coordinator this peer is ready and blocks (bounded) until the
   round forms. If the membership changed it builds a fresh process group for the new epoch on a
   per-epoch store prefix (for the run's first round, when it transfers nothing, behind the
   round instead: :mod:`isthmus.comm.ahead`); if the plan says this peer's state is stale (a joiner, a resumed peer,
   a corrupted tensor) it receives the differing tensors from an in-sync peer and verifies them.
2. The caller runs the round's collectives through :attr:`Round.group` (bounded, abortable).
3. :meth:`Round.commit` reports success or failure; it returns True only when *every* member
   succeeded. Only then may the caller apply the round's result. On False the caller discards it
   and begins again: the survivors form a new epoch and retry the same round.

:meth:`Session.run_round` wraps that loop for the common case.

What happens on failure: a collective that fails or is aborted raises
:class:`~isthmus.comm.group.CollectiveError` (the round runner reports it and retries). When the
coordinator aborts a round (a member died or went silent), the epoch's connections are shut down
(:mod:`isthmus.comm.wires`), so a collective waiting on a silent member raises at once instead of
sitting out ``collective_timeout``; groups and connection attempts left behind are parked until
torch is done with them (:class:`~isthmus.comm.connect.Graveyard`). A peer
evicted by the coordinator (it was stopped or cut off) registers again and is resynced before it
takes part; a peer whose shared-state schema differs from the run's gets :class:`StateMismatch`
and the run goes on without it; a coordinator that cannot be reached raises
:class:`~isthmus.coordinator.client.CoordinatorUnreachable`; every wait is bounded by
``connect_timeout``, ``collective_timeout`` or ``round_timeout``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from isthmus.comm.ahead import ConnectsAhead, GroupAhead, connects_ahead
from isthmus.comm.connect import Graveyard, Rendezvous, rendezvous
from isthmus.comm.epoch import connect_epoch
from isthmus.comm.faults import Fault, FaultInjector
from isthmus.comm.group import CollectiveError, CommStats, Group, transfer_info
from isthmus.comm.mesh_agent import MeshAgent
from isthmus.comm.peer_reach import PeerReach
from isthmus.comm.probe import LinkProber
from isthmus.comm.round import Round
from isthmus.comm.session_config import (
    IslandDispatch,
    RoundFailed,
    RoundTimeout,
    RunFinished,
    SessionConfig,
    StateMismatch,
)
from isthmus.comm.state import SharedState
from isthmus.comm.transfer import TransferError, apply_transfers
from isthmus.comm.vote import PendingVote, UndoCopy, VoteAhead
from isthmus.coordinator import protocol as msgs
from isthmus.coordinator.client import CoordinatorClient, CoordinatorError
from isthmus.coordinator.protocol import RestorePoint, RoundPlan
from isthmus.coordinator.wire import encode

__all__ = [
    "Round",
    "RoundFailed",
    "RoundTimeout",
    "RunFinished",
    "Session",
    "SessionConfig",
    "StateMismatch",
]

log = logging.getLogger("isthmus.session")
T = TypeVar("T")
ROUND_HISTORY = 10_000
"""How many round attempts a session remembers in :attr:`Session.rounds` (a small dict each)."""


def _default_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Session(IslandDispatch, VoteAhead, ConnectsAhead):
    """A peer's membership in one run. Create it, register shared state, run rounds, close.

    ``Session(config)`` connects and registers at once, so a wrong address or token fails here
    with a clear error. Use it as a context manager (or call :meth:`close`) to leave cleanly.
    """

    def __init__(self, config: SessionConfig, *, faults: FaultInjector | None = None) -> None:
        self.config = config
        self.faults = faults or FaultInjector([Fault.parse(f) for f in config.faults])
        self.name = config.name or _default_name()
        self.state = SharedState()
        self.stats = CommStats()
        self.revision = 0
        self.peer_id: int | None = None
        self.run_id = ""
        self.parity_every = 1
        self.rounds: collections.deque[dict[str, Any]] = collections.deque(maxlen=ROUND_HISTORY)
        """The last :data:`ROUND_HISTORY` round attempts (round, epoch, world, outcome, bytes...):
        bounded, so that a run of days does not grow by a record per round."""
        self.info: dict[str, Any] = {}
        self.evictions = 0
        self.restores = 0
        self.restore_point: RestorePoint | None = None
        """The checkpoint the coordinator told this peer to load before its first round (the run
        restarts from it: no live peer holds its state); None: none. A strategy loads it."""
        self.restore_handler: Callable[[RestorePoint], int] | None = None
        """Loads a checkpoint's shared state into this session mid-run and returns its revision;
        set by the strategy built on the session (the checkpoint layer lives above this one)."""
        self._last_by_op: dict[str, int] = {}
        self.rank = 0  # this peer's rank and the world size in the latest round (for data sharding)
        self.world = 1
        self._commit_hooks: list[Callable[[RoundPlan], None]] = []
        self._deferrable_hooks = True  # every commit hook may run once a vote settles
        self._vote: PendingVote | None = None  # a round applied tentatively (pipeline_commit)
        self._undo = UndoCopy()
        self._void = False  # undid a tentative round: local work since then does not count
        self.prober = LinkProber(
            enabled=config.probe_links, cap=config.probe_bytes, owner=self.name
        )
        """Measures the links to the other members when membership changes (``probe_links``)."""
        self._tensorboard: Any = None  # a SummaryWriter, made at the first log_scalars
        self._client = CoordinatorClient(
            config.coordinator, config.token, **config.client_options()
        )
        self._stores: Rendezvous | None = None
        self._group: Group | None = None
        self._ahead: GroupAhead | None = None  # the epoch's group connecting behind round 0
        self._in_round: RoundPlan | None = None  # from a round's go to this peer's report
        # Abandoned groups and connection attempts, held until torch is done with them.
        self._graveyard = Graveyard()
        self._aborted_epochs: set[int] = set()
        self._push_lock = threading.Lock()
        self._fresh = True  # never began a round since (re)registering: send schema and hashes
        self._closed = False
        self.mesh, self.config = MeshAgent.for_session(self._client, config, self.name)  # overlay
        self.reach = PeerReach.for_session(self.config, self.name)  # probes: comm/peer_reach.py
        try:
            self._register()
        except BaseException:
            self.reach.close()
            self._client.close()
            MeshAgent.close_if(self.mesh)
            raise

    # -- registration, heartbeat, pushes --------------------------------------------------------
    def _register(self) -> None:
        info: dict[str, Any] = {"pid": os.getpid(), "host": socket.gethostname()}
        info.update(MeshAgent.info_of(self.mesh))  # the mesh lists its key while this peer lives
        if self.reach.address is not None:
            info["probe"] = self.reach.address
        reply = self._client.register(self.name, info)
        self.peer_id = reply.peer_id
        self.run_id = reply.run_id
        self.parity_every = reply.parity_every
        self.restore_point = reply.restore
        self._carry_votes = msgs.VOTE_IN_BEGIN in reply.features  # one request per round
        self._fresh = True
        self._drop_ahead("the peer registered again")
        self._set_group(None)
        # Each epoch gets a client of its own of this store (see isthmus.comm.connect).
        self._stores = rendezvous(
            self._client, reply, self.peer_id, self.run_id, self.config.collective_timeout
        )
        hb = (reply.heartbeat_interval, self._heartbeat_info, self._on_push)
        self._client.start_heartbeat(self.peer_id, *hb, run_id=self.run_id)
        log.info("%s registered as peer %d of run %s", self.name, self.peer_id, self.run_id)

    def _heartbeat_info(self) -> dict[str, Any]:
        info = {
            **self.info,
            "revision": self.revision,
            "bytes_sent": self.stats.bytes_sent,
            "bytes_by_op": dict(self.stats.by_op),
            "parked_groups": len(self._graveyard),
            "transfer": self._transfer_info(),
        }
        if probes := self.reach.take_outcomes():  # those the coordinator asked for
            info["probes"] = probes
        return info

    def _transfer_info(self) -> dict[str, Any] | None:
        """What a heartbeat says of this peer's round: ``info.transfer``
        (:func:`~isthmus.comm.unacked.transfer_info`)."""
        return transfer_info(self._in_round, self._group)

    def _on_push(self, msg: msgs.Push) -> None:
        if isinstance(msg, msgs.AbortPush):
            with self._push_lock:
                self._aborted_epochs.add(msg.epoch)
                g = self._group
            why = f"round {msg.round} aborted by the coordinator: {msg.reason}"
            if g is not None and g.name == f"epoch{msg.epoch}":
                g.abort(why)
            if (ahead := self._ahead) is not None and ahead.epoch == msg.epoch:
                ahead.abort(why)
        elif isinstance(msg, msgs.ProbePush):
            self.reach.on_push(msg)
        elif isinstance(msg, msgs.EvictedPush):  # the next request learns it and registers again
            log.warning("%s: the coordinator dropped its heartbeat: %s", self.name, msg.reason)

    def report(self, **info: Any) -> None:
        """Attach metrics (step, loss, ...) to the next heartbeats; shown in ``/status`` and on
        the coordinator's dashboard (which computes steps per second from ``step``)."""
        self.info.update(info)

    def log_scalars(self, step: int, **values: float) -> None:
        """Write ``values`` (``loss=..., lr=...``) at ``step`` to this peer's TensorBoard run
        (``SessionConfig.tensorboard``), with ``comm/world_size``, ``comm/bytes_sent`` and
        ``comm/bytes/<op>``. Does nothing without ``tensorboard``. Raises ImportError naming the
        package to install when the ``tensorboard`` package is missing."""
        if self.config.tensorboard is None:
            return
        if self._tensorboard is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError(
                    f"SessionConfig.tensorboard needs the tensorboard package: "
                    f"pip install 'isthmus[tensorboard]' ({e})"
                ) from e
            run = self.name.replace(os.sep, "_")  # one run per peer, even for odd names
            # flush often: a killed peer loses at most this much of its curve
            self._tensorboard = SummaryWriter(
                os.path.join(self.config.tensorboard, run), flush_secs=5
            )
        w = self._tensorboard
        for key, value in values.items():
            w.add_scalar(key, float(value), step)
        w.add_scalar("comm/world_size", self.world, step)
        w.add_scalar("comm/bytes_sent", self.stats.bytes_sent, step)
        for op, n in self.stats.by_op.items():
            w.add_scalar(f"comm/bytes/{op}", n, step)

    # -- groups ---------------------------------------------------------------------------------
    def _backend(self) -> str:
        if self.config.backend != "auto":
            return self.config.backend
        floats = [t for _, t in self.state.items() if t.is_floating_point()]  # NCCL: no host ones
        return "nccl" if floats and all(t.is_cuda for t in floats) else "gloo"

    def _set_group(self, g: Group | None) -> None:
        old = self._group
        self._group = g
        if old is not None and old is not g:
            # Aborting cuts its connections, so work still inside Gloo fails within milliseconds;
            # until it has, dropping the group would block this thread in Gloo's destructor.
            old.abort("superseded by a new epoch")
            self._graveyard.park(old)
        self._graveyard.reap()

    def _group_for(self, plan: RoundPlan) -> Group:
        """The group of ``plan``'s epoch: the one this peer holds, the one connected ahead
        (waiting for what is left of it), or a new connection. Raises
        :class:`CollectiveError` when connecting fails (naming the members not reached)."""
        name = f"epoch{plan.epoch}"
        g = self._group
        if g is not None and g.name == name and not g.aborted:
            return g
        g = self._take_ahead(plan)  # connected behind round 0 (comm/ahead.py), if it was
        if g is None:
            g = self._connect(plan)
        self._set_group(g)
        if plan.epoch in self._aborted_epochs:
            g.abort(f"epoch {plan.epoch} was aborted")
        return g

    def _connect(self, plan: RoundPlan, cancelled: Callable[[], bool] = lambda: False) -> Group:
        """Connect ``plan``'s epoch (:func:`connect_epoch`; abandoned when the coordinator
        aborts the epoch or ``cancelled()``) and settle whether it probes."""
        assert self._stores is not None
        g, agreed = connect_epoch(
            plan,
            peer_id=self.peer_id or 0,
            owner=self.name,
            run_id=self.run_id,
            config=self.config,
            backend=self._backend(),
            stats=self.stats,
            stores=self._stores,
            aborted=lambda: plan.epoch in self._aborted_epochs or cancelled(),
            graveyard=self._graveyard,
            wishes=self.prober.wishes(plan),
            reach_source=self.reach.source,
        )
        if not cancelled():  # an attempt nobody takes decides nothing
            self.prober.agree(plan, agreed)
        return g

    # -- rounds ---------------------------------------------------------------------------------
    def begin(self) -> Round:
        """Block until the next round forms with this peer in it; return it. The run's first
        round, when it transfers nothing, comes back before its epoch's group is connected
        (:mod:`isthmus.comm.ahead`): its :attr:`Round.group` waits for the connection.

        Raises :class:`StateMismatch` if the coordinator refused this peer's shared state,
        :class:`RoundTimeout` if no round formed within ``round_timeout``, :class:`RoundFailed`
        after ``max_attempts`` failed set-ups or when the coordinator stopped the run (the same
        cause aborted its round again and again; the error names it)."""
        if self._closed:
            raise RuntimeError("session is closed")
        self._graveyard.reap()  # groups retired earlier that went idle: let them go now
        cfg = self.config
        carried = self.settle(begin=True)  # the begin a committed vote already sent, if any
        deadline = time.monotonic() + cfg.round_timeout
        for _attempt in range(cfg.max_attempts):
            plan = self._ask_for_round(deadline, carried)
            carried = None
            if plan is None:
                continue  # evicted and registered again
            t0, self._in_round = time.monotonic(), plan
            if connects_ahead(plan, backend=self._backend()):
                # nothing in this round needs the group (comm/ahead.py): connect it behind
                self._connect_ahead(plan)
                self.rank, self.world = plan.rank_of(self.peer_id or 0), len(plan.members)
                return Round(self, plan, None, t0)
            try:
                group = self._group_for(plan)
                fault = functools.partial(self._probe_fault, plan.round)
                links = self.prober.run(group, plan, fault)  # on a new member set (probe.py)
                if links is not None:
                    self.report(probed=links)
                if plan.transfers:
                    apply_transfers(group, plan, self.state, self.peer_id or 0)
                    if self.peer_id in plan.resynced:
                        self.revision = plan.round
                        n = sum(len(t.names) for t in plan.transfers if t.dst == self.peer_id)
                        log.info("%s resynced %d tensors at round %d", self.name, n, plan.round)
            except (CollectiveError, TransferError) as e:
                log.warning("%s: setting up round %d failed: %s", self.name, plan.round, e)
                self._report_outcome(plan, ok=False, error=str(e), t0=t0, stage="setup", cause=e)
                continue
            self.rank, self.world = group.rank, group.world
            return Round(self, plan, group, t0)
        raise RoundFailed(f"round could not be set up in {cfg.max_attempts} attempts")

    def _probe_fault(self, round: int, pair: int) -> None:
        self.faults.check("probe", step=pair, round=round)

    def _ask_for_round(
        self, deadline: float, carried: tuple[msgs.Begin, msgs.Decision] | None = None
    ) -> RoundPlan | None:
        """Begin (or, with ``carried``, go on with a begin already sent and its last answer)."""
        msg, d = carried or (self._next_begin(self.revision), msgs.Wait())
        if isinstance(d, msgs.SendHashes):
            msg = dataclasses.replace(msg, hashes=self.state.hashes())
        last_log = time.monotonic()
        asking = carried is None or isinstance(d, (msgs.Wait, msgs.SendHashes))
        while asking:
            if time.monotonic() - last_log > 10:
                log.info("%s waiting for round %d: %s", self.name, self.revision, d.reason)
                last_log = time.monotonic()
            if time.monotonic() > deadline:
                raise RoundTimeout(
                    f"{self.name}: no round formed within {self.config.round_timeout:.0f}s; "
                    f"the coordinator said: {d.reason or 'nothing'}"
                )
            d = self._client.call("/v1/begin", msg, msgs.Decision, read_timeout=30.0)
            # schema and hashes go once: the coordinator keeps them for this attempt
            msg = dataclasses.replace(msg, schema=None, hashes=None)
            if isinstance(d, msgs.SendHashes):
                msg = dataclasses.replace(msg, hashes=self.state.hashes())
            elif not isinstance(d, msgs.Wait):
                break
            if self.reach.waiting(d.reason):  # isolated: it waits to be taken back, unbounded
                deadline = max(deadline, time.monotonic() + self.config.round_timeout)
        match d:
            case msgs.Go(plan=plan) if plan is not None:
                self._fresh = False
                return plan
            case msgs.Finished():
                self.close(leave=True)
                raise RunFinished(f"{self.name} cannot join: {d.reason}")
            case msgs.Refused():
                self.close(leave=False)
                raise StateMismatch(f"{self.name} was refused by the coordinator: {d.reason}")
            case msgs.Stopped():  # the same cause aborted the round again and again
                raise RoundFailed(f"{self.name}: the coordinator stopped the run: {d.reason}")
            case msgs.Restore(restore=point) if point is not None:
                self._restore(point, d.reason)
            case msgs.Evicted():
                self.evictions += 1
                log.warning("%s was evicted (%s); registering again", self.name, d.reason)
                self._client.stop_heartbeat()
                self._register()
            case _:
                raise CoordinatorError(f"unexpected answer to begin: {d}")
        return None

    def _restore(self, point: RestorePoint, reason: str) -> None:
        """The coordinator says no live peer holds the run's state: load checkpoint ``point``.
        Raises :class:`RoundFailed` when nothing on this session can load one (no strategy) or
        the checkpoint cannot be loaded (the error names it); the shared state is unchanged."""
        if self.restore_handler is None:
            raise RoundFailed(
                f"{self.name}: the coordinator asks to restore the run from checkpoint "
                f"{point.revision} at {point.url} ({reason}), but nothing that loads checkpoints "
                f"is attached to this session (build a strategy on it)"
            )
        try:
            self.revision = self.restore_handler(point)
        except Exception as e:
            raise RoundFailed(
                f"{self.name}: cannot restore checkpoint {point.revision} at {point.url}: {e}"
            ) from e
        self.restores += 1
        self._fresh = True  # send hashes with the next begin

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
        """Report an attempt's outcome and record it; ``stage`` says where it ended: ``"setup"``
        (connecting the epoch's group or a state transfer failed inside :meth:`begin`, which
        begins again by itself, so the strategy never saw the attempt) or ``"round"``.
        A failure names the members this peer could not reach (``cause``, the exception, or
        the text of ``error`` names them, or probes find them: :meth:`PeerReach.unreached`)."""
        self._in_round = None
        with self._push_lock:
            aborted = ok or plan.epoch in self._aborted_epochs  # then nothing is probed
        why = cause or CollectiveError(error)
        unreached = (
            () if ok else self.reach.unreached(plan, self.peer_id or 0, why, aborted=aborted)
        )
        deadline = time.monotonic() + self.config.round_timeout
        msg = msgs.Commit(
            peer=self.peer_id or 0,
            run=self.run_id,
            epoch=plan.epoch,
            round=plan.round,
            ok=ok,
            error=error[:2000],
            unreached=unreached,
        )
        while True:
            d = self._client.call("/v1/commit", msg, msgs.Decision, read_timeout=30.0)
            if not isinstance(d, msgs.Wait):
                break
            if time.monotonic() > deadline:
                raise RoundTimeout(
                    f"round {plan.round} did not finish within "
                    f"{self.config.round_timeout:.0f}s: {d.reason}"
                )
        committed = isinstance(d, msgs.Committed)  # anything else (aborted, evicted) aborts it
        if committed:
            self.revision = plan.round + 1
            for hook in self._commit_hooks:
                hook(plan)
        self._record(plan, committed, stage, error or d.reason, t0, time.monotonic())
        return committed

    def _commit(self, rnd: Round, ok: bool, error: str, cause: BaseException | None = None) -> bool:
        if ok:
            try:
                rnd.check_faults("commit")
            except CollectiveError as e:
                ok, error = False, str(e)
        stage = "setup" if rnd.setup_failed else "round"  # its group, connected ahead, failed
        return self._report_outcome(
            rnd.plan, ok=ok, error=error, t0=rnd.started, stage=stage, cause=cause
        )

    def run_round(self, fn: Callable[[Round], T], *, pipelined: bool = False) -> T:
        """Run ``fn(round)`` until a round commits with it, and return its result.

        ``fn`` runs the round's collectives and returns a *tentative* result; it must not change
        shared state (that happens after this returns). If a collective fails (a peer died), the
        round is reported as failed, the survivors re-form, and ``fn`` runs again on the new
        round. Any other exception from ``fn`` is reported as a failure and re-raised.

        ``pipelined=True`` (honoured with ``SessionConfig.pipeline_commit``, outside islands,
        when every commit hook is deferrable): once ``fn`` succeeded, this returns without
        waiting for the verdict (:mod:`isthmus.comm.vote`). The caller applies the result
        tentatively and calls :meth:`applied`; the next :meth:`begin` (or :meth:`settle`)
        settles the verdict and undoes the result unless the round committed. The caller
        promises that nothing but its rounds writes the shared state between rounds.
        """
        for _ in range(self.config.max_attempts):
            rnd = self.begin()
            try:
                result = fn(rnd)
            except CollectiveError as e:
                rnd.commit(ok=False, error=str(e), cause=e)
                continue
            except BaseException as e:
                with contextlib.suppress(Exception):
                    rnd.commit(ok=False, error=f"{type(e).__name__}: {e}")
                raise
            if pipelined and self._pipelines():
                if self._vote_ahead(rnd):
                    return result
                continue
            if rnd.commit():
                return result
        raise RoundFailed(
            f"no attempt of round {self.revision} committed in {self.config.max_attempts} tries"
        )

    # -- shutdown -------------------------------------------------------------------------------
    def report_checkpoint(self, body: dict[str, Any]) -> dict[str, Any]:
        """Tell the coordinator about a checkpoint part or manifest this peer wrote (see
        :mod:`isthmus.checkpoint.save`); returns its answer. Safe from any thread. Raises
        :class:`~isthmus.coordinator.wire.WireError` naming the field when ``body`` is not a
        well-formed :class:`~isthmus.coordinator.protocol.CheckpointPart` or
        :class:`~isthmus.coordinator.protocol.CheckpointManifest`."""
        msg = msgs.checkpoint_report({**body, "peer": self.peer_id, "run": self.run_id})
        return self._client.post("/v1/checkpoint", encode(msg), read_timeout=30.0)

    def add_commit_hook(self, fn: Callable[[RoundPlan], None]) -> None:
        """Call ``fn(plan)`` after every round this peer commits, right after the coordinator's
        answer and before the round's result is returned (an elastic sampler advances its
        shared position there). Every member of the round calls its hooks with the same plan.
        A function with the attribute ``deferrable = True`` may run later, once the verdict on
        a pipelined round is known (``pipeline_commit``: at the next round's begin, after the
        caller applied the result), because nothing reads what it changes before the next
        round; one hook without it keeps every round on the waiting path."""
        self._commit_hooks.append(fn)
        self._deferrable_hooks = self._deferrable_hooks and bool(getattr(fn, "deferrable", False))

    def close(self, *, leave: bool = True) -> None:
        """Leave the run (between rounds) and release every resource. Idempotent.

        Leaving reports the shared state's digest and revision to the coordinator (its ``left``
        event carries them), so a launcher can check that every peer ended bit-identical."""
        if self._closed:
            return
        with contextlib.suppress(Exception):
            self.settle()  # leave with a final revision: the verdict, or the undo
        self._closed = True
        if leave and self.peer_id is not None:
            with contextlib.suppress(Exception):
                self._client.connect_timeout = min(self._client.connect_timeout, 5.0)
                msg = msgs.Leave(
                    peer=self.peer_id,
                    run=self.run_id,
                    digest=self.state.digest(),
                    revision=self.revision,
                    info=self._heartbeat_info(),  # final byte counts, for /metrics
                )
                self._client.post("/v1/leave", encode(msg), read_timeout=5.0)
        if self._tensorboard is not None:
            with contextlib.suppress(Exception):
                self._tensorboard.close()
        self._client.close()
        self.reach.close()
        self._drop_ahead("the session closed")
        self._set_group(None)
        # Cut groups go idle within milliseconds; give them that (bounded), so that none is left
        # for the interpreter's exit to destroy while it still works.
        self._graveyard.drain(5.0)
        MeshAgent.close_if(self.mesh)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- conveniences ---------------------------------------------------------------------------
    def register(self, name: str, tensor: torch.Tensor) -> None:
        """Register one shared tensor (see :class:`~isthmus.comm.state.SharedState`)."""
        if not self._fresh:
            raise RuntimeError("register shared state before the first round")
        self.state.register(name, tensor)
