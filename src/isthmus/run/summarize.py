"""A finished launch in numbers: the :class:`~isthmus.run.record.Summary` of a run.

Works for the built-in job (every finished peer wrote a :class:`~isthmus.run.record.PeerResult`)
and for a user's script (then the peers' final state digests come from the coordinator: a
session that leaves reports its digest and revision, see :meth:`isthmus.Session.close`).
Bit parity at the end is judged by majority: ``peers_final`` counts the finished peers holding
the majority's digests, and every other finished peer is a parity failure.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from typing import Any

from isthmus.comm.group import wire_bytes
from isthmus.run.launch import Incarnation, Outcome
from isthmus.run.record import LATE_JOINER_EXIT, PeerResult, RunDir, Summary

__all__ = ["collect_metrics", "summarize"]


def _sum_dicts(ds: Sequence[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in ds:
        for k, v in d.items():
            out[k] = out.get(k, 0) + int(v)
    return out


def _recovery_times(events: list[dict[str, Any]], killed: list[Incarnation]) -> list[float]:
    """Seconds from each killed peer's eviction to the next committed round."""
    names = {p.name for p in killed}
    out = []
    for i, e in enumerate(events):
        if e["kind"] == "dead" and e.get("name") in names:
            nxt = next((x for x in events[i + 1 :] if x["kind"] == "commit"), None)
            if nxt is not None:
                out.append(round(nxt["t"] - e["t"], 3))
    return out


