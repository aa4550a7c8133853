"""What every strategy shares: plugging into a torch loop, shared state, contribution buffers.

A strategy wraps the user's model and optimizer. The user's loop stays a normal torch loop::

    loss = model(x, y)[1]
    loss.backward()
    strategy.step()          # instead of optimizer.step()
    optimizer.zero_grad()

Whether ``step()`` communicates, and what, is the strategy's business. With ``session=None`` (or
a run of one peer) no tensor ever leaves the process.

Contributions: a peer that was resynced at the start of a round, or whose update is not finite,
must not count in the average; :class:`~isthmus.reduce.reducer.Reducer` handles that (and
compression and robust aggregation) for every strategy.

Every strategy is built the same way, by :class:`Strategy`'s constructor: ``Strategy(session,
model, optimizer, config, reducer=... | compression=..., aggregator=..., byzantine_f=...)``, or
by name and flat options through :func:`isthmus.strategies.make_strategy`.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any, ClassVar, TypeVar

import torch

from isthmus.comm.session import Session
from isthmus.reduce.reducer import Reducer
from isthmus.spec import config_from

__all__ = [
    "Strategy",
    "materialize_optimizer_state",
    "register_module",
    "register_optimizer",
]

log = logging.getLogger("isthmus.strategy")
S = TypeVar("S", bound="Strategy")


def materialize_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create an optimizer's lazily-built state (Adam moments, momentum buffers) now.

    Torch optimizers allocate their state on the first ``step()``. A joining peer must receive
    that state before its first round, so it has to exist (with a fixed schema) from the start.
    This runs one step with zero gradients and learning rate 0, restores every parameter
    bit-for-bit, and resets step counters to 0. The result is exactly the state the optimizer
    would have had before its first real step (zeros), so later steps are unchanged.
    """
    params = [p for g in opt.param_groups for p in g["params"]]
    if all(opt.state.get(p) for p in params):
        return
    saved = [p.detach().clone() for p in params]
    grads = [p.grad for p in params]
    lrs = [g["lr"] for g in opt.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for g in opt.param_groups:
            g["lr"] = torch.zeros_like(g["lr"]) if torch.is_tensor(g["lr"]) else 0.0
        opt.step()
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)
        for p, gr in zip(params, grads, strict=True):
            p.grad = gr
        for g, lr in zip(opt.param_groups, lrs, strict=True):
            g["lr"] = lr
    for st in opt.state.values():
        if "step" in st:
            if torch.is_tensor(st["step"]):
                st["step"].zero_()
            else:
                st["step"] = 0


def register_module(
    session: Session, prefix: str, params: Iterable[tuple[str, torch.Tensor]]
) -> None:
    for name, p in params:
        session.state.register(f"{prefix}/{name}", p.data)


def register_optimizer(session: Session, prefix: str, opt: torch.optim.Optimizer) -> None:
    """Register every tensor of ``opt``'s state (after :func:`materialize_optimizer_state`)."""
    materialize_optimizer_state(opt)
    i = 0
    for g in opt.param_groups:
        for p in g["params"]:
            for key in sorted(opt.state[p]):
                v = opt.state[p][key]
                if v is None:
                    continue
                if not torch.is_tensor(v):
                    raise TypeError(
                        f"optimizer state {key!r} of parameter {i} is a {type(v).__name__}, not a "
                        f"tensor; isthmus can only share tensor state"
                    )
                session.state.register(f"{prefix}/{i}/{key}", v)
            i += 1


def register_globals(session: Session, names: list[str], tensors: list[torch.Tensor]) -> None:
    """Register the global (outer) parameters as ``global/<name>``: the copy every peer agrees on."""
    for n, g in zip(names, tensors, strict=True):
        session.register(f"global/{n}", g)


def outer_sgd(
    params: list[torch.Tensor], lr: float, momentum: float, nesterov: bool
) -> torch.optim.SGD:
    """The DiLoCo family's outer optimizer: SGD on the global parameters, Nesterov only with
    momentum (torch refuses Nesterov without it)."""
    return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0)


