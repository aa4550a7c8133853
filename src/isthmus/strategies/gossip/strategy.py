"""The gossip strategy: its local step and its rounds (start, gossip, merge, membership).

The package docstring (:mod:`isthmus.strategies.gossip`) cites the papers and describes how a run
proceeds; MoDeST's rounds are :mod:`.modest`, the options :mod:`.options`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from isthmus.comm.session import Round
from isthmus.strategies.gossip.codec import codec_for
from isthmus.strategies.gossip.exchange import (
    MAX_ITERS_PER_ROUND,
    consensus_distance_group,
    global_average,
    gossip,
    send_copies,
    variance_corrected_gossip,
)
from isthmus.strategies.gossip.math import (
    TIME_VARYING_TOPOLOGIES,
    EmbeddedSequence,
    GraphReport,
    PeerGraph,
    TopologySequence,
    metropolis_matrix,
    sam_perturb,
    sam_restore,
    spectral_gap,
)
from isthmus.strategies.gossip.modest import Modest
from isthmus.strategies.gossip.options import COPY_SLOT, GossipConfig
from isthmus.strategies.phased import PhasedStrategy

__all__ = ["Gossip"]

log = logging.getLogger("isthmus.gossip")

# What a round does; every peer learns the agreed kind from the round's all-gather.
MEMBERSHIP, GOSSIP, MERGE, START = 0, 1, 2, 3
KIND_NAMES = {MEMBERSHIP: "membership", GOSSIP: "gossip", MERGE: "merge", START: "start"}
_HISTORY = 50


@dataclass
class _Tentative:
    """A round's result, applied only once the round committed."""

    kind: int
    number: int
    members: tuple[int, ...]
    contributors: tuple[int, ...]
    new: torch.Tensor | None = None
    graph: TopologySequence | None = None
    report: GraphReport | None = None
    distance: float | None = None
    copied: bool = False
    modest_used: int | None = None
    unusable_reason: str = ""


