"""Training strategies: each plugs into a normal torch loop (call ``strategy.step()`` after
``loss.backward()``) and decides what to communicate. Each strategy is one module, or one folder
when it needs more (``sparseloco/``, ``zo/``, ``decoupled_momentum/``, ``gossip/``), citing its
paper; a folder's pure math sits in its ``math.py``, which imports neither :mod:`isthmus.comm` nor
``torch.distributed``. What strategies share: :mod:`.base` (the constructor, the model's state,
checkpoints), :mod:`.phased` (the skeleton of the strategies that train in phases: inner steps,
catch-up, boundary, progress), :mod:`.pipeline` (rounds that stay in flight across steps) and
:mod:`.delayed` (the delayed outer round of eager DiLoCo and CO2). This package may import
:mod:`isthmus.reduce`, :mod:`isthmus.comm` and :mod:`isthmus.checkpoint`, nothing above them.

Every strategy shares the user's whole model, as :class:`~isthmus.strategies.base.ModelState`
enumerates it: trainable parameters (a tied one once), frozen parameters and persistent buffers;
non-persistent buffers (rotary ``inv_freq`` tables, masks) stay local. Frozen parameters and
integer buffers (BatchNorm's ``num_batches_tracked``) are shared as the model's own tensors
(``model/<name>``) by every strategy, never averaged: only forward passes, alike on every peer,
change them, the parity check repairs a peer that differs and a joiner receives them. Floating
buffers follow one rule per strategy. **ddp**: torch DDP broadcasts rank 0's; here they are
averaged over the round's contributors in the reducer's ``exact`` values (an fp32 sum with no
compression and no robust rule, so a byzantine peer can move them) and every peer copies the
mean (``global/<name>``) into its model after the commit. **The DiLoCo family** (localsgd,
diloco, streaming, eager, co2): a global copy (``global/<name>``) is shared state; at each outer
round the contributors' buffers are averaged in the same exact values that carry the step count
and the mean goes into the model. Streaming DiLoCo carries all of them in every fragment round;
eager DiLoCo and CO2 apply the mean of the snapshot taken at a boundary when its round settles,
one boundary later; where forward passes ran while a round was in flight, the model keeps what
they gathered on top of the mean. **gossip**: floating buffers are mixed like parameters, and
the final merge averages them exactly. **zo**: buffers are not trained; every step puts them back
(floating ones from their shared copy ``global/<name>``), since its forward passes only evaluate
perturbed points. **sparseloco** follows Streaming DiLoCo (the buffers ride in its messages'
exact values, all of them in every fragment's round); **decoupled_momentum** (DeMo) follows ddp
(averaged every step over the peers present). In mixed
precision the DiLoCo family keeps fp32 global state (theta, the outer optimizer, the buffers'
copy) for bf16/fp16 tensors and casts it into the model; fp32 models are unchanged bit for bit.
A catch-up round (the first step of the DiLoCo family and gossip with a session, unless
``strategy.join()`` ran it before the first forward pass) drops its forward pass's statistics
with its gradient, so with one peer every strategy equals its run without a session bit for
bit, buffers included.

To add a strategy: write one module (or folder) here with a subclass of :class:`PhasedStrategy`
when it trains in phases (it then implements ``catch_up`` and ``boundary`` and keeps only its own
rule), of :class:`Strategy` otherwise (it implements ``_step``); declare its ``name`` and
``Config`` (its options dataclass, validated in ``__post_init__``), create its state in ``setup``
(registering the model through :meth:`Strategy.share_model`), then add the class to the loop
that fills :data:`STRATEGIES` below. The reducer's staged state is committed by the session's
commit hook: a strategy never calls ``reducer.commit()``.

strategies may import checkpoint, reduce, comm (the session), the coordinator and the floor, and
never see a socket. Never imports lab, integrations, run or cli (docs/ARCHITECTURE.md, "Layers";
tools/structure.py checks it).
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any

import torch

from isthmus.comm.session import Session
from isthmus.reduce.reducer import Reducer
from isthmus.spec import Entry, Registry
from isthmus.strategies.base import Strategy
from isthmus.strategies.co2 import CO2, CO2Config
from isthmus.strategies.ddp import DDP, DDPConfig
from isthmus.strategies.decoupled_momentum import DeMo, DeMoConfig
from isthmus.strategies.diloco import DiLoCo, DiLoCoConfig
from isthmus.strategies.eager import EagerConfig, EagerDiLoCo
from isthmus.strategies.gossip import Gossip, GossipConfig
from isthmus.strategies.localsgd import LocalSGD, LocalSGDConfig
from isthmus.strategies.phased import PhasedStrategy
from isthmus.strategies.sparseloco import SparseLoCo, SparseLoCoConfig
from isthmus.strategies.streaming import StreamingConfig, StreamingDiLoCo
from isthmus.strategies.zo import ZO, ZOConfig

__all__ = [
    "CO2",
    "DDP",
    "STRATEGIES",
    "ZO",
    "CO2Config",
    "DDPConfig",
    "DeMo",
    "DeMoConfig",
    "DiLoCo",
    "DiLoCoConfig",
    "EagerConfig",
    "EagerDiLoCo",
    "Gossip",
    "GossipConfig",
    "LocalSGD",
    "LocalSGDConfig",
    "PhasedStrategy",
    "Reducer",
    "SparseLoCo",
    "SparseLoCoConfig",
    "Strategy",
    "StreamingConfig",
    "StreamingDiLoCo",
    "ZOConfig",
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


log = logging.getLogger("isthmus.strategy")

DEPRECATED_NAMES: dict[str, str] = {"demo": "decoupled_momentum"}
"""Old strategy names that still work -> the name that replaced them. ``demo`` named the DeMo
strategy and the ``isthmus demo`` command alike."""

_warned: set[str] = set()


class StrategyRegistry(Registry[Strategy]):
    """The strategies' registry: a name of :data:`DEPRECATED_NAMES` finds the strategy that
    replaced it, with a DeprecationWarning and (once per process) a logged warning naming the new
    name; everything else is :class:`~isthmus.spec.Registry`'s."""

    def lookup(self, name: str, *, spec: str = "") -> Entry[Strategy]:
        new = DEPRECATED_NAMES.get(name.strip().lower().replace("-", "_"))
        if new is not None:
            message = f"strategy name {name!r} is deprecated: use {new!r}"
            warnings.warn(message, DeprecationWarning, stacklevel=2)
            if name not in _warned:
                _warned.add(name)
                log.warning("%s", message)
        return super().lookup(name, spec=spec)


