"""The training job one peer runs: the tiny GPT on the stdlib corpus with a chosen strategy.

The demo, the integration tests and the lab all launch peers as ``python -m isthmus.job
<job.json>``. A job trains until the run's step counter reaches ``steps``, appends one JSON line
per step to ``<out_dir>/<name>.jsonl``, and at the end writes ``<name>.final.json`` (digest of
the shared state, eval loss, rounds, bytes) and ``<name>.state.pt`` (the shared state, for
bitwise comparisons).

Exit codes: 0 finished; 2 refused by the coordinator (shared state mismatch) or bad token; 3 the
coordinator was unreachable or no round formed in time; 4 the run was over before this peer could
join; 1 anything else.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash

from isthmus.comm.faults import Fault, FaultInjector
from isthmus.comm.session import RoundTimeout, RunFinished, Session, SessionConfig, StateMismatch
from isthmus.comm.state import tensor_bytes
from isthmus.coordinator.client import AuthError, CoordinatorUnreachable
from isthmus.data import Corpus, evaluate
from isthmus.models import GPT, GPTConfig
from isthmus.strategies import make_strategy

__all__ = ["TrainJob", "run_job"]

log = logging.getLogger("isthmus.job")


@dataclass(kw_only=True)
class TrainJob:
    """Everything one peer needs. Serialized to JSON for the peer process."""

    coordinator: str
    token: str
    name: str
    out_dir: str
    strategy: str = "ddp"
    strategy_options: dict[str, Any] = field(default_factory=dict)
    compression: str | None = None
    """Compressor spec for the strategy's reductions (see isthmus.reduce.compress)."""
    aggregator: str | None = None
    """Robust aggregator spec (see isthmus.reduce.aggregate)."""
    byzantine_f: int = 0
    """How many faulty peers the robust aggregator tolerates."""
    attack: str | None = None
    """Make this peer byzantine (lab and tests): an attack spec from
    isthmus.reduce.aggregate.attacks, e.g. ``sign_flip``, ``ipm``, ``nan``, ``label_flip``."""
    attack_from_step: int = 0
    """The byzantine peer behaves honestly before this step (lab scenarios' ``from_step``)."""
    steps: int = 100
    model: str = "default"
    """``default`` (about 1.3M parameters) or ``tiny`` (tens of thousands, for tests)."""
    batch_size: int = 16
    lr: float = 1e-3
    weight_decay: float = 0.1
    seed: int = 0
    data_seed: int = 0
    corpus_bytes: int = 2_000_000
    shard: str = "interleaved"
    eval_every: int = 0
    eval_batches: int = 8
    faults: list[str] = field(default_factory=list)
    threads: int = 1
    collective_timeout: float = 30.0
    connect_timeout: float = 30.0
    round_timeout: float = 300.0
    interface: str | None = None
    hostname: str | None = None
    save_state: bool = True
    step_delay: float = 0.0
    """Seconds to sleep after each step (tests use it to keep a run alive long enough)."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.model not in ("default", "tiny"):
            raise ValueError(f"model must be 'default' or 'tiny', got {self.model!r}")
        for f in self.faults:
            Fault.parse(f)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @staticmethod
    def from_json(text: str) -> TrainJob:
        return TrainJob(**json.loads(text))


def model_config(preset: str) -> GPTConfig:
    return GPTConfig.tiny() if preset == "tiny" else GPTConfig.default()


def build_corpus(job: TrainJob) -> Corpus:
    return Corpus.from_stdlib(max_bytes=job.corpus_bytes, seed=job.data_seed)


def run_job(job: TrainJob) -> dict[str, Any]:
    """Train as one peer until the run reaches ``job.steps``. Returns the final record."""
    torch.set_num_threads(job.threads)
    out = Path(job.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus = build_corpus(job)
    cfg = model_config(job.model)
    model = GPT(cfg, seed=job.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=job.lr, weight_decay=job.weight_decay, betas=(0.9, 0.95)
    )
    session = Session(
        SessionConfig(
            coordinator=job.coordinator,
            token=job.token,
            name=job.name,
            interface=job.interface,
            hostname=job.hostname,
            collective_timeout=job.collective_timeout,
            connect_timeout=job.connect_timeout,
            round_timeout=job.round_timeout,
        ),
        faults=FaultInjector([Fault.parse(f) for f in job.faults]),
    )
    session.report(corpus=corpus.fingerprint, pid=os.getpid())
    strategy = make_strategy(
        job.strategy,
        session,
        model,
        optimizer,
        compression=job.compression,
        aggregator=job.aggregator,
        byzantine_f=job.byzantine_f,
        **_strategy_options(job),
    )
    flip_targets = (
        _install_attack(job.attack, strategy, job.attack_from_step) if job.attack else None
    )
    metrics = (out / f"{job.name}.jsonl").open("w", buffering=1)
    t0 = time.monotonic()
    try:
        while strategy.step_count < job.steps:
            step = strategy.step_count
            x, y = corpus.batch(
                step=step,
                rank=session.rank,
                world=session.world,
                batch_size=job.batch_size,
                block_size=cfg.block_size,
                seed=job.data_seed,
                shard=job.shard,
            )
            if flip_targets is not None and step >= job.attack_from_step:
                y = flip_targets(y)
            _, loss = model(x, y)
            assert loss is not None
            loss.backward()
            strategy.step()
            optimizer.zero_grad(set_to_none=False)
            record: dict[str, Any] = {
                "ts": round(time.time(), 4),
                "t": round(time.monotonic() - t0, 4),
                "step": step,
                "loss": loss.item(),
                "world": session.world,
                "revision": session.revision,
                "bytes_sent": session.stats.bytes_sent,
            }
            if job.eval_every and strategy.step_count % job.eval_every == 0:
                record["eval_loss"] = evaluate(
                    model, corpus, batch_size=job.batch_size, n_batches=job.eval_batches
                )
            metrics.write(json.dumps(record) + "\n")
            session.report(step=strategy.step_count, loss=record["loss"])
            if job.step_delay:
                time.sleep(job.step_delay)
        strategy.finish()
        final_eval = evaluate(model, corpus, batch_size=job.batch_size, n_batches=job.eval_batches)
        final = {
            "name": job.name,
            "peer_id": session.peer_id,
            "step": strategy.step_count,
            "revision": session.revision,
            "digest": session.state.digest(),
            "model_digest": model_digest(model),
            "eval_loss": final_eval,
            "bytes_sent": session.stats.bytes_sent,
            "bytes_by_op": session.stats.by_op,
            "evictions": session.evictions,
            "rounds": session.rounds,
            "wall_s": round(time.monotonic() - t0, 3),
            "strategy": strategy.metrics(),
        }
        if job.save_state:
            torch.save(session.state.snapshot(), out / f"{job.name}.state.pt")
        (out / f"{job.name}.final.json").write_text(json.dumps(final, indent=1))
        return final
    finally:
        metrics.close()
        session.close()


def _strategy_options(job: TrainJob) -> dict[str, Any]:
    """The job's strategy options, plus the run's length for strategies whose schedule depends
    on it (gossip), unless the options already name it."""
    options = dict(job.strategy_options)
    if job.strategy == "gossip":
        options.setdefault("total_steps", job.steps)
    return options


def model_digest(model: torch.nn.Module) -> str:
    """Hash of the model's parameters (names and bytes): equal on peers that hold the same model,
    also for strategies whose shared state does not include the parameters (gossip)."""
    h = xxhash.xxh3_64()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(tensor_bytes(p))
    return h.hexdigest()


def _install_attack(spec: str, strategy: Any, from_step: int = 0) -> Any:
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


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m isthmus.job JOB.json", file=sys.stderr)
        return 1
    job = TrainJob.from_json(Path(args[0]).read_text())
    logging.basicConfig(
        level=os.environ.get("ISTHMUS_LOG", "INFO"),
        format=f"%(asctime)s {job.name} %(name)s %(levelname)s %(message)s",
    )
    try:
        run_job(job)
    except (StateMismatch, AuthError) as e:
        log.error("%s", e)
        return 2
    except (CoordinatorUnreachable, RoundTimeout) as e:
        log.error("%s", e)
        return 3
    except RunFinished as e:
        log.warning("%s", e)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
