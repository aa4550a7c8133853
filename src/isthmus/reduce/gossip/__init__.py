"""Building blocks for decentralized (gossip) training.

* :mod:`.topology`: communication graphs (ring, torus, exponential, random regular,
  Barabasi-Albert, complete; time-varying one-peer exponential and random matchings).
* :mod:`.rebuild`: a run's topology spec (:data:`TOPOLOGIES`), its rebuild or repair when
  membership changes, and its embedding over the peers that take part in a round.
* :mod:`.mixing`: Metropolis-Hastings mixing weights, checks and spectral gap.
* :mod:`.schedule`: when to gossip (constant, late-heavy, single merge, Poisson).
* :mod:`.exchange`: gossip steps and the exact global average over a ``Group``.
* :mod:`.variance`: variance-corrected averaging (vanishing variance).
* :mod:`.consensus`: consensus distance, pure and distributed.
* :mod:`.sampling`: MoDeST per-round trainer/aggregator sampling.
* :mod:`.sam`: DFedSAM's sharpness-aware local step (with a closure, or in two phases).
* :mod:`.peergraph`: the run's graph over peer ids, regenerated or repaired as membership changes.
* :mod:`.codec`: quantizers as per-message codecs for compressed gossip.

gossip's math belongs to reduce's layer: it may import comm (its ``Group``), the compressors and
the floor. Never imports checkpoint, runconfig, strategies, lab, run or cli (docs/ARCHITECTURE.md,
"Layers"; tools/structure.py checks it).
"""

from isthmus.reduce.gossip.codec import codec_for, quantizer_codec
from isthmus.reduce.gossip.consensus import consensus_distance, consensus_distance_group
from isthmus.reduce.gossip.exchange import (
    edge_tag,
    exchange_with_neighbors,
    global_average,
    gossip,
    gossip_reference,
    gossip_step,
    mix,
    send_copies,
    variance_corrected_gossip,
    variance_corrected_gossip_reference,
    variance_corrected_gossip_step,
)
from isthmus.reduce.gossip.mixing import (
    check_mixing_matrix,
    is_doubly_stochastic,
    is_symmetric,
    metropolis_matrix,
    metropolis_row,
    spectral_gap,
)
from isthmus.reduce.gossip.peergraph import REBUILD_MODES, GraphReport, PeerGraph
from isthmus.reduce.gossip.rebuild import (
    TOPOLOGIES,
    EmbeddedSequence,
    TopologySpec,
    embed_topology,
    rebuild_topology,
    repair_topology,
)
from isthmus.reduce.gossip.sam import sam_perturb, sam_restore, sam_step
from isthmus.reduce.gossip.sampling import (
    RoundSample,
    aggregation_ready,
    modest_aggregate,
    modest_aggregate_reference,
    sample_round,
)
from isthmus.reduce.gossip.schedule import (
    SCHEDULES,
    CommDecision,
    ConstantSchedule,
    LateHeavySchedule,
    PoissonSchedule,
    SingleMergeSchedule,
    comm_steps,
    make_schedule,
)
from isthmus.reduce.gossip.topology import (
    DisconnectedGraphError,
    OnePeerExponential,
    RandomMatching,
    StaticSequence,
    Topology,
    TopologySequence,
    connected_components,
    is_connected,
    make_topology,
    make_topology_sequence,
    union_topology,
)
from isthmus.reduce.gossip.variance import (
    corrected_average,
    segment_variances,
    variance_correct,
    variance_correct_flat,
    variance_target,
)

__all__ = [
    "REBUILD_MODES",
    "SCHEDULES",
    "TOPOLOGIES",
    "CommDecision",
    "ConstantSchedule",
    "DisconnectedGraphError",
    "EmbeddedSequence",
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
    "codec_for",
    "comm_steps",
    "connected_components",
    "consensus_distance",
    "consensus_distance_group",
    "corrected_average",
    "edge_tag",
    "embed_topology",
    "exchange_with_neighbors",
    "global_average",
    "gossip",
    "gossip_reference",
    "gossip_step",
    "is_connected",
    "is_doubly_stochastic",
    "is_symmetric",
    "make_schedule",
    "make_topology",
    "make_topology_sequence",
    "metropolis_matrix",
    "metropolis_row",
    "mix",
    "modest_aggregate",
    "modest_aggregate_reference",
    "quantizer_codec",
    "rebuild_topology",
    "repair_topology",
    "sam_perturb",
    "sam_restore",
    "sam_step",
    "sample_round",
    "segment_variances",
    "send_copies",
    "spectral_gap",
    "union_topology",
    "variance_correct",
    "variance_correct_flat",
    "variance_corrected_gossip",
    "variance_corrected_gossip_reference",
    "variance_corrected_gossip_step",
    "variance_target",
]
