"""A ``transformers.Trainer`` trained by an isthmus strategy, on data read exactly once.

A Trainer script keeps its model, ``TrainingArguments`` and ``Trainer``; it adds a session, a
strategy around its optimizer, an :class:`ElasticReader` for its dataset and one call to
:func:`prepare`, then trains inside the session::

    session = isthmus.Session(isthmus.SessionConfig.from_env())
    reader = ElasticReader(train_ds, global_batch=16, session=session)  # before the strategy
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    strategy = isthmus.DiLoCo(session, model, inner, isthmus.DiLoCoConfig(sync_every=20))
    trainer = Trainer(model=model, args=args, train_dataset=train_ds)
    prepare(trainer, strategy, reader=reader, save_pretrained="model/")
    with session:
        trainer.train()

What each piece does:

* :class:`StrategyOptimizer` is the optimizer the Trainer steps: its ``step()`` is
  ``strategy.step()`` (the inner step, and a round when one is due), everything else (the
  parameter groups the learning-rate scheduler writes, ``zero_grad``, ``state_dict``) is the
  inner optimizer's. Gradient clipping and accumulation stay the Trainer's and happen before
  the step, on this peer's gradients.
* :class:`IsthmusCallback` runs the strategy's catch-up round when training starts (before the
  first batch), keeps the Trainer's ``global_step`` on the run's step (a joiner or a
  restarted peer jumps to it at its catch-up round, and its learning-rate schedule with it),
  stops at ``max_steps`` of the *run*, reports the step and loss to the coordinator, turns off
  the Trainer's own ``checkpoint-N`` saves (every peer would write them into one directory,
  each its local model), and at the end runs ``strategy.finish()`` (the final round and the
  last isthmus checkpoint) and writes the model with ``save_pretrained`` on one peer.
* :class:`ElasticReader` hands each peer its share of every global batch through
  :class:`isthmus.data.ElasticSampler`: every sample of an epoch is used by exactly one
  committed round, across kills, joins and aborted rounds; its position is shared state, so a
  joiner and a checkpoint have it. :func:`prepare` makes it the Trainer's training data loader
  (collated by the Trainer's ``data_collator``).

Checkpoints are isthmus's: ``SessionConfig.from_env(checkpoint_dir=..., checkpoint_every=N)``
(or ``resume=``) as for any loop; the strategy writes and loads them. The learning-rate
schedule follows the step number, so a peer that jumps to the run's step gets the run's
learning rate: true of the Trainer's built-in schedules (``lr_scheduler_type``), which are
computed from the step; a schedule that is not is left as it is.

Needs transformers (and datasets to read a ``datasets.Dataset`` or a dataset saved to disk):
``pip install 'isthmus[hf]'``. Importing this module without transformers raises ImportError
naming that extra.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from isthmus.data.sampler import ElasticSampler
from isthmus.extras import MissingExtra, install_hint
from isthmus.strategies.base import Strategy

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - the hf extra is part of the dev install
    raise MissingExtra(f"isthmus.integrations.hf needs transformers: {install_hint('hf')}") from e

__all__ = ["ElasticReader", "IsthmusCallback", "StrategyOptimizer", "prepare"]

log = logging.getLogger("isthmus.hf")

EXTRA_HINT = install_hint("hf")


def _datasets() -> Any:
    """The datasets package, or ImportError naming the extra that brings it."""
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            f"reading a datasets.Dataset or a dataset saved to disk needs datasets: {EXTRA_HINT}"
        ) from e
    return datasets


class StrategyOptimizer(torch.optim.Optimizer):
    """The optimizer a ``Trainer`` steps, whose ``step()`` is ``strategy.step()``.

    Give it to the Trainer (``Trainer(..., optimizers=(StrategyOptimizer(strategy), None))``,
    or :func:`prepare` does it). Its parameter groups, state and defaults *are* the strategy's
    inner optimizer's (read through, never copied), so a learning-rate scheduler built on it
    sets the inner optimizer's learning rate, and ``state_dict`` / ``load_state_dict`` save
    and load the inner optimizer. A ``closure`` is evaluated (with gradients on) before the
    step and its loss returned. Optimizer step hooks registered on this object are not run.
    """

    def __init__(self, strategy: Strategy) -> None:
        # Optimizer.__init__ would build parameter groups of its own: this object has none,
        # it reads the inner optimizer's (as accelerate's AcceleratedOptimizer does).
        self.strategy = strategy

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The optimizer the strategy wraps (its inner optimizer)."""
        return self.strategy.optimizer

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.inner.param_groups = groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.inner.state

    @state.setter
    def state(self, state: Any) -> None:
        self.inner.state = state

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.inner.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.inner.defaults = defaults

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One strategy step (the inner step, then a round if one is due); returns the
        closure's loss, if a closure was given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.strategy.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError(
            "the strategy shares the parameters it was built with: add parameter groups to the "
            "inner optimizer before building the strategy"
        )

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.inner.load_state_dict(dict(state_dict))

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return (
            f"StrategyOptimizer({type(self.strategy).__name__}, inner={type(self.inner).__name__})"
        )


