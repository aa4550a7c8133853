"""isthmus's side of ``benchmarks/peers.py``: each system's strategy, options and compression,
and one run through ``isthmus.run.lab_run.run_lab`` (what ``isthmus lab run`` does) on the scenario
``peers_lab.Setup`` writes, measured from its run directory (``RunDir``/``Summary``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from peers_goodput import Failure, goodput_row, isthmus_attempts, starters
from peers_lab import Setup
from peers_measure import eval_curve, first_after, isthmus_commits, isthmus_join_commit


def _diloco(s: Setup) -> dict[str, Any]:
    return {"sync_every": s.sync_every, "outer_lr": s.outer_lr, "outer_momentum": s.outer_momentum}


def _streaming(s: Setup) -> dict[str, Any]:
    return {**_diloco(s), "fragments": s.fragments, "overlap": s.overlap, "alpha": s.alpha}


# name -> (strategy, its options, compression of the outer gradients); e3m0: isthmus's 4-bit
# quantized all-reduce. SparseLoCo keeps its own defaults (top-k of 64 per 4096, 1-bit values,
# outer lr 2.5, no momentum) with the same H.
ISTHMUS = {
    "isthmus-ddp": ("ddp", lambda s: {}, "none"),
    "isthmus-diloco": ("diloco", _diloco, "none"),
    "isthmus-streaming": ("streaming", _streaming, "none"),
    "isthmus-diloco-e3m0": ("diloco", _diloco, "e3m0"),
    "isthmus-streaming-e3m0": ("streaming", _streaming, "e3m0"),
    "isthmus-sparseloco": ("sparseloco", lambda s: {"sync_every": s.sync_every}, "none"),
}


def run_isthmus(
    name: str, setup: Setup, run_dir: Path, fault: bool, failures: Sequence[Failure] = ()
) -> dict[str, Any]:
    from isthmus.lab.scenario import parse_scenario
    from isthmus.run.lab_run import LabOptions, run_lab
    from isthmus.run.record import RunDir

    strategy, options, compression = ISTHMUS[name]
    text = setup.scenario(
        name, strategy, options(setup), fault, compression=compression, failures=failures
    )
    summary = run_lab(
        parse_scenario(text, source=name),
        LabOptions(network="netns", prefix="isthp"),
        overrides={
            "run_dir": str(run_dir),
            "steps": setup.steps_for(name, fault),
            "eval_every": setup.eval_every,
            "eval_batches": setup.eval_batches,
            "batch_size": setup.batch_size,
            "lr": setup.lr,
            "weight_decay": setup.weight_decay,
            "corpus_bytes": setup.corpus_bytes,
            "collective_timeout": setup.collective_timeout,
            "heartbeat_timeout": setup.heartbeat_timeout,
            "step_delay": setup.step_delay if fault else 0.0,
            "timeout": setup.run_timeout,
            "progress": False,
        },
    )
    d = RunDir(run_dir)
    events = d.events()
    epochs = [e for e in events if e["kind"] == "epoch"]
    if not epochs:
        return {"errors": ["no round ever formed"], "exit_codes": summary.exit_codes}
    t0 = float(epochs[0]["ts"])
    records = {n: d.records(n) for n in summary.exit_codes}
    row: dict[str, Any] = {"exit_codes": summary.exit_codes, "run_dir": str(run_dir)}
    errors = [f"{n} exited {rc}" for n, rc in summary.exit_codes.items() if rc not in (0, -9)]
    if not fault:
        lab = summary.lab
        per_peer = (lab.bytes_check.get("per_peer") or {}) if lab is not None else {}
        tx = {n: int(v["wire_tx_bytes"]) for n, v in per_peer.items()}
        last = [r["ts"] for recs in records.values() for r in recs]
        row.update(
            curve=eval_curve(starters(records), t0),
            final_eval_loss=summary.final_eval_loss,
            train_wall_s=round(max(last) - t0, 3) if last else None,
            tx_per_peer=tx,
            tx_per_peer_mean=sum(tx.values()) / len(tx) if tx else None,
            tokens=sum(len(r) for r in records.values()) * setup.batch_size * setup.block_size,
            commits=summary.rounds_committed,
            parity_failures=summary.parity_failures,
        )
        if failures:
            applied = summary.lab.churn_applied if summary.lab is not None else []
            kills = sum(c["action"] == "kill" for c in applied)
            row.update(goodput_row(*isthmus_attempts(events), kills))
            row["tokens_committed"] = row["tokens"]
        return {**row, "errors": errors}
    applied = summary.lab.churn_applied if summary.lab is not None else []
    kill = next((c for c in applied if c["action"] == "kill"), None)
    join = next((c for c in applied if c["action"] == "join"), None)
    if kill is not None:
        row["kill_to_any_commit_s"] = first_after(float(kill["ts"]), isthmus_commits(events))
        without = isthmus_commits(events, fewer_than=setup.peers)
        row["kill_to_commit_s"] = first_after(float(kill["ts"]), without)
        row["kill_t_s"] = round(float(kill["ts"]) - t0, 3)
    else:
        errors.append("the kill was not applied")
    if join is not None:
        joined = isthmus_join_commit(events, join["name"])
        reg = [e["ts"] for e in events if e["kind"] == "register" and e["name"] == join["name"]]
        row["join_t_s"] = round(float(join["ts"]) - t0, 3)
        if joined is not None:
            row["join_to_contribution_s"] = round(joined - float(join["ts"]), 3)
            if reg:
                row["ready_to_contribution_s"] = round(joined - float(reg[0]), 3)
        else:
            errors.append(f"{join['name']} never took part in a committed round")
    else:
        errors.append("the join was not applied")
    return {**row, "errors": errors}