class Gossip(PhasedStrategy):
    """Gossip training around the user's (local) optimizer; call :meth:`step` after backward.

    With ``session=None`` it is exactly ``optimizer.step()`` (plus SAM if configured). The
    config is required in practice: its ``total_steps`` has no default (``GossipConfig()``
    raises ``ValueError`` asking for it). Raises ``ValueError`` at construction for a robust
    aggregator (not supported with gossip) or
    a compressor that has no per-message codec (only the quantizers do; see
    :func:`isthmus.strategies.gossip.codec.codec_for`).
    """

    name = "gossip"
    islands: ClassVar[str] = (
        "pairs of peers mix whole models with each other; islands would need every pair's "
        "exchange split by piece between islands of any sizes (not built)"
    )
    Config = GossipConfig
    config: GossipConfig
    phase_counters = ()  # its rounds follow the shared step counter, which advances every step

    def setup(self) -> None:
        super().setup()
        config, session = self.config, self.session
        if self.reducer.aggregator is not None:
            raise ValueError(
                "robust aggregation is not available with gossip (each peer only sees its "
                "neighbours); drop --aggregator or use ddp/diloco"
            )
        self.codec = codec_for(self.reducer.compressor)
        if self.codec is not None and (config.variance_correction or config.modest):
            raise ValueError(
                "compression applies to plain gossip messages; it cannot be combined with "
                "variance_correction or MoDeST"
            )
        assert config.schedule_obj is not None and config.topology_spec is not None
        self.schedule = config.schedule_obj
        self.train = config.train
        # What is mixed: the trainable parameters, then the floating buffers (so that the final
        # merge averages those exactly too). SAM perturbs the parameters only.
        self.mixed = self.params + [b for _, b in self.model_state.float_buffers]
        dtypes = {t.dtype for t in self.mixed}
        # mixing happens on one flat vector; mixed dtypes are mixed in fp32 and cast back
        self.dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        self.sizes = [t.numel() for t in self.mixed]
        self.numel = sum(self.sizes)
        self.graph = PeerGraph(
            config.topology_spec,
            mode=config.rebuild,
            capacity=config.graph_capacity,
            min_degree=config.repair_min_degree,
        )
        self._stale = False  # this peer's parameters are not usable until a round hands it a copy
        self._sam_saved: list[torch.Tensor] | None = None
        self._merged_last = False
        self.modest = Modest(config, self._flat()) if config.modest else None
        # metrics
        self.rounds_by_kind = dict.fromkeys(KIND_NAMES.values(), 0)
        self.trained_steps = 0
        self.copies_received = 0
        self.nonfinite_skips = 0
        self.graph_splits = 0
        self.consensus: list[tuple[int, float]] = []
        self.merge_consensus: float | None = None
        self.graph_changes: list[dict[str, Any]] = []
        self.current_graph: dict[str, Any] = {}
        self._encode, self._decode = self.codec if self.codec is not None else (None, None)
        self._due: tuple[int, int] | None = None  # the round the schedule asks for after this step
        if session is not None:
            self._register_counter()
            for key, t in self.graph.shared_tensors().items():
                session.register(f"gossip/graph_{key}", t)
            if self.modest is not None:
                self.modest.register(session)
        # frozen parameters and integer buffers are identical on every peer: shared as they are
        self.share_model(None)

    @property
    def step_count(self) -> int:
        return int(self.global_step)

    # -- the local step ---------------------------------------------------------------------------
    def _step(self, closure: Callable[[], torch.Tensor] | None = None) -> None:
        """One training step: the local update (or nothing, for a connectivity-only peer or a
        MoDeST non-trainer), then the round the schedule asks for after this step, if any.

        With ``sam_rho > 0`` and no ``closure``, SAM runs in two calls: the first perturbs the
        weights along the gradient just computed and returns *without* advancing
        ``step_count``; the loop must compute the gradient again on the same batch (the job
        does, since its batch depends only on ``step_count``) and call again, which restores the
        weights and steps. A ``closure`` (as for ``torch.optim``: clear gradients, compute the
        loss on the same batch, backward, return the loss) does both in one call.

        Raises ``ValueError`` for a non-finite SAM gradient (weights unchanged), plus what the
        round raises (see :meth:`Session.run_round`).
        """
        super()._step(closure)

    def catch_up(self) -> None:
        """Start the run (the first round's kind is ``start`` at step 0) or catch up with it."""
        self._run_round(None, 0)

    def inner_step(self, closure: Callable[[], torch.Tensor] | None = None) -> bool:
        if self._takes_local_step():
            if not self._local_update(closure):
                return False  # SAM's first half: the same step again, at the perturbed weights
            self.trained_steps += 1
        self.global_step += 1
        self._merged_last = False
        return True

    def boundary_due(self) -> bool:
        self._due = None
        if self.session is not None:
            self._due = self._decision(int(self.global_step) - 1)
        return self._due is not None

    def boundary(self) -> None:
        assert self._due is not None
        self._run_round(*self._due)
        self.since = 0

    def _takes_local_step(self) -> bool:
        if not self.train:
            return False
        if self.modest is not None and self.session is not None:
            return self.modest.is_trainer(self.session.peer_id)
        return True

    def _local_update(self, closure: Callable[[], torch.Tensor] | None) -> bool:
        rho = float(self.config.sam_rho)
        if rho <= 0:
            self.optimizer.step()
            return True
        if closure is not None:
            saved = sam_perturb(self.params, rho)
            try:
                with torch.enable_grad():
                    closure()
            finally:
                sam_restore(self.params, saved)
            self.optimizer.step()
            return True
        if self._sam_saved is None:
            self._sam_saved = sam_perturb(self.params, rho)
            return False
        sam_restore(self.params, self._sam_saved)
        self._sam_saved = None
        self.optimizer.step()
        return True

    def _decision(self, step: int) -> tuple[int, int] | None:
        total = self.config.total_steps
        assert total is not None
        if step >= total:
            return None  # past the planned run: local steps only
        d = self.schedule(step, total)
        if d.global_average:
            return MERGE, 0
        if d.gossip_iters:
            return GOSSIP, d.gossip_iters
        every = self.config.membership_every
        if every and (step + 1) % every == 0:
            return MEMBERSHIP, 0
        return None

    def _finish(self) -> None:
        """End of training, whether or not this peer joined: drop a pending SAM perturbation,
        and hold the final merge now if the run stopped before the schedule's last step (all
        peers must stop at the same step)."""
        if self._sam_saved is not None:
            sam_restore(self.params, self._sam_saved)
            self._sam_saved = None
        if self.session is not None and self.config.final_merge and not self._merged_last:
            self._run_round(MERGE, 0)

    # -- rounds -----------------------------------------------------------------------------------
    def _flat(self) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1).to(self.dtype) for t in self.mixed])

    def _run_round(self, kind: int | None, iters: int) -> None:
        assert self.session is not None
        result = self.session.run_round(lambda rnd: self._round(rnd, kind, iters))
        self._apply(result)

    def _round(self, rnd: Round, kind: int | None, iters: int) -> _Tentative:
        """One attempt of a round. Changes nothing but local flags: the caller applies the
        result after the commit."""
        group = rnd.group
        world = rnd.world
        if rnd.resynced:
            self._stale = True  # the session repaired our counter: our parameters are stale too
        flat = self._flat()
        usable = not self._stale
        reason = "joined or resynced" if self._stale else ""
        if usable and not bool(torch.isfinite(flat).all()):
            usable, reason = False, "parameters are not finite"
        if kind is None:  # first round of this peer: start the run, or catch up with it
            kind = START if int(self.global_step) == 0 else MEMBERSHIP
        trained = usable and self.config.modest and self._takes_local_step()
        row = torch.tensor(
            [int(usable), int(trained), int(self.global_step), kind if usable else -1, iters],
            dtype=torch.int64,
        )
        rows = [t.tolist() for t in group.all_gather(row)]
        contrib = [r for r in range(world) if rows[r][0] == 1]
        if not contrib:
            raise RuntimeError(
                f"round {rnd.number}: no peer holds a usable model (all joined, stale or "
                f"non-finite); the run cannot continue"
            )
        agreed = {tuple(rows[r][2:]) for r in contrib}
        if len(agreed) != 1:
            raise RuntimeError(
                f"round {rnd.number}: peers disagree on (step, kind, iterations): "
                f"{sorted(agreed)}; the schedule or total_steps differs between peers"
            )
        _step, kind, iters = agreed.pop()
        rnd.check_faults("collective", step=self.step_count)
        members = tuple(rnd.plan.members)
        out = _Tentative(
            kind=kind,
            number=rnd.number,
            members=members,
            contributors=tuple(members[r] for r in contrib),
            unusable_reason=reason,
        )
        vec = flat if usable else torch.zeros_like(flat)
        stale = [r for r in range(world) if r not in set(contrib)]
        need_copies = bool(stale)
        if kind == START:
            if self.config.initial_sync and world > 1:
                buf = vec.clone() if rnd.rank == contrib[0] else torch.empty_like(vec)
                group.broadcast(buf, contrib[0])
                out.new, need_copies = buf, False
            else:
                out.new = vec
        elif self.modest is not None and kind in (GOSSIP, MERGE):
            out.new, out.modest_used = self.modest.aggregate(rnd, vec, rows, contrib)
            need_copies = False
        elif kind == GOSSIP:
            out.new = self._gossip(rnd, vec, usable, contrib, iters, out)
        elif kind == MERGE:
            out.new = global_average(group, vec, contribute=usable)
            d = torch.tensor(
                [float(torch.linalg.vector_norm((vec - out.new).double())) if usable else 0.0],
                dtype=torch.float64,
            )
            group.all_reduce(d, "sum")
            out.distance = float(d[0]) / len(contrib)
            need_copies = False
        else:  # MEMBERSHIP: nothing is exchanged among usable peers
            out.new = vec
            if self.modest is not None:
                out.new = self.modest.anchor.clone() if not usable else vec
                need_copies = False
        if need_copies:
            pairs = [(contrib[k % len(contrib)], r) for k, r in enumerate(stale)]
            assert out.new is not None
            got = send_copies(
                group,
                out.new,
                pairs,
                exchange=rnd.number * MAX_ITERS_PER_ROUND + COPY_SLOT,
            )
            if got is not None:
                out.new, out.copied = got, True
        return out

    def _gossip(
        self,
        rnd: Round,
        vec: torch.Tensor,
        usable: bool,
        contrib: list[int],
        iters: int,
        out: _Tentative,
    ) -> torch.Tensor:
        cfg = self.config
        seq, report = self.graph.plan(out.contributors)
        out.graph, out.report = seq, report
        placed = EmbeddedSequence(seq, tuple(contrib), rnd.world)
        if cfg.consensus_every and rnd.number % cfg.consensus_every == 0:
            out.distance = consensus_distance_group(rnd.group, vec, kind="mean", contribute=usable)
        if cfg.variance_correction:
            return variance_corrected_gossip(
                rnd.group,
                vec,
                placed,
                self.sizes,
                round=rnd.number,
                iterations=iters,
                target=cfg.variance_target,
                transport=cfg.transport,
            )
        return gossip(
            rnd.group,
            vec,
            placed,
            round=rnd.number,
            iterations=iters,
            encode=self._encode,
            decode=self._decode,
            gamma=cfg.gamma,
            transport=cfg.transport,
        )

    def _apply(self, t: _Tentative) -> None:
        """The round committed on every peer: adopt its result."""
        if t.unusable_reason:
            if t.unusable_reason != "joined or resynced":
                self.nonfinite_skips += 1
            log.warning(
                "round %d: this peer's model was not usable (%s); it adopted %s",
                t.number,
                t.unusable_reason,
                "a copy of a peer's model" if t.copied else "the round's result",
            )
        if t.new is not None:
            with torch.no_grad():
                off = 0
                for p, n in zip(self.mixed, self.sizes, strict=True):
                    p.copy_(t.new[off : off + n].view(p.shape).to(p.dtype))
                    off += n
        self._stale = False
        self.copies_received += int(t.copied)
        name = KIND_NAMES[t.kind]
        self.rounds_by_kind[name] += 1
        self._merged_last = t.kind == MERGE
        if t.kind == MERGE and t.distance is not None:
            self.merge_consensus = t.distance
        if t.distance is not None:
            self.consensus = [*self.consensus, (int(self.global_step), t.distance)][-_HISTORY:]
        if t.graph is not None and t.report is not None:
            self._record_graph(t)
        if self.modest is not None and t.kind in (START, GOSSIP, MERGE):
            assert t.new is not None
            self.modest.adopt(
                t.new, members=t.members, number=t.number, used=t.modest_used, start=t.kind == START
            )

    def _record_graph(self, t: _Tentative) -> None:
        assert t.graph is not None and t.report is not None
        report = t.report
        if report.changed:
            if report.split:
                self.graph_splits += 1
                log.warning("round %d: the gossip graph split: %s", t.number, report.describe())
            elif report.previous is not None:
                log.info("round %d: gossip graph rebuilt: %s", t.number, report.describe())
            top = t.graph.at(0)
            edges = [[report.members[i], report.members[j]] for i, j in top.edges()]
            gap = None
            if t.graph.name not in TIME_VARYING_TOPOLOGIES and top.n <= 256:
                gap = round(spectral_gap(metropolis_matrix(top)), 6)
            self.current_graph = {
                "round": t.number,
                "members": list(report.members),
                "edges": edges,
                "spectral_gap": gap,
            }
            self.graph_changes = [
                *self.graph_changes,
                {
                    "round": t.number,
                    "members": list(report.members),
                    "departed": list(report.departed),
                    "arrived": list(report.arrived),
                    "components": [list(c) for c in report.components],
                    "split": report.split,
                    "added_edges": [list(e) for e in report.added],
                },
            ][-_HISTORY:]
        self.graph.commit(t.contributors, t.graph)

    # -- what checkpoints need -------------------------------------------------------------------
    def model_keys(self) -> dict[str, str]:
        """Empty: gossip shares no copy of the trainable parameters (they differ between peers
        until the final merge), so no shared tensor holds the model; it is in every peer's
        :meth:`local_state` (``model``)."""
        return {}

    def _progress(self) -> dict[str, float]:
        return {
            **super()._progress(),
            "stale": int(self._stale),
            "trained_steps": self.trained_steps,
        }

    def _load_progress(self, progress: dict[str, Any]) -> None:
        super()._load_progress(progress)
        self._stale = bool(progress["stale"])
        self.trained_steps = int(progress["trained_steps"])

    # -- reporting --------------------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        m = super().metrics()
        cfg = self.config
        m.update(
            {
                "nonfinite_skips": self.nonfinite_skips,
                "topology": cfg.topology,
                "rebuild": cfg.rebuild,
                "schedule": cfg.schedule,
                "rounds_by_kind": dict(self.rounds_by_kind),
                "trained_steps": self.trained_steps,
                "train": self.train,
                "copies_received": self.copies_received,
                "consensus_distance": self.consensus[-1][1] if self.consensus else None,
                "consensus_history": [[s, round(d, 8)] for s, d in self.consensus],
                "merge_consensus_distance": self.merge_consensus,
                "graph": self.current_graph,
                "graph_changes": self.graph_changes,
                "graph_splits": self.graph_splits,
                "modest_fallbacks": self.modest.fallbacks if self.modest is not None else 0,
            }
        )
        return m
