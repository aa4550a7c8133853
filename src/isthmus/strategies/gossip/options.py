"""The gossip strategy's options: one typed, validated config (the demo's ``--topology``,
``--schedule`` and ``--option KEY=VALUE``, a scenario's ``[strategy.options]``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from isthmus.spec import SpecError, parse
from isthmus.strategies.gossip.exchange import MAX_ITERS_PER_ROUND
from isthmus.strategies.gossip.math import REBUILD_MODES, SCHEDULES, TopologySpec
from isthmus.strategies.gossip.math.schedule import Schedule
from isthmus.strategies.gossip.math.sequence import TIME_VARYING_TOPOLOGIES

__all__ = ["COPY_SLOT", "GossipConfig"]

COPY_SLOT = MAX_ITERS_PER_ROUND - 1
"""The exchange number reserved in every round for copies to joiners (gossip iterations use the
numbers below it)."""


@dataclass(kw_only=True)
class GossipConfig:
    """Options of the gossip strategy (the demo's ``--topology``, ``--schedule`` and
    ``--option KEY=VALUE``). Validated on construction; errors say what to change."""

    total_steps: int | None = None
    """The run's length in local steps; schedules depend on it (the training job passes its
    ``steps``). Required."""
    topology: str = "ring"
    """``ring``, ``torus``, ``exponential``, ``complete``, ``random_regular[:degree=D]``,
    ``barabasi_albert[:m=M]``, or time-varying ``one_peer_exponential`` / ``random_matching``
    (``-`` works for ``_``)."""
    rebuild: str = "regenerate"
    """On a membership change: ``regenerate`` the family's graph over the new members, or
    ``repair`` the old one (keep surviving edges, add the fewest that reconnect it)."""
    repair_min_degree: int = 2
    """Repair mode: top every peer up to this many neighbours (joiners included)."""
    graph_capacity: int = 64
    """Repair mode: the most peers the shared graph can hold."""
    schedule: str = "constant"
    """``constant[:every=K]``, ``late_heavy[:start_every=A,end_every=B,shape=linear|geometric]``,
    ``single_merge``, ``poisson[:rate=R]`` (``-`` works for ``_``)."""
    gossip_steps: int = 1
    """Gossip iterations per round (DFedSAM-MGS's Q)."""
    final_merge: bool = True
    """End the run with one exact global average, after which every peer holds the same bits."""
    membership_every: int = 0
    """Also hold a round (no exchange; joiners get a copy) every this many steps, so joiners need
    not wait for the next gossip round under sparse schedules. 0: only at exchanges."""
    initial_sync: bool = True
    """The first round broadcasts rank 0's parameters, so all peers start from one model (as
    D-PSGD assumes). Off: every peer keeps its own initialization."""
    transport: str = "p2p"
    """``p2p`` (send/recv with neighbours only) or ``all_to_all`` (one collective)."""
    gamma: float = 1.0
    """Consensus step size of compressed gossip (CHOCO's gamma); ignored without compression."""
    variance_correction: bool = False
    """Rescale each layer after mixing to the received models' variance (vanishing variance)."""
    variance_target: str = "received"
    """``received``, ``own`` or ``mix`` (see
    :func:`isthmus.strategies.gossip.math.variance_target`)."""
    sam_rho: float = 0.0
    """DFedSAM: SAM radius of the local steps (0: plain optimizer steps)."""
    modest_trainers: int = 0
    """MoDeST: trainers sampled per round (with ``modest_aggregators``; 0 and 0: plain gossip)."""
    modest_aggregators: int = 0
    """MoDeST: aggregators sampled per round."""
    modest_success: float = 1.0
    """MoDeST: fraction of the sampled trainers' models an aggregator needs; with fewer the
    previous aggregate is kept."""
    consensus_every: int = 0
    """Measure the consensus distance at gossip rounds whose number is a multiple of this (costs
    two all-reduces of the model). 0: only at merges, where it is almost free."""
    train: bool = True
    """False: a connectivity-only peer; it mixes and relays but takes no local steps (settable
    later as ``strategy.train``)."""
    seed: int = 0
    """Seed of random topologies, MoDeST samples and the Poisson schedule."""
    schedule_obj: Schedule | None = field(default=None, init=False, repr=False)
    """Built from ``schedule``; not an option."""
    topology_spec: TopologySpec | None = field(default=None, init=False, repr=False)
    """Built from ``topology``; not an option."""

    def __post_init__(self) -> None:
        if (
            isinstance(self.total_steps, bool)
            or not isinstance(self.total_steps, int)
            or self.total_steps < 1
        ):
            raise ValueError(
                f"gossip needs total_steps (the run's length in steps, >= 1) because its "
                f"schedules depend on it; got {self.total_steps!r}. The training job passes its "
                f"--steps; in your own loop pass total_steps=..."
            )
        for name in ("gossip_steps", "repair_min_degree", "graph_capacity"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.gossip_steps >= COPY_SLOT:
            raise ValueError(f"gossip_steps must be below {COPY_SLOT}, got {self.gossip_steps}")
        for name in (
            "membership_every",
            "consensus_every",
            "modest_trainers",
            "modest_aggregators",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if self.rebuild not in REBUILD_MODES:
            raise ValueError(f"rebuild must be one of {REBUILD_MODES}, got {self.rebuild!r}")
        if self.transport not in ("p2p", "all_to_all"):
            raise ValueError(f"transport must be 'p2p' or 'all_to_all', got {self.transport!r}")
        if not 0.0 < self.gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {self.gamma}")
        if self.variance_target not in ("received", "own", "mix"):
            raise ValueError(
                f"variance_target must be 'received', 'own' or 'mix', got {self.variance_target!r}"
            )
        if not (isinstance(self.sam_rho, int | float) and math.isfinite(self.sam_rho)) or (
            self.sam_rho < 0
        ):
            raise ValueError(f"sam_rho must be a finite number >= 0, got {self.sam_rho!r}")
        if (self.modest_trainers > 0) != (self.modest_aggregators > 0):
            raise ValueError(
                "MoDeST needs both modest_trainers and modest_aggregators >= 1 (or both 0 for "
                f"plain gossip); got {self.modest_trainers} and {self.modest_aggregators}"
            )
        if self.modest_trainers > self.graph_capacity:
            raise ValueError(
                f"modest_trainers ({self.modest_trainers}) exceeds graph_capacity "
                f"({self.graph_capacity}); raise graph_capacity"
            )
        if not 0.0 < self.modest_success <= 1.0:
            raise ValueError(f"modest_success must be in (0, 1], got {self.modest_success}")
        if self.modest and self.variance_correction:
            raise ValueError("variance_correction applies to gossip mixing, not to MoDeST rounds")
        if self.modest and not self.initial_sync:
            raise ValueError("MoDeST needs initial_sync=True: its fallback model must be shared")
        self.topology_spec = TopologySpec.parse(self.topology, seed=self.seed)
        if self.rebuild == "repair" and self.topology_spec.name in TIME_VARYING_TOPOLOGIES:
            raise ValueError(
                f"rebuild='repair' needs a static topology; {self.topology_spec.name!r} changes "
                f"every round (use rebuild='regenerate')"
            )
        self.schedule_obj = self._build_schedule()

    @property
    def modest(self) -> bool:
        return self.modest_trainers > 0

    @property
    def schedule_name(self) -> str:
        """The schedule's registered name (``late_heavy`` for ``late-heavy:start_every=8``)."""
        return SCHEDULES.lookup(parse(self.schedule, what="schedule")[0].name).name

    def _build_schedule(self) -> Schedule:
        """The schedule, its options coerced through its dataclass; what the spec leaves out
        comes from this config (``gossip_steps``, ``final_merge``, ``seed``)."""
        parts = parse(self.schedule, what="schedule")
        if len(parts) != 1:
            raise SpecError("a schedule is one part; remove the '+'", spec=self.schedule)
        entry = SCHEDULES.lookup(parts[0].name, spec=self.schedule)
        name, options = entry.name, entry.options(parts[0], spec=self.schedule)
        if name == "single_merge":
            if not self.final_merge:
                raise ValueError(
                    "schedule single_merge is a final merge; final_merge=False contradicts it"
                )
        elif name == "poisson":
            if self.gossip_steps != 1:
                raise ValueError(
                    "the poisson schedule draws its own iteration counts; leave gossip_steps at 1"
                )
            options.setdefault("seed", self.seed)
            options.setdefault("final_merge", self.final_merge)
        else:
            options.setdefault("iters", self.gossip_steps)
            options.setdefault("final_merge", self.final_merge)
        schedule: Schedule = entry.config(options, spec=self.schedule)
        return schedule
