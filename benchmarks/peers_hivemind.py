"""hivemind's side of ``benchmarks/peers.py``: one process per lab peer, each with its own DHT node
(hivemind's p2p daemon) and a ``hivemind.Optimizer``. Written against hivemind 1.1.12's public API.

    python benchmarks/peers_hivemind.py JOB.json SLOT NAME [--join]

The DHT bootstraps inside the lab only: peer 0 starts first and publishes its multiaddresses on
the driver's store; every other peer takes them as ``initial_peers`` (a joiner takes every starting
peer's that were published, and tries three times: ``dht_retry`` records). No public bootstrap
peer is contacted.

Modes (``job["mode"]``):

* ``dp``: hivemind's default, "equivalent to synchronous training with target_batch_size": each
  peer accumulates gradients until the swarm has ``target_batch`` samples, then the peers average
  gradients in an all-reduce and each steps its AdamW. With ``target_batch`` = peers x batch, one
  epoch is one DDP step of the same global batch.
* ``local``: ``use_local_updates=True``: every peer steps its AdamW on every batch, and the peers
  average parameters once the swarm has ``target_batch`` samples (peers x batch x H: every H
  steps of each peer): local SGD, the closest hivemind has to DiLoCo (no outer optimizer).

Every peer runs ``steps`` local steps, the same tokens per peer as the other systems (hivemind
counts an epoch from the peers' reported rates, so its epochs do not hold exactly
``target_batch`` samples), and evaluates its model every ``eval_every`` steps. hivemind's own log lines about averaging and epochs are recorded (``log``) and read by
``peers_measure.hivemind_events``.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from peers_common import Recorder, Trainer, barrier, connect_store, run_worker

LOGGED = (
    "Averaged gradients with",
    "Averaging gradients failed",
    "Proceeding with local gradients",
    "Skipped averaging",
    "Averaged parameters with",
    "Averaging failed with",
    "Transitioning to epoch",
    "Catching up with",
    "Peer is out of sync",
    "Failed to load state",
)
"""The hivemind log messages worth a record (the rest is progress chatter)."""


class _Capture(logging.Handler):
    def __init__(self, rec: Recorder) -> None:
        super().__init__(level=logging.DEBUG)
        self.rec = rec

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith(LOGGED):
            self.rec.write("log", logger=record.name, msg=msg)


def worker(job: dict[str, Any], slot: int, name: str, joiner: bool, rec: Recorder) -> None:
    import hivemind

    t = Trainer(job, slot)
    me = job["hosts"][slot]
    store = connect_store(job)
    if slot == 0 and not joiner:
        dht = hivemind.DHT(start=True, host_maddrs=[f"/ip4/{me}/tcp/0"])
    else:
        # peer 0's addresses (waits, bounded, until it published them), and those of every
        # other peer that already did: a joiner needs only one of them to answer
        initial = json.loads(store.get("hivemind/maddrs/0"))
        for other in range(1, job["peers"]):
            if other != slot and store.check([f"hivemind/maddrs/{other}"]):
                initial += json.loads(store.get(f"hivemind/maddrs/{other}"))
        dht = None
        for attempt in range(3):  # the daemon gives up on its bootstrap peers after ~1 s
            try:
                dht = hivemind.DHT(
                    start=True, initial_peers=initial, host_maddrs=[f"/ip4/{me}/tcp/0"]
                )
                break
            except Exception as e:  # recorded: what failed, and that it was tried again
                rec.write("dht_retry", attempt=attempt, error=f"{type(e).__name__}: {e}")
        if dht is None:
            raise RuntimeError(f"no DHT after 3 attempts to bootstrap from {initial}")
    if not joiner:
        store.set(f"hivemind/maddrs/{slot}", json.dumps([str(a) for a in dht.get_visible_maddrs()]))
    logging.getLogger("hivemind").addHandler(_Capture(rec))
    mode = job["mode"]
    per_epoch = job["target_batch"]
    opt = hivemind.Optimizer(
        dht=dht,
        run_id="isthmus-peers",
        target_batch_size=per_epoch,
        batch_size_per_step=job["batch_size"],
        optimizer=lambda params: t.inner_optimizer(params),
        params=t.model.parameters(),
        matchmaking_time=job["matchmaking_time"],
        averaging_timeout=job["collective_timeout"],
        use_local_updates=(mode == "local"),
        tracker_opts=job.get("tracker_opts") or {},
        averager_opts=job.get("averager_opts") or {},
        verbose=True,
    )
    rec.write("ready", maddrs=[str(a) for a in dht.get_visible_maddrs()])
    if not joiner:
        barrier(store, "start", job["peers"], job["start_timeout"])
    rec.write("start", epoch=opt.local_epoch)
    step = 0
    while step < job["steps"]:
        before = opt.local_epoch
        opt.zero_grad()
        loss = t.loss(t.model, step)
        loss.backward()
        opt.step()
        fields: dict[str, Any] = {"step": step, "loss": loss.item(), "epoch": opt.local_epoch}
        if (step + 1) % job["eval_every"] == 0:
            fields["eval_loss"] = t.eval_loss()
        rec.write("step", **fields)
        if opt.local_epoch != before:
            rec.write("commit", epoch=opt.local_epoch, from_epoch=before)
        step += 1
        if job["step_delay"]:
            time.sleep(job["step_delay"])
    rec.write("final", eval_loss=t.eval_loss(), steps=step, epoch=opt.local_epoch)
    opt.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    run_worker(worker)
