"""What every strategy shares: plugging into a torch loop, the model's state, contribution buffers.

A strategy wraps the user's model and optimizer. The user's loop stays a normal torch loop::

    loss = model(x, y)[1]    # (before the first: strategy.join(), optional)
    loss.backward()
    strategy.step()          # instead of optimizer.step()
    optimizer.zero_grad()

Whether ``step()`` communicates, and what, is the strategy's business. With ``session=None`` (or
a run of one peer) no tensor ever leaves the process.

The model's state is enumerated once, by :class:`ModelState`: trainable parameters (a tied or
shared parameter once), frozen parameters, and the *persistent* buffers, floating and other; a
module's non-persistent buffers (rotary ``inv_freq`` tables, causal masks) are not part of its
``state_dict`` and stay local to each peer. Every strategy shares all of it (see
:mod:`isthmus.strategies` for each one's rule); :class:`SharedBuffers` is the global copy of the
floating buffers that the round-based strategies average.

Contributions: a peer that was resynced at the start of a round, or whose update is not finite,
must not count in the average; :class:`~isthmus.reduce.reducer.Reducer` handles that (and
compression and robust aggregation) for every strategy.

Every strategy is built the same way, by :class:`Strategy`'s constructor: ``Strategy(session,
model, optimizer, config, reducer=... | compression=..., aggregator=..., byzantine_f=...)``, or
by name and flat options through :func:`isthmus.strategies.make_strategy`.

Checkpoints (:mod:`isthmus.checkpoint`) take the shared state from the session and ask the
strategy for the rest: :meth:`Strategy.local_state` (what this peer alone holds),
:meth:`Strategy.load_local_state` and :meth:`Strategy.model_keys` (which shared tensor holds each
of the model's ``state_dict`` keys).
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import torch
from torch.distributed.fsdp import FSDPModule

from isthmus.checkpoint.attach import checkpointer_for, restore_shared, resume_from
from isthmus.checkpoint.save import Checkpointer
from isthmus.comm.layout import Placement
from isthmus.comm.session import Session
from isthmus.reduce.reducer import Reducer
from isthmus.spec import config_from
from isthmus.strategies.model_state import (
    ModelState,
    SharedBuffers,
    blob,
    load_tensors,
    unblob,
)
from isthmus.strategies.sharded import island_refusal, local_view, register_shard

__all__ = [
    "Strategy",
    "final_checkpoint_limit_s",
    "final_checkpoint_wait_s",
    "materialize_optimizer_state",
    "outer_sgd",
    "register_optimizer",
]

#: The slowest checkpoint store the final wait allows for (bytes per second): a network
#: filesystem or an object store far away.
CHECKPOINT_MIN_RATE = 10_000_000


#: The slowest write :meth:`Strategy.finish` still waits for while it progresses (bytes per
#: second): its limit, however the write advances.
CHECKPOINT_CRAWL_RATE = 1_000_000


def final_checkpoint_wait_s(nbytes: int, floor_s: float) -> float:
    """The time a store that shows no bytes before a file is complete (an object store) is
    given for the last checkpoint, whose part here is at most ``nbytes``: ``max(60, floor_s)``
    plus those bytes at :data:`CHECKPOINT_MIN_RATE` (a 40 GB state: 4000 s more)."""
    return max(60.0, floor_s) + nbytes / CHECKPOINT_MIN_RATE


def final_checkpoint_limit_s(nbytes: int, floor_s: float) -> float:
    """The most :meth:`Strategy.finish` waits for the last checkpoint however it progresses:
    ``max(60, floor_s)`` plus ``nbytes`` at :data:`CHECKPOINT_CRAWL_RATE` (40 GB: 11 hours)."""
    return max(60.0, floor_s) + nbytes / CHECKPOINT_CRAWL_RATE


log = logging.getLogger("isthmus.strategy")
S = TypeVar("S", bound="Strategy")
Named = list[tuple[str, torch.Tensor]]


def materialize_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create an optimizer's lazily-built state (Adam moments, momentum buffers) now.

    Torch optimizers allocate their state on the first ``step()``. A joining peer must receive
    that state before its first round, and a checkpoint's local state is loaded into a template
    of it, so it has to exist (with a fixed schema) from the start. This runs one step with zero
    gradients and learning rate 0, restores every parameter bit-for-bit, and resets step counters
    to 0. The result is exactly the state the optimizer would have had before its first real step
    (zeros), so later steps are unchanged. Raises what the optimizer's ``step()`` raises (one
    that needs a closure, for instance); the parameters and gradients are restored first.
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


def register_optimizer(
    session: Session,
    prefix: str,
    opt: torch.optim.Optimizer,
    placements: Sequence[Placement | None] = (),
) -> None:
    """Register every tensor of ``opt``'s state (after :func:`materialize_optimizer_state`).

    On a rank of an island, a DTensor state tensor is registered as its local shard with its
    placement, and a plain one shaped like its parameter with ``placements[i]``, parameter
    ``i``'s placement (the outer optimizer of a strategy keeps shard-sized copies)."""
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
                local, place = local_view(v)
                if place is None and i < len(placements) and local.shape == p.shape:
                    place = placements[i]
                register_shard(session, f"{prefix}/{i}/{key}", local, place)
            i += 1


