"""The built-in job: the code inside each peer process of ``isthmus demo`` and ``isthmus lab run``.

It trains the tiny GPT on the stdlib corpus with the run's strategy. It runs in the peer, never in
the launcher: the launching side is :class:`~isthmus.run.programs.BuiltinJob` and
:mod:`isthmus.run.builtin_run`.

The launcher starts it as ``python -m isthmus.run.job <name>.job.json``. A :class:`PeerJob` is
the run's :class:`~isthmus.run.config.RunConfig` plus what differs per peer (:class:`PeerSpec`:
its name, the coordinator, its injected faults and attack, where Gloo binds). The job trains
until the run's step counter reaches ``run.steps``, appends one JSON line per step to
``<name>.jsonl``, and at the end writes ``<name>.final.json`` (a :class:`~isthmus.run.record.PeerResult`) and
``<name>.state.pt`` (the shared state, for bitwise comparisons).

Exit codes (:data:`EXIT_CODES`): 0 finished; 2 refused by the coordinator (shared state mismatch),
a bad token or a bad config; 3 the coordinator was unreachable or no round formed in time; 4 the
run was over before this peer could join; 1 anything else.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
import xxhash

from isthmus.checkpoint import (
    CheckpointMismatch,
    StorageError,
)
from isthmus.comm.faults import Fault, FaultInjector
from isthmus.comm.session import RoundTimeout, RunFinished, Session, SessionConfig, StateMismatch
from isthmus.comm.state import tensor_bytes
from isthmus.coordinator.client import AuthError, CoordinatorUnreachable
from isthmus.data import Corpus, evaluate
from isthmus.data.global_batch import GlobalOrder
from isthmus.models import GPT, GPTConfig
from isthmus.run.config import RunConfig, from_dict, from_flat, strategy_options
from isthmus.run.record import LATE_JOINER_EXIT, PeerResult, RunDir
from isthmus.spec import SpecError
from isthmus.strategies import Strategy, make_strategy

__all__ = [
    "EXIT_CODES",
    "PeerJob",
    "PeerSpec",
    "build_corpus",
    "build_model",
    "model_digest",
    "run_job",
]

log = logging.getLogger("isthmus.job")

EXIT_CODES = {
    0: "finished",
    1: "failed",
    2: "refused",
    3: "no coordinator or no round",
    4: "too late",
}
"""What a peer's exit code means (negative: killed by that signal)."""


@dataclass(kw_only=True)
class PeerSpec:
    """What differs from one peer to the next."""

    name: str
    coordinator: str
    """The coordinator's ``host:port``."""
    token: str
    coordinator_fingerprint: str | None = None
    """Pin the coordinator's TLS certificate (see :class:`SessionConfig`)."""
    out_dir: str
    """The run directory."""
    faults: list[str] = field(default_factory=list)
    """Fault specs this peer fires on itself (see :mod:`isthmus.comm.faults`)."""
    attack: str | None = None
    """Make this peer byzantine: an attack spec (lab and tests)."""
    attack_from_step: int = 0
    """The byzantine peer behaves honestly before this step."""
    interface: str | None = None
    hostname: str | None = None
    """Address Gloo binds and advertises (the lab's namespace address)."""
    save_state: bool = True

    def __post_init__(self) -> None:
        for f in self.faults:
            Fault.parse(f)


@dataclass(kw_only=True)
class PeerJob:
    """Everything one peer needs; serialized to ``<name>.job.json``."""

    run: RunConfig
    peer: PeerSpec

    def to_json(self) -> str:
        return json.dumps(
            {"run": dataclasses.asdict(self.run), "peer": dataclasses.asdict(self.peer)}
        )

    @staticmethod
    def from_json(text: str) -> PeerJob:
        data = json.loads(text)
        return PeerJob(run=from_dict(data["run"]), peer=PeerSpec(**data["peer"]))

    @staticmethod
    def from_flat(**values: Any) -> PeerJob:
        """A job from flat names: :class:`PeerSpec` fields plus any of the run's flat names
        (``steps=30, model="tiny", strategy="diloco", option={...}``)."""
        peer_keys = {f.name for f in dataclasses.fields(PeerSpec)}
        peer = {k: values.pop(k) for k in list(values) if k in peer_keys}
        return PeerJob(run=from_flat(**values), peer=PeerSpec(**peer))


def model_config(preset: str) -> GPTConfig:
    """The GPT of a ``model.preset`` (``tiny``, ``default``, ``medium``: ``GPTConfig.preset``)."""
    return GPTConfig.preset(preset)