class Strategy(ABC):
    """Base class: the session, the model, the user's optimizer, the strategy's typed config,
    the reducer, the step counter and the shared counters.

    A subclass declares ``name`` (its registry name) and ``Config`` (its options dataclass,
    validated on construction), creates its own state in :meth:`setup` and implements
    :meth:`step`; the constructor and :meth:`from_options` are this class's, for every strategy.
    """

    name: ClassVar[str] = "base"
    Config: ClassVar[type[Any]]
    """The strategy's options dataclass: every field is an option (``--option``, a scenario's
    ``[strategy.options]``), and constructing it validates them all without building a model."""

    def __init__(
        self,
        session: Session | None,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        config: Any = None,
        *,
        reducer: Reducer | None = None,
        compression: Any = None,
        aggregator: Any = None,
        byzantine_f: int = 0,
    ) -> None:
        """Wrap ``model`` and the user's ``optimizer`` (the inner optimizer of the DiLoCo family).

        ``config`` defaults to ``Config()``; ``reducer`` defaults to a :class:`Reducer` for
        ``compression``, ``aggregator`` and ``byzantine_f``. Raises TypeError for a config of
        another class, ValueError for a default config that needs options (gossip's
        ``total_steps``), a bad compression or aggregator spec, or what :meth:`setup` refuses.
        """
        if config is not None and not isinstance(config, self.Config):
            raise TypeError(
                f"{type(self).__name__} takes a {self.Config.__name__}, got {type(config).__name__}"
            )
        self.session = session
        self.model = model
        self.optimizer = optimizer
        self.config = config if config is not None else self.Config()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        # The run's progress in inner steps, shared so that joiners pick it up.
        self.global_step = torch.zeros((), dtype=torch.int64)
        self.local_steps = 0
        self.reducer = reducer or Reducer(
            compression=compression, aggregator=aggregator, byzantine_f=byzantine_f
        )
        self.setup()

    def setup(self) -> None:  # noqa: B027 (optional hook, empty by default)
        """Create this strategy's own state and register the shared part with the session (in a
        fixed order: it is the run's shared-state schema). Called once, last, by the
        constructor."""

    @classmethod
    def from_options(
        cls: type[S],
        session: Session | None,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        reducer: Reducer,
        **options: Any,
    ) -> S:
        """Build from flat options (the demo's ``--option``, a scenario's ``[strategy]`` table),
        coerced through ``Config``'s type hints. Raises :class:`~isthmus.spec.SpecError` (a
        ValueError) naming an unknown option (with the closest valid one), a value of the wrong
        type, or one the config refuses."""
        config = config_from(cls.Config, options, what=cls.name)
        return cls(session, model, optimizer, config, reducer=reducer)

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The user's optimizer, by the DiLoCo family's name for it."""
        return self.optimizer

    @property
    def step_count(self) -> int:
        return int(self.global_step)

    def _register_counter(self) -> None:
        if self.session is not None:
            self.session.register("meta/step", self.global_step)

    def check_faults(self, point: str = "step") -> None:
        if self.session is not None:
            self.session.faults.check(point, step=self.step_count, state=self.session.state)

    @abstractmethod
    def step(self) -> None:
        """Apply one training step (called after ``loss.backward()``)."""

    def finish(self) -> None:  # noqa: B027 (optional hook, empty by default)
        """Called once after the last step (strategies with a final merge override this)."""

    def metrics(self) -> dict[str, Any]:
        s = self.session
        return {
            "strategy": self.name,
            "step": self.step_count,
            "bytes_sent": s.stats.bytes_sent if s else 0,
            "revision": s.revision if s else 0,
            "nonfinite_skips": self.reducer.nonfinite_skips,
            "rejected_updates": self.reducer.rejected_sums,
            "reducer": self.reducer.describe(),
            "overlap_fraction": round(self.reducer.timing.overlap_fraction, 4),
            "comm_s": round(self.reducer.timing.comm_s, 4),
            "comm_blocked_s": round(self.reducer.timing.blocked_s, 4),
        }