def outer_sgd(
    params: list[torch.Tensor], lr: float, momentum: float, nesterov: bool
) -> torch.optim.SGD:
    """The DiLoCo family's outer optimizer: SGD on the global parameters, Nesterov only with
    momentum (torch refuses Nesterov without it)."""
    return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0)


class Strategy(ABC):
    """Base class: the session, the model and its :class:`ModelState`, the user's optimizer, the
    strategy's typed config, the reducer, the step counter and the shared counters.

    A subclass declares ``name`` (its registry name), ``Config`` (its options dataclass,
    validated on construction) and :attr:`first_round_uses_work`, creates its own state in
    :meth:`setup` and implements :meth:`step`; the constructor and :meth:`from_options` are this
    class's, for every strategy.
    """

    name: ClassVar[str] = "base"
    Config: ClassVar[type[Any]]
    """The strategy's options dataclass: every field is an option (``--option``, a scenario's
    ``[strategy.options]``), and constructing it validates them all without building a model."""
    first_round_uses_work: ClassVar[bool] = False
    """Whether the first ``step()`` trains on the batch drawn before anyone knew the membership
    (DDP), rather than being a catch-up round that drops its gradient (the DiLoCo family,
    gossip). The constructor copies it to ``session.first_round_uses_work``, which the elastic
    sampler reads (:mod:`isthmus.data.sampler`)."""

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
        ``total_steps``), a bad compression or aggregator spec, or what :meth:`setup` refuses
        (a non-contiguous parameter or buffer cannot be shared).
        """
        if config is not None and not isinstance(config, self.Config):
            raise TypeError(
                f"{type(self).__name__} takes a {self.Config.__name__}, got {type(config).__name__}"
            )
        self.session = session
        self.model = model
        self._fsdp: list[FSDPModule] | None = None  # found at the first let_go_gathered
        self.optimizer = optimizer
        self.config = config if config is not None else self.Config()
        self.model_state = ModelState.of(model)
        self.params = [p for _, p in self.model_state.trainable]
        self.names = [n for n, _ in self.model_state.trainable]
        self.placements = [self.model_state.placements.get(n) for n in self.names]
        """Each trainable parameter's placement in its full tensor (None: held whole); on a
        rank of an island :attr:`params` are the local shards of FSDP2's parameters."""
        self.held_by: dict[str, str] = {}
        """Each of the model's tensors (by its first name) -> the shared tensor that holds it
        once the run ended (:meth:`model_keys`); filled by :meth:`share_model`."""
        ms = self.model_state
        # The buffers as built: a catch-up round drops its call's work, and that includes what
        # its forward pass added to the running statistics (see drop_catch_up_forward).
        self._built_buffers = (
            []
            if session is None or self.first_round_uses_work
            else [(b, b.detach().clone()) for _, b in ms.float_buffers + ms.other_buffers]
        )
        # The run's progress in inner steps, shared so that joiners pick it up.
        self.global_step = torch.zeros((), dtype=torch.int64)
        self.local_steps = 0
        self.run_steps: int | None = None
        """The run's length in steps, where the training loop knows it (``while
        strategy.step_count < run_steps``; the built-in job sets it). With ``pipeline_commit``
        the round that brings :attr:`step_count` to it (and any round after) waits for its
        verdict (an abort is retried with the same work, as on the waiting path) and begins no
        other, so no round forms that this peer's leaving would abort. None: unknown; the last round's vote then
        carries the begin of a round that the peers' leaving aborts."""
        self.reducer = reducer or Reducer(
            compression=compression, aggregator=aggregator, byzantine_f=byzantine_f
        )
        self._refuse_islands(session)
        if session is not None:
            # The reducer keeps what a round's reduction staged once the round committed.
            self.reducer.attach(session)
            # Session does not declare it: the sampler reads it with getattr (False if unset).
            session.first_round_uses_work = self.first_round_uses_work  # type: ignore[attr-defined]
        self.setup()
        self.checkpointer: Checkpointer | None = None
        """Writes the checkpoints the session's config asks for (None: none)."""
        self.resumed_from: int | None = None
        """The revision of the checkpoint this peer resumed from (None: not resumed)."""
        self.resume_s = 0.0
        """Seconds the resume took (reading, verifying and loading the checkpoint)."""
        # (a test's stand-in session may have no config: then no checkpoints either)
        config = getattr(session, "config", None)
        if config is not None:
            # A run restarting from a checkpoint (its coordinator's) tells a peer at registration.
            url, upto = config.resume, None
            point = getattr(session, "restore_point", None)
            if not url and point is not None:
                url, upto = point.url, point.revision
            if url:
                t0 = time.monotonic()
                self.resumed_from = resume_from(session, self, url, upto)
                self.resume_s = time.monotonic() - t0
            session.restore_handler = lambda point: restore_shared(
                session, point.url, point.revision
            )
            self.checkpointer = checkpointer_for(session, self)

    islands: ClassVar[str] = "it has not been ported to sharded state yet"
    """Why this strategy cannot run on islands (peers of several local ranks), or ``""`` when
    it can. Declared per class: a subclass does not inherit its parent's support."""

    def _refuse_islands(self, session: Session | None) -> None:
        """Raise ValueError naming why, when ``session`` is a rank of an island and this
        strategy (its class's :attr:`islands`) or its reducer
        (:func:`~isthmus.strategies.sharded.island_refusal`) cannot run there."""
        if getattr(session, "island", None) is None:
            return
        why = vars(type(self)).get("islands", Strategy.islands)
        if why:
            raise ValueError(f"{self.name} cannot run on islands: {why}")
        why = island_refusal(self.reducer)
        if why:
            raise ValueError(f"{self.name} on islands: {why}")

    def setup(self) -> None:  # noqa: B027 (optional hook, empty by default)
        """Create this strategy's own state and register the shared part with the session (in a
        fixed order: it is the run's shared-state schema). Called once, last, by the
        constructor."""

    def require_own_messages(self, sends: str, holds: str) -> None:
        """For a strategy that compresses and sums its own messages: refuse ``compression=`` and
        ``aggregator=`` (they would be ignored) and a model off the CPU (``holds``, its state and
        messages, live there). Raises ValueError naming which."""
        if self.reducer.compressor is not None or self.reducer.aggregator is not None:
            raise ValueError(
                f"{self.name} compresses its own {sends} and sums them exactly: "
                "drop compression= and aggregator="
            )
        off_cpu = sorted({str(p.device) for p in self.params if p.device.type != "cpu"})
        if off_cpu:
            raise ValueError(
                f"{self.name} keeps its {holds} on the CPU; a model on {off_cpu} is not "
                "supported yet"
            )

    def share_model(
        self,
        trainable: Sequence[torch.Tensor] | None,
        prefix: str = "model",
        buffers: SharedBuffers | None = None,
    ) -> None:
        """Name the model's shared tensors and register them (with a session), in this order:
        ``trainable`` (one per trainable parameter: the model's own or a global copy) as
        ``<prefix>/<name>``; the global copy of the floating buffers as ``global/<name>``; the
        frozen parameters and the other (integer, bool) buffers as ``model/<name>``, the model's
        own tensors: they change in no round, are parity-checked and repaired, and a joiner
        receives them. None skips a part (gossip mixes its parameters instead of sharing them).

        Raises ValueError (from the session) for a non-contiguous tensor or a repeated name."""
        parts: list[tuple[str, str, torch.Tensor]] = []
        if trainable is not None:
            parts += [(n, f"{prefix}/{n}", t) for n, t in zip(self.names, trainable, strict=True)]
        if buffers:
            parts += [
                (n, f"global/{n}", g) for n, g in zip(buffers.names, buffers.globals, strict=True)
            ]
        ms = self.model_state
        parts += [(n, f"model/{n}", t.data) for n, t in ms.frozen + ms.other_buffers]
        places = self.model_state.placements
        for n, shared, t in parts:
            self.held_by[n] = shared
            if self.session is not None:
                if n in places:  # a shard of a tensor sharded inside an island
                    register_shard(self.session, shared, t, places[n])
                else:
                    self.session.register(shared, t)

    def drop_catch_up_forward(self) -> None:
        """Called by a catch-up round (a strategy's first ``step()`` with a session, whose
        gradient is dropped): put the model's persistent buffers back to what they held when
        the strategy was built, so the forward pass of that call leaves no trace either. The
        first batch then counts once in the running statistics, as in the parameters, and a
        one-peer run equals a run without a session bit for bit. A joiner's buffers are then
        replaced by the run's anyway."""
        with torch.no_grad():
            for b, built in self._built_buffers:
                b.copy_(built)
        self._built_buffers = []

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

    def step(self, *args: Any, **kwargs: Any) -> None:
        """One training step (call it after ``loss.backward()``, instead of ``optimizer.step()``),
        then a checkpoint if one is due (the snapshot only: writing runs in the background).

        A round run with the session's ``pipeline_commit`` is applied tentatively here and
        settled by the next round (:meth:`Session.settle`); a checkpoint is only taken of a
        settled revision, so a step whose tentative revision is due for one waits for the
        verdict first. A pipelined round after which :attr:`step_count` reached :attr:`run_steps`
        (the strategy expected more steps: a peer repaired to the run's step by the round) is
        settled here too, its vote sent without a begin; if it aborted, the state is back where
        it was and :attr:`step_count` below ``run_steps``, so the loop runs the step again."""
        self._step(*args, **kwargs)
        self._after_step()

    def join(self) -> None:  # noqa: B027 (optional hook, empty by default)
        """The catch-up round before the first forward pass, where a strategy's first step would
        be one (:meth:`PhasedStrategy.join <isthmus.strategies.phased.PhasedStrategy.join>`);
        nothing here: the first step trains."""

    def _after_step(self) -> None:
        """What follows a step, and a catch-up round run by :meth:`join` (see :meth:`step`)."""
        self.let_go_gathered()
        s = self.session
        pending = getattr(s, "pending_revision", None)  # None too for sessions without it
        if pending is not None:
            last = self.run_steps is not None and self.step_count >= self.run_steps
            # the result is in place: the next begin may go once it commits (none after the last)
            s.applied(last=last)
            ck = self.checkpointer
            if last or (ck is not None and pending % max(1, ck.every) == 0):
                s.settle()
                pending = None
        if pending is None and self.checkpointer is not None:
            self.checkpointer.maybe_save()

    def finish(self) -> None:
        """Call once after the last step: the strategy's final round (the DiLoCo family syncs
        what is left, gossip merges), then the run's last checkpoint, waited for while its write
        progresses (:meth:`~isthmus.checkpoint.save.Checkpointer.wait_progressing`): given up
        once its files gained no byte and the writer no step for ``max(60 s,
        collective_timeout)``, or after :func:`final_checkpoint_limit_s` of the shared state's
        size in any case, and on a store that shows a file only once it is complete not before
        :func:`final_checkpoint_wait_s`. A write given up goes on in the background; the
        checkpoint before it stays the last complete one."""
        self._finish()
        if getattr(self.session, "pending_revision", None) is not None:
            self.session.settle()  # the run ends on a final revision
        self.let_go_gathered()
        if self.checkpointer is not None and self.session is not None:
            self.checkpointer.maybe_save(force=True)
            s = self.session
            nbytes = sum(t.numel() * t.element_size() for _, t in s.state.items())
            floor = s.config.collective_timeout
            self.checkpointer.wait_progressing(
                idle_s=max(60.0, floor),
                limit_s=final_checkpoint_limit_s(nbytes, floor),
                unseen_min_s=final_checkpoint_wait_s(nbytes, floor),
            )

    def let_go_gathered(self) -> None:
        """Drop FSDP2's gathered copies of the model's parameters, so that the next forward
        gathers the shards as the strategy left them. FSDP2 keeps a root module's parameters
        gathered after a forward pass without backward (an evaluation); a round that writes
        the shards after one would otherwise not be seen. A no-op without FSDP2 modules, and
        for modules already sharded."""
        if self._fsdp is None:
            self._fsdp = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        for m in self._fsdp:
            m.reshard()

    def pipelines_rounds(self) -> bool:
        """Whether a round's result may be applied before its verdict (the session's
        ``pipeline_commit``): only where nothing but rounds writes the shared state between
        steps. False here; DDP and DiLoCo say when they can."""
        return False

    def round_options(self, *, step_after: int | None = None) -> dict[str, Any]:
        """Keyword arguments for ``session.run_round``: ``pipelined=True`` when the session
        pipelines commits and :meth:`pipelines_rounds`, unless ``step_after`` (what
        :attr:`step_count` will be once the round is applied) reaches :attr:`run_steps`: the
        run's last round waits for its verdict. Else none (any session takes that)."""
        cfg = getattr(self.session, "config", None)
        if not (getattr(cfg, "pipeline_commit", False) and self.pipelines_rounds()):
            return {}
        if self.run_steps is not None and step_after is not None and step_after >= self.run_steps:
            return {}  # the last round: nothing computes after it to hide its verdict behind
        return {"pipelined": True}

    @abstractmethod
    def _step(self, *args: Any, **kwargs: Any) -> None:
        """The strategy's own training step."""

    def _finish(self) -> None:  # noqa: B027 (optional hook, empty by default)
        """The strategy's own end of the run (strategies with a final round override this)."""

    # -- what checkpoints need --------------------------------------------------------------------
    def model_keys(self) -> dict[str, str]:
        """Every key of the model's ``state_dict`` (tied duplicates too) -> the shared tensor
        that holds its value once :meth:`finish` ran (the run ends on the shared model), so that a
        checkpoint can be exported as a plain state dict. A global copy of a half-precision
        tensor is fp32: loading it into the model casts it to the model's bits."""
        return {k: self.held_by[n] for k, n in self.model_state.keys.items() if n in self.held_by}

    def local_state(self) -> dict[str, Any]:
        """This peer's local state, as a nested dict of tensors and plain values that
        torch.distributed.checkpoint saves: the CPU RNG state (``rng``), the compressor's local
        state (``compressor``: error feedback, serialized, empty without a compressor), counters
        (``progress``) and what the strategy keeps locally (the DiLoCo family: the inner
        optimizer's ``state_dict`` and the local parameters and buffers). Tensors are the live
        ones, not copies (the checkpointer copies them; a template filled in place by a load is
        then applied by :meth:`load_local_state`). Its structure depends only on the model, the
        optimizer and the strategy, so a fresh strategy's is a template for a saved one."""
        comp = self.reducer.compressor
        out: dict[str, Any] = {
            "rng": torch.get_rng_state(),
            "compressor": b""
            if comp is None
            else blob({"name": comp.name, "local": comp.state_dict()["local"]}),
            "progress": self._progress(),
        }
        out.update(self._local_tensors())
        return out

    def load_local_state(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`local_state` returned, after the shared state was loaded (into
        the session's registered tensors). The compressor's shared state is not restored: every
        member restarts it at a new epoch anyway.

        Raises ValueError naming a missing part, a tensor of another shape (nothing is changed
        for those), or a compressor of another spec (checked before anything is changed).
        Error feedback saved by a peer that compressed is dropped, with a warning, by a strategy
        built without compression."""
        for key in ("rng", "compressor", "progress"):
            if key not in state:
                raise ValueError(f"local state has no {key!r}")
        comp = self.reducer.compressor
        saved = unblob(state["compressor"]) if state["compressor"] else None
        if saved is not None and comp is not None and saved["name"] != comp.name:
            raise ValueError(
                f"local state holds the error feedback of compressor {saved['name']!r}, this "
                f"strategy compresses with {comp.name!r}: build it with the same compression"
            )
        if saved is not None and comp is None:
            log.warning("local state holds error feedback, but nothing is compressed: dropped")
        self._load_local_tensors(state)
        if saved is not None and comp is not None:
            comp.load_state_dict({"name": saved["name"], "shared": {}, "local": saved["local"]})
        self._load_progress(dict(state["progress"]))
        torch.set_rng_state(state["rng"])

    def _progress(self) -> dict[str, float]:
        return {"local_steps": self.local_steps}

    def _load_progress(self, progress: dict[str, Any]) -> None:
        self.local_steps = int(progress["local_steps"])

    def _local_tensors(self) -> dict[str, Any]:
        return {}

    def _load_local_tensors(self, state: Mapping[str, Any]) -> None:  # noqa: B027 (optional hook)
        """Restore the strategy's own local tensors (see :meth:`_local_tensors`)."""

    # helpers for strategies whose parameters and buffers are local between rounds
    def _materialize_inner(self) -> None:
        try:
            materialize_optimizer_state(self.optimizer)
        except Exception as e:  # an optimizer that needs a closure: training works, loading not
            log.warning(
                "the optimizer's state cannot be created before its first step (%s): a "
                "checkpoint's local state cannot be loaded into this peer",
                e,
            )

    def _local_model(self) -> dict[str, torch.Tensor]:
        ms = self.model_state
        return {n: t.detach() for n, t in ms.trainable + ms.float_buffers}

    def _inner_local(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "model": self._local_model()}

    def _load_inner_local(self, state: Mapping[str, Any]) -> None:
        if "optimizer" not in state or "model" not in state:
            raise ValueError("local state has no 'optimizer' or 'model'")
        load_tensors("model", self._local_model(), state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

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