def _report_links(session: Session, addr: str | None) -> None:
    """Report the bandwidth to the other peers (``ISTHMUS_LINKS``: JSON, peer address -> Mbit/s,
    which the lab sets from its scenario) and this peer's address, for the coordinator's ring
    order (:mod:`isthmus.coordinator.ring`). These win over what the peers probe themselves
    (``strategy.probe_links``), pair by pair: they are the network as configured. A malformed
    value is logged and ignored: the ring then uses the probes, or stays in name order."""
    raw = os.environ.get("ISTHMUS_LINKS")
    if not raw or not addr:
        return
    try:
        links = {str(k): float(v) for k, v in json.loads(raw).items()}
    except (ValueError, AttributeError, TypeError) as e:
        log.warning("ignoring ISTHMUS_LINKS (%s): %.100s", e, raw)
        return
    session.report(links=links, addr=addr)


def build_corpus(run: RunConfig) -> Corpus:
    return Corpus.from_stdlib(max_bytes=run.data.corpus_bytes, seed=run.data.seed)


def build_model(run: RunConfig) -> GPT:
    """The run's model, with ``model.init_from``'s state_dict loaded when given. Raises
    ValueError naming ``model.init_from`` for a file that cannot be read or does not fit."""
    model = GPT(model_config(run.model.preset), seed=run.model.seed)
    if run.model.init_from:
        try:
            model.load_state_dict(torch.load(run.model.init_from, weights_only=True))
        except (OSError, RuntimeError, KeyError, TypeError) as e:
            raise ValueError(
                f"model.init_from: cannot load {run.model.init_from!r} into the "
                f"{run.model.preset} model: {e}"
            ) from e
    return model


def island_shard(run: RunConfig, model: GPT) -> tuple[int, int]:
    """``(local rank, ranks)`` of this process in its peer: ``(0, 1)`` for a peer of one
    process; on a rank of an island (``run.nproc_per_peer`` > 1, started by
    :mod:`isthmus.run.island` with torchrun's environment) the island's process group is
    initialized (Gloo) and the model sharded with FSDP2 (each block, then the whole), so the
    session built next finds the island. Raises RuntimeError when the launcher did not start
    this process as a rank of an island of that size."""
    if run.nproc_per_peer == 1:
        return 0, 1
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size != run.nproc_per_peer:
        raise RuntimeError(
            f"run.nproc_per_peer is {run.nproc_per_peer} but this process is one of {size}: "
            "start islands through isthmus demo or the lab (isthmus.run.island)"
        )
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return dist.get_rank(), size


def model_digest(model: torch.nn.Module) -> str:
    """Hash of the model's parameters (names and bytes): equal on peers that hold the same model,
    also for strategies whose shared state does not include the parameters (gossip)."""
    h = xxhash.xxh3_64()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(tensor_bytes(p))
    return h.hexdigest()


def install_attack(spec: str, strategy: Strategy, from_step: int = 0) -> Any:
    """Make this peer byzantine (from step ``from_step`` on). Vector attacks forge this peer's
    update from what it can know: its own honest update and the committed aggregates (see
    :class:`~isthmus.reduce.aggregate.attacks.PeerAttack`); data attacks corrupt its training
    targets. Returns the target corruption function for data attacks, else None."""
    from isthmus.reduce.aggregate.attacks import PeerAttack, make_attack

    attack = make_attack(spec)
    log.warning("this peer is byzantine: attack %s", attack.spec)
    if attack.level == "data":
        return attack.corrupt_targets
    if strategy.reducer is None:
        raise ValueError(f"strategy {strategy.name} has no reducer to attack")
    strategy.reducer.attack = PeerAttack(attack, active=lambda: strategy.step_count >= from_step)
    return None


def global_batch_loss(
    model: GPT, corpus: Corpus, order: GlobalOrder, block_size: int, flip: Any = None
) -> Any:
    """The loss function of a fixed-global-batch step: positions -> the mean loss of their
    training windows (sample ``i`` is the window starting at byte ``i`` of the training split;
    the tiny GPT draws nothing at random, so no per-sample seed is needed)."""

    def loss_fn(positions: list[int]) -> torch.Tensor:
        starts = torch.from_numpy(order(positions))
        x, y = corpus.windows(starts, block_size)
        if flip is not None:
            y = flip(y)
        _, loss = model(x, y)
        assert loss is not None
        return loss

    return loss_fn


