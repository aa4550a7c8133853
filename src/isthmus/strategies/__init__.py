"""Training strategies: each plugs into a normal torch loop (call ``strategy.step()`` after
``loss.backward()``) and decides what to communicate. One file per algorithm, citing its paper.

To add a strategy: subclass :class:`Strategy`, implement ``step`` and ``from_options``, and add
it to :data:`STRATEGIES`.
"""

from __future__ import annotations

from typing import Any

import torch

from isthmus.comm.session import Session
from isthmus.reduce.reducer import Reducer
from isthmus.strategies.base import Strategy
from isthmus.strategies.co2 import CO2, CO2Config
from isthmus.strategies.ddp import DDP
from isthmus.strategies.diloco import DiLoCo, DiLoCoConfig
from isthmus.strategies.eager import EagerConfig, EagerDiLoCo
from isthmus.strategies.gossip import Gossip, GossipConfig
from isthmus.strategies.localsgd import LocalSGD, LocalSGDConfig
from isthmus.strategies.streaming import StreamingConfig, StreamingDiLoCo

__all__ = [
    "CO2",
    "DDP",
    "STRATEGIES",
    "CO2Config",
    "DiLoCo",
    "DiLoCoConfig",
    "EagerConfig",
    "EagerDiLoCo",
    "Gossip",
    "GossipConfig",
    "LocalSGD",
    "LocalSGDConfig",
    "Reducer",
    "Strategy",
    "StreamingConfig",
    "StreamingDiLoCo",
    "make_strategy",
]

STRATEGIES: dict[str, type[Strategy]] = {
    "ddp": DDP,
    "diloco": DiLoCo,
    "localsgd": LocalSGD,
    "streaming": StreamingDiLoCo,
    "eager": EagerDiLoCo,
    "co2": CO2,
    "gossip": Gossip,
}


def make_strategy(
    name: str,
    session: Session | None,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    compression: Any = None,
    aggregator: Any = None,
    byzantine_f: int = 0,
    **options: Any,
) -> Strategy:
    """Build a strategy by name with its options (as in the demo's and scenarios' settings) and
    a reducer for ``compression`` / ``aggregator`` (see :class:`Reducer`).

    Raises ValueError naming the unknown strategy or option.
    """
    cls = STRATEGIES.get(name)
    if cls is None:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    reducer = Reducer(compression=compression, aggregator=aggregator, byzantine_f=byzantine_f)
    try:
        return cls.from_options(session, model, optimizer, reducer, **options)
    except TypeError as e:
        raise ValueError(f"bad option for strategy {name!r}: {e}") from None
