"""Byzantine-robust aggregation: pure reference rules, pre-aggregators, and a sharded version that
runs across peers for about the bytes of one all-reduce.

Rules (``f`` = number of byzantine vectors tolerated): :func:`mean`, :func:`median`,
:func:`trimmed_mean`, :func:`meamed`, :func:`krum`, :func:`multi_krum`, :func:`geometric_median`,
:func:`centered_clipping`, :func:`flag`; pre-aggregators :func:`nnm`, :func:`bucketing`,
:func:`clip`; pipelines via :func:`make_aggregator` (``"nnm+krum"``), :func:`compose` or
:class:`Aggregator`; across peers via :func:`distributed_aggregate` or
:meth:`Aggregator.distributed`. Vectors holding NaN/Inf are excluded (and reported) by every rule,
the mean included. Threat model and costs: docs/ROBUST.md and
:mod:`isthmus.reduce.aggregate.sharded`. Attacks for experiments: :mod:`.attacks`.

aggregate belongs to reduce's layer: it may import comm (its ``Group``) and the floor. Never
imports checkpoint, runconfig, strategies, lab, integrations, run or cli (docs/ARCHITECTURE.md, "Layers";
tools/structure.py checks it).
"""

# attacks is loaded with the package so that ``from isthmus import aggregate`` reaches
# ``aggregate.attacks.make_attack`` without an import of its own
from isthmus.reduce.aggregate import attacks
from isthmus.reduce.aggregate.aggregator import (
    AggregationError,
    AggregationReport,
    AggregationResult,
    Stage,
)
from isthmus.reduce.aggregate.clipping import CenteredClippingOptions, centered_clipping
from isthmus.reduce.aggregate.coordinate import meamed, mean, median, trimmed_mean
from isthmus.reduce.aggregate.flagagg import FlagOptions, flag
from isthmus.reduce.aggregate.geomed import GeometricMedianOptions, geometric_median
from isthmus.reduce.aggregate.multikrum import MultiKrumOptions, krum, multi_krum
from isthmus.reduce.aggregate.pipeline import (
    AGGREGATORS,
    Aggregator,
    available,
    compose,
    distributed_aggregate,
    make_aggregator,
)
from isthmus.reduce.aggregate.preagg import BucketingOptions, ClipOptions, bucketing, clip, nnm
from isthmus.reduce.aggregate.sharded import run_sharded, shard_sizes

__all__ = [
    "AGGREGATORS",
    "AggregationError",
    "AggregationReport",
    "AggregationResult",
    "Aggregator",
    "BucketingOptions",
    "CenteredClippingOptions",
    "ClipOptions",
    "FlagOptions",
    "GeometricMedianOptions",
    "MultiKrumOptions",
    "Stage",
    "attacks",
    "available",
    "bucketing",
    "centered_clipping",
    "clip",
    "compose",
    "distributed_aggregate",
    "flag",
    "geometric_median",
    "krum",
    "make_aggregator",
    "meamed",
    "mean",
    "median",
    "multi_krum",
    "nnm",
    "run_sharded",
    "shard_sizes",
    "trimmed_mean",
]
