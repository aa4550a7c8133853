"""torchft's side of ``benchmarks/peers.py``: one replica group (one process) per lab peer, and the
lighthouse. Written against torchft 0.2.0's public API (``Manager``, ``ProcessGroupGloo``,
``DistributedDataParallel``, ``local_sgd.DiLoCo``, ``coordination.LighthouseServer``).

    python benchmarks/peers_torchft.py --lighthouse PORT MIN_REPLICAS JOIN_TIMEOUT_MS HEARTBEAT_MS
    python benchmarks/peers_torchft.py JOB.json SLOT NAME [--join]

Modes (``job["mode"]``):

* ``ddp``: the manager-based data parallel torchft documents: ``DistributedDataParallel(manager,
  model)`` (gradients all-reduced through the manager), the quorum started before the forward
  (asynchronous quorum) and the optimizer stepped only when ``manager.should_commit()`` says so
  (what ``torchft.optim.OptimizerWrapper`` does; called directly here so that each commit
  decision is recorded).
* ``allreduce``: the same loop without the DDP wrapper: the gradients, flattened, go through
  ``manager.allreduce`` (torchft's fault-tolerant all-reduce, an average over the participants).
  A peer killed mid-step makes the wrapper's comm hook fail an assertion on the survivors
  (``torchft/ddp.py``: ``assert fut._fut``); this mode is the same data parallel without it.
* ``diloco``: ``torchft.local_sgd.DiLoCo`` with the whole model as one fragment, outer SGD with
  Nesterov momentum, synchronous quorum (DiLoCo requires it).
* ``diloco-bucketized``, ``streaming-bucketized``: the same with ``use_bucketization=True``:
  torchft's default all-reduces the pseudo-gradient one parameter tensor at a time (28 rounds of
  the ring for the tiny GPT, each paying the link's latency); bucketized, it sends one flat buffer.
* ``streaming``: the same class with ``fragments`` fragments (layers strided as isthmus's
  Streaming DiLoCo cuts them: block j goes to fragment j mod P, the embeddings and the final norm
  to fragment 0), ``fragment_sync_delay`` = overlap and ``fragment_update_alpha`` = alpha.

Each replica group holds its own TCPStore (torchft meets on the quorum's primary's store) and
advertises the namespace's address. A step record carries ``commit`` and ``participating`` when
a commit decision was made in that step; ``commit`` records carry the manager's step and the
number of participants.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from typing import Any

import torch
from peers_common import Recorder, Trainer, barrier, connect_store, run_worker

REPLICA_STORE_PORT = 29600


def lighthouse(port: int, min_replicas: int, join_timeout_ms: int, heartbeat_ms: int) -> None:
    """Run torchft's lighthouse until killed; prints its address once it listens."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind=f"[::]:{port}",
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=100,
        heartbeat_timeout_ms=heartbeat_ms,
    )
    print(f"lighthouse {server.address()}", flush=True)
    while True:
        time.sleep(3600)


def fragments_of(model: torch.nn.Module, p: int) -> list[torch.nn.Module]:
    """The model cut as isthmus's strided Streaming DiLoCo cuts it: block j in fragment j mod P,
    everything outside the blocks in fragment 0."""
    blocks = model.blocks  # type: ignore[attr-defined]
    out: list[torch.nn.Module] = []
    for f in range(p):
        parts = torch.nn.ModuleDict({f"block{j}": blocks[j] for j in range(f, len(blocks), p)})
        if f == 0:
            for name in ("tok_emb", "pos_emb", "ln_f", "lm_head"):
                parts[name] = getattr(model, name)
        out.append(parts)
    return out


