"""isthmus: train one PyTorch model across machines that fail, come and go, and talk over thin links.

The pieces a training script needs::

    from isthmus import Session, SessionConfig, DDP, DiLoCo, StreamingDiLoCo

This module is the public API: it re-exports names from every layer, and it is the one module
exempt from the layers of docs/ARCHITECTURE.md. No module inside the package imports it; each
imports a name from the module that defines it. The layers, lowest first: spec, data and models
(the floor), coordinator, comm, reduce (and testing), checkpoint, strategies, lab, run, cli.
See the README for a quickstart and docs/ for the protocol.
"""

from isthmus import renamed as _renamed
from isthmus.comm.faults import Fault, FaultInjector
from isthmus.comm.group import CollectiveError
from isthmus.comm.island import IslandSession
from isthmus.comm.session import (
    Round,
    RoundFailed,
    RoundTimeout,
    Session,
    SessionConfig,
    StateMismatch,
)
from isthmus.coordinator.client import AuthError, CoordinatorError, CoordinatorUnreachable
from isthmus.coordinator.membership import MembershipConfig
from isthmus.coordinator.server import Coordinator, CoordinatorConfig

# ``from isthmus import aggregate``: the robust aggregation API (``aggregate.krum(...)``,
# ``aggregate.make_aggregator("nnm+krum")``, ``aggregate.attacks``) is the reduce package itself.
from isthmus.reduce import aggregate
from isthmus.strategies import (
    CO2,
    DDP,
    ZO,
    CO2Config,
    DDPConfig,
    DeMo,
    DeMoConfig,
    DiLoCo,
    DiLoCoConfig,
    EagerConfig,
    EagerDiLoCo,
    Gossip,
    GossipConfig,
    LocalSGD,
    LocalSGDConfig,
    SparseLoCo,
    SparseLoCoConfig,
    Strategy,
    StreamingConfig,
    StreamingDiLoCo,
    ZOConfig,
    make_strategy,
)
from isthmus.version import __version__ as __version__

__all__ = [
    "CO2",
    "DDP",
    "ZO",
    "AuthError",
    "CO2Config",
    "CollectiveError",
    "Coordinator",
    "CoordinatorConfig",
    "CoordinatorError",
    "CoordinatorUnreachable",
    "DDPConfig",
    "DeMo",
    "DeMoConfig",
    "DiLoCo",
    "DiLoCoConfig",
    "EagerConfig",
    "EagerDiLoCo",
    "Fault",
    "FaultInjector",
    "Gossip",
    "GossipConfig",
    "IslandSession",
    "LocalSGD",
    "LocalSGDConfig",
    "MembershipConfig",
    "Round",
    "RoundFailed",
    "RoundTimeout",
    "Session",
    "SessionConfig",
    "SparseLoCo",
    "SparseLoCoConfig",
    "StateMismatch",
    "Strategy",
    "StreamingConfig",
    "StreamingDiLoCo",
    "ZOConfig",
    "aggregate",
    "make_strategy",
]

_renamed.install()  # old module paths keep importing, with a DeprecationWarning