STRATEGIES: StrategyRegistry = StrategyRegistry("strategy")
"""Every strategy by name. An entry's config is the strategy's ``Config``, so
``STRATEGIES.lookup(name).config(options)`` validates a strategy's options without building a
model; ``build(config, session=, model=, optimizer=, reducer=...)`` makes the strategy."""

for _cls in (
    DDP,
    DiLoCo,
    LocalSGD,
    StreamingDiLoCo,
    EagerDiLoCo,
    CO2,
    Gossip,
    ZO,
    SparseLoCo,
    DeMo,
):
    STRATEGIES.add(
        _cls.name,
        config=_cls.Config,
        build=functools.partial(_construct, _cls),
        aliases=[old for old, new in DEPRECATED_NAMES.items() if new == _cls.name],
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

    A name of :data:`DEPRECATED_NAMES` builds the strategy that replaced it, with a
    DeprecationWarning. Raises :class:`~isthmus.spec.SpecError` (a ValueError) naming an unknown
    strategy or option (with the closest valid one) or a bad value, and ValueError for a bad
    compression or aggregator spec or a combination the strategy refuses.
    """
    entry = STRATEGIES.lookup(name)
    config = entry.config(options)
    reducer = Reducer(compression=compression, aggregator=aggregator, byzantine_f=byzantine_f)
    assert entry.build is not None  # every strategy entry builds its strategy
    return entry.build(config, session=session, model=model, optimizer=optimizer, reducer=reducer)