def worker(job: dict[str, Any], slot: int, name: str, joiner: bool, rec: Recorder) -> None:
    from torchft import Manager, ProcessGroupGloo
    from torchft.ddp import DistributedDataParallel
    from torchft.local_sgd import DiLoCo

    t = Trainer(job, slot)
    # "diloco-bucketized": DiLoCo with use_bucketization=True (one flat all-reduce per sync
    # instead of one per parameter tensor)
    mode, _, variant = job["mode"].partition("-")
    data_parallel = mode in ("ddp", "allreduce")
    me = job["hosts"][slot]
    inner = t.inner_optimizer()
    # the replica group's own store (a group of one process here); torchft's peers meet on the
    # store of the quorum's primary, so it must listen on the namespace's address
    port = REPLICA_STORE_PORT + slot  # distinct ports, so that a loopback trial also works
    replica_store = torch.distributed.TCPStore(
        me,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=job["start_timeout"]),
    )
    outer: list[torch.optim.Optimizer] = []
    frags: list[torch.nn.Module] = []
    if not data_parallel:
        frags = fragments_of(t.model, job["fragments"] if mode == "streaming" else 1)
        outer = [
            torch.optim.SGD(
                f.parameters(), lr=job["outer_lr"], momentum=job["outer_momentum"], nesterov=True
            )
            for f in frags
        ]

    def state_dict() -> dict[str, Any]:
        return {
            "model": t.model.state_dict(),
            "inner": inner.state_dict(),
            "outer": [o.state_dict() for o in outer],
        }

    def load_state_dict(sd: dict[str, Any]) -> None:
        t.model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])
        for o, s in zip(outer, sd["outer"], strict=True):
            o.load_state_dict(s)

    timeout = timedelta(seconds=job["collective_timeout"])
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=job["min_replicas"],
        use_async_quorum=data_parallel,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=job["quorum_timeout"]),
        connect_timeout=timedelta(seconds=job["start_timeout"]),
        rank=0,
        world_size=1,
        store_addr=me,
        store_port=port,
        lighthouse_addr=job["lighthouse"],
        replica_id=f"peer{slot}",
        hostname=me,
        heartbeat_interval=timedelta(milliseconds=100),
        # every peer builds the same initial model (GPT(seed)): nothing to copy at step 0; a
        # joiner heals from a live peer (torchft's checkpoint transport over HTTP)
        init_sync=False,
    )
    rec.write("ready", replica_store=f"{me}:{port}")
    if not joiner:
        store = connect_store(job)
        barrier(store, "start", job["peers"], job["start_timeout"])
    rec.write("start")
    # the run ends when the replicas have committed as many synchronizations as the budget
    # holds: every step for DDP, one per H/P inner steps for the DiLoCo family
    per_sync = 1 if data_parallel else job["sync_every"] // len(frags)
    goal = job["steps"] // per_sync
    step = 0
    if data_parallel:
        ddp = DistributedDataParallel(manager, t.model) if mode == "ddp" else t.model
        params = [p for p in t.model.parameters() if p.requires_grad]
        while manager.current_step() < goal:
            manager.start_quorum()
            inner.zero_grad()
            # the run's step counter is the committed step (a healed joiner jumps to it)
            loss = t.loss(ddp, step)
            loss.backward()
            if mode == "allreduce":
                # the gradients as one flat tensor through the manager's fault-tolerant
                # all-reduce (an average over the participants), then back into .grad
                flat = torch.cat([p.grad.reshape(-1) for p in params])
                manager.allreduce(flat).wait()
                offset = 0
                for p in params:
                    n = p.numel()
                    p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                    offset += n
            participating = manager.is_participating()
            members = manager.num_participants()
            ok = manager.should_commit()
            if ok:
                inner.step()
            fields: dict[str, Any] = {"step": step, "loss": float(loss)}
            if ok and manager.current_step() % job["eval_every"] == 0:
                fields["eval_loss"] = t.eval_loss()
            rec.write("step", **fields)
            rec.write(
                "commit",
                ok=ok,
                manager_step=manager.current_step(),
                participants=members,
                participating=participating,
            )
            step = manager.current_step()
            if job["step_delay"]:
                time.sleep(job["step_delay"])
    else:
        with DiLoCo(
            manager,
            frags,
            inner,
            outer if len(outer) > 1 else outer[0],
            sync_every=job["sync_every"],
            pin_memory=False,
            use_bucketization=(variant == "bucketized"),
            fragment_sync_delay=job["overlap"] if mode == "streaming" else 0,
            fragment_update_alpha=job["alpha"] if mode == "streaming" else 0.0,
        ):
            while manager.current_step() < goal:
                before = manager.current_step()
                inner.zero_grad()
                loss = t.loss(t.model, step)
                loss.backward()
                synced = time.time()
                inner.step()  # DiLoCo's hook: prepare or perform a fragment's sync when due
                fields = {"step": step, "loss": float(loss)}
                if (step + 1) % job["eval_every"] == 0:
                    fields["eval_loss"] = t.eval_loss()
                rec.write("step", **fields)
                if (step + 1) % per_sync == 0:  # a fragment's sync was performed in this step
                    rec.write(
                        "commit",
                        ok=manager.current_step() > before,
                        manager_step=manager.current_step(),
                        participants=manager.num_participants(),
                        participating=manager.is_participating(),
                        sync_s=round(time.time() - synced, 4),
                    )
                step += 1
                if job["step_delay"]:
                    time.sleep(job["step_delay"])
    rec.write("final", eval_loss=t.eval_loss(), steps=step, manager_step=manager.current_step())
    manager.shutdown(wait=False)
    del replica_store


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--lighthouse":
        lighthouse(*(int(x) for x in sys.argv[2:]))
    else:
        run_worker(worker)