def run_job(job: PeerJob) -> PeerResult:
    """Train as one peer until the run reaches ``job.run.steps``. Returns the final record."""
    run, me = job.run, job.peer
    torch.set_num_threads(run.threads)
    out = RunDir(me.out_dir)
    out.path.mkdir(parents=True, exist_ok=True)
    corpus = build_corpus(run)
    model = build_model(run)
    block_size = model.config.block_size
    local, ranks = island_shard(run, model)  # an island's rank: the model sharded with FSDP2
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=run.optim.lr, weight_decay=run.optim.weight_decay, betas=(0.9, 0.95)
    )
    t = run.timeouts
    session = Session(
        SessionConfig(
            coordinator=me.coordinator,
            token=me.token,
            coordinator_fingerprint=me.coordinator_fingerprint,
            name=me.name,
            interface=me.interface,
            hostname=me.hostname,
            collective_timeout=t.collective_timeout,
            connect_timeout=t.connect_timeout,
            round_timeout=t.round_timeout,
            stall_s=t.stall_s,
            late_s=t.late_s,
            connections=run.strategy.connections,
            probe_links=run.strategy.probe_links,
            pipeline_commit=run.strategy.pipeline_commit,
            mesh=run.strategy.mesh,
            mesh_relay=run.strategy.mesh,  # a reachable peer relays between NATed ones
            checkpoint_dir=run.checkpoint.checkpoint_dir,
            checkpoint_every=run.checkpoint.checkpoint_every,
            checkpoint_keep=run.checkpoint.checkpoint_keep,
            resume=run.checkpoint.resume,
            tensorboard=run.output.tensorboard,
        ),
        faults=FaultInjector([Fault.parse(f) for f in me.faults]),
    )
    session.report(corpus=corpus.fingerprint, pid=os.getpid())
    _report_links(session, me.hostname)
    s = run.strategy
    options = strategy_options(s.name, s.options, run.steps)
    if run.data.global_batch:
        options.setdefault("global_batch", run.data.global_batch)
        options.setdefault("micro_batch", run.data.batch_size)
    strategy = make_strategy(
        s.name,
        session,
        model,
        optimizer,
        compression=s.compression,
        aggregator=s.aggregator,
        byzantine_f=s.byzantine_f,
        **options,
    )
    strategy.run_steps = run.steps  # its last round begins no other (pipeline_commit)
    flip = install_attack(me.attack, strategy, me.attack_from_step) if me.attack else None
    # with a fixed global batch: global-stream position -> training window start
    order = GlobalOrder(len(corpus.train_data) - block_size, seed=run.data.seed)
    checkpointer = strategy.checkpointer
    # the peer's records are written once: by its only process, or its island's rank 0
    records = out.records_path(me.name) if local == 0 else Path(os.devnull)
    metrics = records.open("w", buffering=1)
    t0 = time.monotonic()
    ev = run.eval
    try:
        # the catch-up round of the DiLoCo family and gossip, before the first forward pass
        # (else the first step would be that round, its forward and backward pass thrown away)
        strategy.join()
        while strategy.step_count < run.steps:
            step = strategy.step_count
            x, y = corpus.batch(
                step=step,
                rank=session.rank * ranks + local,  # an island's ranks: each its own batch
                world=session.world * ranks,
                batch_size=run.data.batch_size,
                block_size=block_size,
                seed=run.data.seed,
                shard=run.data.shard,
            )
            if flip is not None and step >= me.attack_from_step:
                y = flip(y)
            extra: dict[str, Any] = {}
            before = strategy.step_count
            revision, began = session.revision, time.monotonic()
            timing: dict[str, Any] = {}  # this step's work and sync seconds (stragglers)
            if getattr(strategy, "takes_batch_fn", False):
                # fixed global batch (DDP): the strategy picks the samples inside the round
                strategy.step(global_batch_loss(model, corpus, order, block_size, flip))
                work_s = strategy.work_s + run.step_delay  # type: ignore[attr-defined]
                timing = {"work_s": work_s, "sync_s": time.monotonic() - began - work_s}
                loss_value = float(strategy.last_loss)  # type: ignore[attr-defined]
                share = strategy.last_share  # type: ignore[attr-defined]
                extra["samples"] = [int(i) for i in order(share)]
                step = strategy.step_count - 1  # the committed step (a joiner's was stale)
            elif getattr(strategy, "takes_loss_fn", False):
                # zeroth order (zo): forward passes at perturbed points inside the step, no
                # backward; its loss is the mean of those passes
                def zo_loss(shard: int | None = None, shards: int = 1, x=x, y=y, step=step) -> Any:
                    if shard is not None:  # zo's pairs: both members of a pair on its shard
                        x, y = corpus.batch(
                            step=step,
                            rank=shard,
                            world=shards,
                            batch_size=run.data.batch_size,
                            block_size=block_size,
                            seed=run.data.seed,
                            shard=run.data.shard,
                        )
                    return model(x, y)[1]

                strategy.step(zo_loss)
                loss_value = float(strategy.last_loss)  # type: ignore[attr-defined]
                if not math.isfinite(loss_value):  # it sent no estimate (resynced): measure
                    with torch.no_grad():
                        loss_value = float(model(x, y)[1])
            else:
                work = time.monotonic()
                _, loss = model(x, y)
                assert loss is not None
                loss.backward()
                # a slow fault stretches this step's work (and its emulated compute time)
                session.faults.pace(step, time.monotonic() - work + run.step_delay)
                synced = time.monotonic()
                strategy.step()
                timing = {
                    "work_s": synced - work + run.step_delay,
                    "sync_s": time.monotonic() - synced,
                }
                optimizer.zero_grad(set_to_none=False)
                loss_value = loss.item()
            record: dict[str, Any] = {
                "ts": round(time.time(), 4),
                "t": round(time.monotonic() - t0, 4),
                "step": step,
                "loss": loss_value,
                "world": session.world,
                "revision": session.revision,
                "bytes_sent": session.stats.bytes_sent,
                **extra,
            }
            # an eval after every eval_every steps trained, not after a step that trained
            # nothing (an aborted round's, a catch-up round's), which would repeat the last one
            advanced = strategy.step_count != before
            if ev.eval_every and advanced and strategy.step_count % ev.eval_every == 0:
                record["eval_loss"] = evaluate(
                    model, corpus, batch_size=run.data.batch_size, n_batches=ev.eval_batches
                )
            metrics.write(json.dumps(record) + "\n")
            if timing and session.revision == revision:
                del timing["sync_s"]  # no round in this step: nothing synchronized
            if timing:  # the coordinator's straggler detection reads it with the heartbeats
                timing = {k: round(v, 6) for k, v in timing.items()}
                timing["step"] = strategy.step_count
            session.report(step=strategy.step_count, loss=record["loss"], timing=timing or None)
            scalars = {"loss": record["loss"], "lr": optimizer.param_groups[0]["lr"]}
            if "eval_loss" in record:
                scalars["eval_loss"] = record["eval_loss"]
            session.log_scalars(step, **scalars)
            if run.step_delay:
                time.sleep(run.step_delay)
        strategy.finish()  # and the run's last checkpoint, so a resume continues from its end
        result = PeerResult(
            name=me.name,
            peer_id=session.peer_id,
            step=strategy.step_count,
            revision=session.revision,
            digest=session.state.digest(),
            model_digest=model_digest(model) if ranks == 1 else session.state.digest(),
            eval_loss=evaluate(
                model, corpus, batch_size=run.data.batch_size, n_batches=ev.eval_batches
            ),
            # an island's figure is its ranks' sum (each sends its own shards)
            bytes_sent=sum(getattr(session, "island_bytes", [session.stats.bytes_sent])),
            bytes_by_op=session.stats.by_op,
            evictions=session.evictions,
            restores=session.restores,
            rounds=list(session.rounds),
            wall_s=round(time.monotonic() - t0, 3),
            strategy=strategy.metrics(),
            checkpoint={
                **(checkpointer.metrics() if checkpointer is not None else {}),
                **(
                    {"resume_s": round(strategy.resume_s, 4)}
                    if strategy.resumed_from is not None
                    else {}
                ),
            },
            resumed_from=strategy.resumed_from,
        )
        if local == 0:  # an island's other ranks hold shards of the same state
            if me.save_state:
                torch.save(session.state.snapshot(), out.state_path(me.name))
            out.final_path(me.name).write_text(json.dumps(dataclasses.asdict(result), indent=1))
        return result
    finally:
        metrics.close()
        session.close()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m isthmus.run.job JOB.json", file=sys.stderr)
        return 1
    name = Path(args[0]).name.removesuffix(".job.json")
    logging.basicConfig(
        level=os.environ.get("ISTHMUS_LOG", "INFO"),
        format=f"%(asctime)s {name} %(name)s %(levelname)s %(message)s",
    )
    try:
        job = PeerJob.from_json(Path(args[0]).read_text())
        run_job(job)
    except (StateMismatch, AuthError, SpecError, CheckpointMismatch, StorageError) as e:
        log.error("%s", e)
        return 2
    except (CoordinatorUnreachable, RoundTimeout) as e:
        log.error("%s", e)
        return 3
    except RunFinished as e:
        log.warning("%s", e)
        return LATE_JOINER_EXIT
    return 0


def _leave(code: int) -> NoReturn:
    """End the process without the interpreter's shutdown. A group or connection attempt that a
    silent member left inside Gloo (see :mod:`isthmus.comm.connect`) is parked until Gloo's own
    timeout, and destroying it at interpreter exit could block until then: a peer that has
    written its results would stay alive for up to its ``collective_timeout``. Everything the
    job writes is closed when :func:`main` returns."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def entry(argv: list[str]) -> NoReturn:
    """What ``python -m isthmus.run.job JOB.json`` runs, for a peer forked from the warm server
    (:mod:`isthmus.run.forkserver`) where this module is already imported."""
    _leave(main(argv))


if __name__ == "__main__":
    _leave(main())
