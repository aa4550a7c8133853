"""Training strategies: each plugs into a normal torch loop (call ``strategy.step()`` after
``loss.backward()``) and decides what to communicate. One file per algorithm, citing its paper.

To add a strategy: subclass :class:`Strategy`, declare its ``name`` and ``Config`` (its options
dataclass, validated in ``__post_init__``), create its state in ``setup`` and implement ``step``,
then add the class to the loop that fills :data:`STRATEGIES` below.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from isthmus.comm.session import Session
from isthmus.reduce.reducer import Reducer
from isthmus.spec import Registry
from isthmus.strategies.base import Strategy
from isthmus.strategies.co2 import CO2, CO2Config
from isthmus.strategies.ddp import DDP, DDPConfig
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
    "DDPConfig",
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


def _construct(
    cls: type[Strategy],
    config: Any,
    *,
    session: Session | None,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    **reduction: Any,
) -> Strategy:
    return cls(session, model, optimizer, config, **reduction)


STRATEGIES: Registry[Strategy] = Registry("strategy")
"""Every strategy by name. An entry's config is the strategy's ``Config``, so
``STRATEGIES.lookup(name).config(options)`` validates a strategy's options without building a
model; ``build(config, session=, model=, optimizer=, reducer=...)`` makes the strategy."""

for _cls in (DDP, DiLoCo, LocalSGD, StreamingDiLoCo, EagerDiLoCo, CO2, Gossip):
    STRATEGIES.add(
        _cls.name,
        config=_cls.Config,
        build=functools.partial(_construct, _cls),
        help=" ".join((_cls.__doc__ or "").split(".")[0].split()),  # the first sentence
    )


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

    Raises :class:`~isthmus.spec.SpecError` (a ValueError) naming an unknown strategy or option
    (with the closest valid one) or a bad value, and ValueError for a bad compression or
    aggregator spec or a combination the strategy refuses.
    """
    entry = STRATEGIES.lookup(name)
    config = entry.config(options)
    reducer = Reducer(compression=compression, aggregator=aggregator, byzantine_f=byzantine_f)
    assert entry.build is not None  # every strategy entry builds its strategy
    return entry.build(config, session=session, model=model, optimizer=optimizer, reducer=reducer)
