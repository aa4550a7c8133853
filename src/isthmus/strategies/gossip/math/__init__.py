"""The gossip strategy's pure math: everything about graphs, weights, schedules and averaging
that needs no network, tested in one process.

Nothing in this package imports :mod:`isthmus.comm` or :mod:`torch.distributed`
(``tools/structure.py`` checks it); the modules beside it in :mod:`isthmus.strategies.gossip`
(``exchange``, ``modest``, ``codec``) run the same math over a
:class:`~isthmus.comm.group.Group`, and their tests compare them with the references here. It is
a subpackage rather than one ``math.py`` because the math is several independent pieces:

* :mod:`.topology`: static communication graphs (ring, torus, exponential, random regular,
  Barabasi-Albert, complete).
* :mod:`.sequence`: a graph per round (time-varying one-peer exponential and random matchings;
  a static graph as the constant sequence).
* :mod:`.rebuild`: a run's topology spec (:data:`TOPOLOGIES`), its rebuild or repair when
  membership changes, and its embedding over the peers that take part in a round.
* :mod:`.peergraph`: the run's graph over peer ids, regenerated or repaired as membership changes.
* :mod:`.mixing`: Metropolis-Hastings mixing weights, checks and spectral gap.
* :mod:`.averaging`: one gossip step's arithmetic (plain and CHOCO difference form) and the
  all-ranks references the distributed steps must reproduce bit for bit.
* :mod:`.variance`: variance-corrected averaging (vanishing variance).
* :mod:`.consensus`: the consensus distance of the peers' models (how far from their average).
* :mod:`.sampling`: MoDeST's seeded per-round trainers and aggregators, its success fraction, and
  the one-process reference of a round's aggregate.
* :mod:`.schedule`: when to gossip (constant, late-heavy, single merge, Poisson).
* :mod:`.sam`: DFedSAM's sharpness-aware local step (with a closure, or in two phases).

Errors are ``ValueError`` (or :class:`DisconnectedGraphError`, a ``ValueError``) naming the
offending argument. Never imports lab, integrations, run or cli (docs/ARCHITECTURE.md, "Layers";
tools/structure.py checks it).
"""

from isthmus.strategies.gossip.math.averaging import (
    Decode,
    Encode,
    gossip_reference,
    mix,
    variance_corrected_gossip_reference,
)
from isthmus.strategies.gossip.math.consensus import consensus_distance
from isthmus.strategies.gossip.math.mixing import (
    check_mixing_matrix,
    is_doubly_stochastic,
    is_symmetric,
    metropolis_matrix,
    metropolis_row,
    spectral_gap,
)
from isthmus.strategies.gossip.math.peergraph import REBUILD_MODES, GraphReport, PeerGraph
from isthmus.strategies.gossip.math.rebuild import (
    TOPOLOGIES,
    EmbeddedSequence,
    TopologySpec,
    embed_topology,
    rebuild_topology,
    repair_topology,
)
from isthmus.strategies.gossip.math.sam import sam_perturb, sam_restore, sam_step
from isthmus.strategies.gossip.math.sampling import (
    RoundSample,
    aggregation_ready,
    modest_aggregate_reference,
    sample_round,
)
from isthmus.strategies.gossip.math.schedule import (
    SCHEDULES,
    CommDecision,
    ConstantSchedule,
    LateHeavySchedule,
    PoissonSchedule,
    SingleMergeSchedule,
    comm_steps,
    make_schedule,
)
from isthmus.strategies.gossip.math.sequence import (
    TIME_VARYING_TOPOLOGIES,
    OnePeerExponential,
    RandomMatching,
    StaticSequence,
    TopologySequence,
    make_topology_sequence,
    union_topology,
)
from isthmus.strategies.gossip.math.topology import (
    DisconnectedGraphError,
    Topology,
    connected_components,
    is_connected,
    make_topology,
)
from isthmus.strategies.gossip.math.variance import (
    corrected_average,
    segment_variances,
    variance_correct,
    variance_correct_flat,
    variance_target,
)

__all__ = [
    "REBUILD_MODES",
    "SCHEDULES",
    "TIME_VARYING_TOPOLOGIES",
    "TOPOLOGIES",
    "CommDecision",
    "ConstantSchedule",
    "Decode",
    "DisconnectedGraphError",
    "EmbeddedSequence",
    "Encode",
    "GraphReport",
    "LateHeavySchedule",
    "OnePeerExponential",
    "PeerGraph",
    "PoissonSchedule",
    "RandomMatching",
    "RoundSample",
    "SingleMergeSchedule",
    "StaticSequence",
    "Topology",
    "TopologySequence",
    "TopologySpec",
    "aggregation_ready",
    "check_mixing_matrix",
    "comm_steps",
    "connected_components",
    "consensus_distance",
    "corrected_average",
    "embed_topology",
    "gossip_reference",
    "is_connected",
    "is_doubly_stochastic",
    "is_symmetric",
    "make_schedule",
    "make_topology",
    "make_topology_sequence",
    "metropolis_matrix",
    "metropolis_row",
    "mix",
    "modest_aggregate_reference",
    "rebuild_topology",
    "repair_topology",
    "sam_perturb",
    "sam_restore",
    "sam_step",
    "sample_round",
    "segment_variances",
    "spectral_gap",
    "union_topology",
    "variance_correct",
    "variance_correct_flat",
    "variance_corrected_gossip_reference",
    "variance_target",
]