def _align_schedule(scheduler: Any, step: int) -> None:
    """Put a step-computed learning-rate schedule at ``step`` (a LambdaLR, which every built-in
    Trainer schedule is); any other schedule is left as it is, with a warning."""
    if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        for group, base, fn in zip(
            scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
        ):
            group["lr"] = base * fn(step)
        scheduler.last_epoch = step
        scheduler._last_lr = [g["lr"] for g in scheduler.optimizer.param_groups]  # get_last_lr
    elif scheduler is not None:
        log.warning(
            "the learning-rate schedule %s is not computed from the step: this peer joined at "
            "step %d and its schedule stays where it was",
            type(scheduler).__name__,
            step,
        )


class IsthmusCallback(TrainerCallback):  # type: ignore[misc]
    """Keeps a ``Trainer`` on the run: its step, its end, the saved model.

    At the start of training runs the strategy's catch-up round (``strategy.join()``, before the
    first batch is drawn). Then, and after every optimizer step, sets ``state.global_step`` to
    the strategy's step (the run's: a peer that joined or restarted gets it at its catch-up
    round) and the learning-rate schedule to that step; after every step it also reports the
    step to the coordinator, stops training once the run reached ``args.max_steps``, and cancels
    the Trainer's own checkpoint save (isthmus's checkpoints hold the shared state instead). At
    the end of training runs ``strategy.finish()`` (the final round and the last checkpoint, if
    any), then, with ``save_pretrained``, writes the model there with ``model.save_pretrained``
    on the peer of rank ``saver_rank`` in the final round (exactly one peer).

    ``args.max_steps`` must be set (the run's length in optimizer steps): a Trainer that
    counts epochs would end on each peer after its own number of batches. Raises ValueError at
    the start of training otherwise.
    """

    def __init__(
        self,
        strategy: Strategy,
        *,
        save_pretrained: str | os.PathLike[str] | None = None,
        saver_rank: int = 0,
    ) -> None:
        if strategy.session is None:
            raise ValueError("IsthmusCallback needs a strategy built on a session")
        self.strategy = strategy
        self.session = strategy.session
        self.save_pretrained = None if save_pretrained is None else Path(save_pretrained)
        self.saver_rank = saver_rank
        self.saved: Path | None = None
        """Where this peer wrote the model at the end (None: another peer did, or none)."""
        self.joined_at: int | None = None
        """The run's step this peer jumped to at its catch-up round, if the Trainer was not
        there already (a joiner or a restarted peer); None otherwise."""
        self._warned_save = False

    def on_train_begin(
        self, args: Any, state: Any, control: Any, lr_scheduler: Any = None, **kwargs: Any
    ) -> Any:
        if args.max_steps is None or args.max_steps <= 0:
            raise ValueError(
                "train with TrainingArguments(max_steps=N): the run's length in optimizer steps "
                "(every peer stops when the run reached it, a joiner included)"
            )
        if getattr(args, "world_size", 1) != 1:
            raise ValueError(
                "start the peers with `isthmus run`, not torchrun or accelerate launch: each "
                "peer is its own one-process Trainer and isthmus does the communication"
            )
        self.strategy.run_steps = args.max_steps  # the last round begins no other
        # The catch-up round now, before the Trainer draws its first batch: otherwise the first
        # optimizer step would be that round, its forward and backward pass thrown away (and
        # its batch drawn before the round said this peer's rank and world).
        self.strategy.join()
        self._follow(state, lr_scheduler)
        return control

    def _follow(self, state: Any, lr_scheduler: Any) -> None:
        """Put ``state.global_step`` and the schedule on the strategy's step where they differ
        (a joiner or a restarted peer, at its catch-up round)."""
        step = self.strategy.step_count
        if state.global_step != step:
            if self.joined_at is None and state.global_step <= 1:
                self.joined_at = step
                log.info("%s joined the run at step %d", self.session.name, step)
            state.global_step = step
            _align_schedule(lr_scheduler, step)

    def on_step_end(
        self, args: Any, state: Any, control: Any, lr_scheduler: Any = None, **kwargs: Any
    ) -> Any:
        self._follow(state, lr_scheduler)
        step = self.strategy.step_count
        self.session.report(step=step)
        if step >= state.max_steps:
            control.should_training_stop = True
        if control.should_save:
            control.should_save = False
            if not self._warned_save:
                self._warned_save = True
                log.warning(
                    "the Trainer's own checkpoints are off under isthmus (every peer would write "
                    "its local model into one directory): use SessionConfig(checkpoint_dir=...)"
                )
        return control

    def on_log(
        self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None, **kw: Any
    ) -> Any:
        if logs and isinstance(logs.get("loss"), (int, float)):
            self.session.report(step=self.strategy.step_count, loss=float(logs["loss"]))
        return control

    def on_train_end(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> Any:
        self.strategy.finish()
        if self.save_pretrained is not None and self.session.rank == self.saver_rank:
            if model is None or not hasattr(model, "save_pretrained"):
                raise ValueError("save_pretrained needs a transformers model (save_pretrained)")
            model.save_pretrained(self.save_pretrained)
            self.saved = self.save_pretrained
            log.info("%s wrote the model to %s", self.session.name, self.save_pretrained)
        return control


def _rows(dataset: Any, idx: Sequence[int]) -> list[Any]:
    """The examples at ``idx``: a ``datasets.Dataset`` is read in one batched access, turned
    into one dict per row; anything else row by row."""
    if not idx:
        return []
    if type(dataset).__module__.startswith("datasets"):
        columns = dataset[list(idx)]
        names = list(columns)
        return [
            dict(zip(names, values, strict=True)) for values in zip(*columns.values(), strict=True)
        ]
    return [dataset[i] for i in idx]


class ElasticReader:
    """A dataset read through the elastic exactly-once sampler, one global batch per step.

    ``dataset``: a ``datasets.Dataset``, a directory written by ``Dataset.save_to_disk`` (read
    with ``datasets.load_from_disk``), or any map-style dataset (``len`` and ``[i]``).
    ``global_batch``: the samples of one optimizer step on all peers together, split among the
    peers of the last round (``B // world`` each, the first ``B % world`` one more). With
    ``drop_last`` (the default) the dataset's last ``len % global_batch`` rows are not read, so
    every block is whole and no peer's share is empty; without it the last block of an epoch is
    short, and a share that comes out empty raises RuntimeError. ``seed`` fixes each epoch's
    order; ``used_log`` is the sampler's (a JSON line per committed round and epoch with the
    indices it used: give each peer its own path).

    ``session``: attach the sampler's position to it as shared state now. Build the reader
    before the strategy: a strategy that resumes a checkpoint loads the shared state registered
    by then, the reader's position included. Without a session, attach later with
    :meth:`attach` (before the first round).

    Iterating :meth:`batches` (what :func:`prepare` makes the Trainer's data loader) draws one
    global batch per item and yields this peer's share, collated. Raises ValueError for an
    empty dataset or a ``global_batch`` below 1, ImportError naming the ``hf`` extra when a
    path is given and datasets is not installed.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        global_batch: int,
        session: Any = None,
        seed: int = 0,
        drop_last: bool = True,
        used_log: str | os.PathLike[str] | None = None,
    ) -> None:
        if isinstance(dataset, (str, os.PathLike)):
            dataset = _datasets().load_from_disk(str(dataset))
        if not isinstance(global_batch, int) or global_batch < 1:
            raise ValueError(f"global_batch must be an int >= 1, got {global_batch!r}")
        n = len(dataset)
        usable = n - n % global_batch if drop_last else n
        if usable < 1:
            raise ValueError(
                f"the dataset has {n} rows, fewer than one global batch of {global_batch}"
                + (" (drop_last=True)" if drop_last else "")
            )
        self.dataset = dataset
        self.global_batch = global_batch
        self.sampler = ElasticSampler(usable, global_batch, seed=seed, used_log=used_log)
        self.session: Any = None
        if session is not None:
            self.attach(session)

    def __len__(self) -> int:
        """Rows read per epoch (the dataset's, less the dropped tail)."""
        return self.sampler.num_samples

    def attach(self, session: Any) -> None:
        """Register the sampler's position with ``session`` (shared state) and read the rank
        and world of its rounds from then on. Raises RuntimeError if already attached."""
        self.sampler.attach(session)
        self.session = session

    def indices(self) -> list[int]:
        """Draw the next global batch and return this peer's share of it (dataset indices).

        With a session, the share is that of this peer's rank in the last round it was in (on
        an island, this rank's part of its island's share); without one, the whole batch (one
        process). Raises RuntimeError for an empty share (a short last block with
        ``drop_last=False``, or more peers than ``global_batch``)."""
        rank, world = (0, 1) if self.session is None else (self.session.rank, self.session.world)
        island = getattr(self.session, "island", None)  # a peer of several ranks: its own part
        local = {} if island is None else {"local_rank": island.rank, "local_world": island.size}
        idx = self.sampler.indices(rank, world, **local)
        if not idx:
            raise RuntimeError(
                f"rank {rank} of {world} got no sample of a global batch of {self.global_batch}: "
                "use ElasticReader(..., drop_last=True) and a global_batch of at least the "
                "number of peers"
            )
        return idx

    def examples(self, idx: Sequence[int]) -> list[Any]:
        """The dataset's rows at ``idx``, one item (a dict for a ``datasets.Dataset``) each."""
        return _rows(self.dataset, idx)

    def batches(self, collate: Callable[[list[Any]], Any] | None = None) -> _Loader:
        """An endless iterable of this peer's shares, collated by ``collate`` (default: the
        list of rows). Each ``next`` draws one global batch."""
        return _Loader(self, collate)

    def without_columns(self, keep: Callable[[Any], Any]) -> None:
        """Replace the dataset by ``keep(dataset)`` (the Trainer's removal of the columns the
        model does not take); its length must not change. Raises ValueError if it does."""
        kept = keep(self.dataset)
        if len(kept) != len(self.dataset):
            raise ValueError("removing columns must keep every row")
        self.dataset = kept


class _Loader:
    """What a Trainer iterates as its training data loader: endless, one step per item, no
    length (the Trainer then runs by ``max_steps``) and no worker processes (a batch is drawn
    when the Trainer asks for it, after the previous step's round committed)."""

    def __init__(self, reader: ElasticReader, collate: Callable[[list[Any]], Any] | None) -> None:
        self.reader = reader
        self.collate = collate
        self.dataset = reader.dataset  # what Trainer.num_examples reads

    def __iter__(self) -> Iterator[Any]:
        while True:
            rows = self.reader.examples(self.reader.indices())
            yield self.collate(rows) if self.collate is not None else rows


def prepare(
    trainer: Any,
    strategy: Strategy,
    *,
    reader: ElasticReader | None = None,
    save_pretrained: str | os.PathLike[str] | None = None,
    saver_rank: int = 0,
) -> IsthmusCallback:
    """Make ``trainer`` train with ``strategy``; returns the callback it added.

    Sets the Trainer's optimizer to a :class:`StrategyOptimizer` (the Trainer then builds its
    learning-rate schedule on it), adds an :class:`IsthmusCallback` (``save_pretrained``,
    ``saver_rank``), and with ``reader`` makes the Trainer's training data loader the reader's
    batches, collated by ``trainer.data_collator`` (after the Trainer's removal of the columns
    the model does not take, when ``args.remove_unused_columns`` and the dataset is a
    ``datasets.Dataset``). Call it after building the Trainer and before ``train()``.

    Raises ValueError if the Trainer already has an optimizer other than the strategy's inner
    one, or the reader is attached to another session than the strategy's.
    """
    current = getattr(trainer, "optimizer", None)
    if current is not None and current is not strategy.optimizer:
        raise ValueError(
            "the Trainer has an optimizer the strategy does not wrap: build the strategy on "
            "it, or leave Trainer(optimizers=...) out"
        )
    trainer.optimizer = StrategyOptimizer(strategy)
    callback = IsthmusCallback(strategy, save_pretrained=save_pretrained, saver_rank=saver_rank)
    trainer.add_callback(callback)
    if reader is not None:
        if reader.session is None:
            if strategy.resumed_from is not None:
                raise ValueError(
                    "the strategy resumed a checkpoint before the reader's position was "
                    "registered: build ElasticReader(..., session=session) before the strategy"
                )
            reader.attach(strategy.session)
        elif reader.session is not strategy.session:
            raise ValueError("the reader is attached to another session than the strategy's")
        remove = getattr(trainer, "_remove_unused_columns", None)
        if (
            remove is not None
            and trainer.args.remove_unused_columns
            and type(reader.dataset).__module__.startswith("datasets")
        ):
            reader.without_columns(lambda ds: remove(ds, description="training"))
        collate = trainer.data_collator
        # The Trainer asks for its loader when train() starts; this one is the reader's.
        trainer.get_train_dataloader = lambda: reader.batches(collate)
    return callback