def _median_round_bytes(fs: Sequence[PeerResult]) -> int:
    per = sorted(
        int(r.get("bytes", 0)) for f in fs for r in f.rounds if r["outcome"] == "committed"
    )
    return per[len(per) // 2] if per else 0


def _left_digests(events: list[dict[str, Any]]) -> dict[str, tuple[str, str | None]]:
    """Digests reported by peers that left the run cleanly (user scripts' sessions)."""
    out = {}
    for e in events:
        if e["kind"] == "left" and e.get("digest"):
            out[str(e.get("name"))] = (str(e["digest"]), e.get("model_digest"))
    return out


def summarize(
    outcome: Outcome,
    run_dir: RunDir,
    *,
    strategy: str = "",
    strategy_options: dict[str, Any] | None = None,
    compression: str | None = None,
    aggregator: str | None = None,
    steps: int | None = None,
    n_params: int | None = None,
    initial_loss: float | None = None,
    byzantine: dict[str, str] | None = None,
    program: str = "isthmus.run.job",
    starting: int = 0,
) -> Summary:
    """The summary of ``outcome`` (see the module docstring)."""
    incs = outcome.incarnations
    finals: dict[str, PeerResult] = {}
    for inc in incs:
        if inc.returncode == 0:
            r = run_dir.result(inc.name)
            if r is not None:
                finals[inc.name] = r
    digests: dict[str, tuple[str, str | None]] = {
        n: (f.digest, f.model_digest) for n, f in finals.items()
    }
    if not finals:
        left = _left_digests(outcome.events)
        digests = {i.name: left[i.name] for i in incs if i.returncode == 0 and i.name in left}
    values = list(digests.values())
    majority = max(set(values), key=values.count) if values else None
    in_parity = [n for n, d in digests.items() if d == majority]
    counters = outcome.status.get("counters", {})
    records = {inc.name: run_dir.records(inc.name) for inc in incs}
    # Bytes: finished peers report exactly; killed peers' last per-step record is the best known.
    sent = 0
    for inc in incs:
        if inc.name in finals:
            sent += finals[inc.name].bytes_sent
        elif records[inc.name]:
            sent += int(records[inc.name][-1]["bytes_sent"])
    # What plain data parallel would have sent for the same steps and the same membership.
    world_at: dict[int, int] = {}
    for recs in records.values():
        for r in recs:
            world_at[r["step"]] = max(world_at.get(r["step"], 0), int(r["world"]))
    ddp_equiv = (
        sum(w * wire_bytes("all_reduce", n_params * 4, w) for w in world_at.values())
        if n_params
        else 0
    )
    # every peer that died by SIGKILL (a planned kill, or an injected one); not those the
    # launcher's teardown stopped
    killed = [i for i in incs if i.returncode == -signal.SIGKILL and not i.torn_down]
    final_losses = [f.eval_loss for n, f in finals.items() if n in in_parity]
    fs = list(finals.values())
    restarts = sum(s.restarts for s in outcome.slots)
    return Summary(
        strategy=strategy,
        strategy_options=dict(strategy_options or {}),
        compression=compression or "none",
        aggregator=aggregator or "mean",
        steps=steps,
        model_parameters=n_params,
        initial_eval_loss=None if initial_loss is None else round(initial_loss, 6),
        final_eval_loss=round(final_losses[0], 6) if final_losses else None,
        rounds_committed=int(counters.get("rounds_committed", 0)),
        rounds_aborted=int(counters.get("rounds_aborted", 0)),
        parity_checks=int(counters.get("parity_checks", 0)),
        parity_failures=int(counters.get("parity_failures", 0)) + (len(digests) - len(in_parity)),
        resyncs=int(counters.get("resyncs", 0)),
        isolations=int(counters.get("isolations", 0)),
        isolated=[
            {"t": e.get("t"), "name": e.get("name"), "event": e["kind"], "reason": e.get("reason")}
            for e in outcome.events
            if e["kind"] in ("isolated", "readmitted")
        ],
        stragglers=sum(e["kind"] == "straggler" for e in outcome.events),
        link_anomalies=sum(e["kind"] == "link_anomaly" for e in outcome.events),
        peers_final=len(in_parity),
        peers_started=len(incs),
        kills=len(killed),
        joins=len(incs) - starting - restarts,
        restarts=restarts,
        bytes_sent_total=sent,
        bytes_sent_ddp_equivalent=ddp_equiv,
        bytes_per_step_per_peer=_median_round_bytes(fs),
        recovery_s=_recovery_times(outcome.events, killed),
        peak_bytes_per_round=max((int(r.get("bytes", 0)) for f in fs for r in f.rounds), default=0),
        bytes_by_op=_sum_dicts([f.bytes_by_op for f in fs]),
        overlap_fraction=round(
            sum(f.strategy.get("overlap_fraction", 0.0) for f in fs) / len(fs), 4
        )
        if fs
        else 0.0,
        nonfinite_skips=sum(f.strategy.get("nonfinite_skips", 0) for f in fs),
        # rounds whose agreed update was not applied (non-finite sum, rule could not run); every
        # peer skips alike, so the largest count is the run's
        rejected_updates=max((f.strategy.get("rejected_updates", 0) for f in fs), default=0),
        byzantine=dict(byzantine or {}),
        final_digest=majority[0] if majority else None,
        final_model_digest=majority[1] if majority else None,
        wall_s=round(outcome.wall_s, 2),
        run_dir=str(run_dir),
        exit_codes={i.name: i.returncode for i in incs},
        late_joiners=[i.name for i in incs if i.returncode == LATE_JOINER_EXIT],
        program=program,
        checkpoints_written=int(outcome.status.get("checkpoint", {}).get("written", 0)),
        checkpoint_stall_s=round(sum(f.checkpoint.get("checkpoint_stall_s", 0.0) for f in fs), 4),
        resumed_from_round=next((f.resumed_from for f in fs if f.resumed_from is not None), None),
    )


def collect_metrics(outcome: Outcome, run_dir: RunDir) -> None:
    """``metrics.jsonl`` (every peer's records, tagged with its name) and ``events.jsonl``."""
    run_dir.write_jsonl(
        "metrics.jsonl",
        [{"peer": i.name, **r} for i in outcome.incarnations for r in run_dir.records(i.name)],
    )
    run_dir.write_jsonl("events.jsonl", outcome.events)
