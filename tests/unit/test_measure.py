"""Simulator inputs read from a run directory, validation against them, and ``isthmus lab sim``.

The run directories here are written by hand with round numbers, so every expected figure can be
computed on paper.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from isthmus.cli import main as cli_main
from isthmus.run.measure import measure_run, simulator_for, validate_runs


def _write_run(
    d: Path,
    *,
    strategy: str,
    peers: int,
    steps: int,
    sync_every: int,
    step_s: float,
    round_s: float,
    payload: int,
    rate_mbit: float = 10.0,
) -> Path:
    """A run where every step takes ``step_s`` except steps that end a round, which take
    ``step_s + round_s``; every round moves ``payload`` bytes per peer in a ring."""
    d.mkdir(parents=True)
    names = [f"peer{i}" for i in range(peers)]
    wire = payload * 2 * (peers - 1) // peers
    for name in names:
        t, revision, rounds, recs = 1000.0, 0, [], []
        for step in range(steps):
            t += step_s
            if (step + 1) % sync_every == 0:
                rounds.append(
                    {
                        "round": revision,
                        "epoch": 1,
                        "world": peers,
                        "outcome": "committed",
                        "t_start": t,
                        "t_end": t + round_s,
                        "bytes": wire,
                    }
                )
                t += round_s
                revision += 1
            recs.append(
                {"ts": t, "step": step, "revision": revision, "bytes_sent": wire * revision}
            )
        (d / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
        final = {
            "name": name,
            "peer_id": names.index(name),
            "step": steps,
            "revision": revision,
            "digest": "d",
            "model_digest": "m",
            "eval_loss": 1.0,
            "rounds": rounds,
            "bytes_sent": wire * revision,
        }
        (d / f"{name}.final.json").write_text(json.dumps(final))
    summary = {
        "strategy": strategy,
        "strategy_options": {"sync_every": sync_every} if strategy != "ddp" else {},
        "steps": steps,
        "exit_codes": dict.fromkeys(names, 0),
        "network": {"mode": "netns", "rates_mbit": [rate_mbit] * peers},
    }
    (d / "summary.json").write_text(json.dumps(summary))
    return d


def test_measure_run_reads_what_was_written(tmp_path: Path) -> None:
    run = _write_run(
        tmp_path / "diloco",
        strategy="diloco",
        peers=4,
        steps=40,
        sync_every=10,
        step_s=0.05,
        round_s=0.5,
        payload=1_000_000,
    )
    m = measure_run(run)
    assert (m.strategy, m.peers, m.steps, m.sync_every) == ("diloco", 4, 40, 10)
    assert m.rate_bps == pytest.approx(10e6)
    assert m.compute_s_per_step == pytest.approx(0.05)
    assert m.round_comm_s == pytest.approx(0.5)
    assert m.bytes_per_round == pytest.approx(1_000_000)
    # steps 1..39: 38 intervals of 0.05 s plus the 4 rounds ending steps 9, 19, 29 and 39
    assert m.step_s == pytest.approx((38 * 0.05 + 4 * 0.5) / 38)
    assert m.bytes_per_peer_per_step == pytest.approx(4 * 1_500_000 / 40)


def test_validation_of_a_hand_computed_ddp_run(tmp_path: Path) -> None:
    # 4 peers at 10 Mbit/s, 1 MB per round: the ring sends 1.5 MB per peer = 12 Mbit, at
    # 0.95 x 10 Mbit/s that is 12/9.5 s. Measured rounds took exactly that, compute 0.1 s.
    t_ring = 12 / 9.5
    ddp = _write_run(
        tmp_path / "ddp",
        strategy="ddp",
        peers=4,
        steps=20,
        sync_every=1,
        step_s=0.1,
        round_s=t_ring,
        payload=1_000_000,
    )
    m = measure_run(ddp)
    assert m.compute_s_per_step is None  # every step communicates
    with pytest.raises(ValueError, match="compute_s"):
        simulator_for(m)
    [(_, rows)] = validate_runs([m], compute_by_peers={4: 0.1})
    by = {r.metric: r for r in rows}
    assert by["round_comm_s"].predicted == pytest.approx(t_ring)
    assert by["round_comm_s"].rel_error == pytest.approx(0.0, abs=1e-9)
    assert by["step_s"].predicted == pytest.approx(0.1 + t_ring)
    assert by["step_s"].rel_error == pytest.approx(0.0, abs=1e-9)
    assert by["bytes_per_peer_per_step"].rel_error == pytest.approx(0.0, abs=1e-9)
    # a pessimistic efficiency shows up as a positive error of the expected size
    [(_, rows)] = validate_runs([m], compute_by_peers={4: 0.1}, efficiency=0.5)
    comm = next(r for r in rows if r.metric == "round_comm_s")
    assert comm.rel_error == pytest.approx(0.95 / 0.5 - 1)


def test_a_directory_without_a_run_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"summary\.json"):
        measure_run(tmp_path)


def test_cli_sim_matches_the_hand_computation(capsys: pytest.CaptureFixture[str]) -> None:
    # DDP, 1e6 parameters = 4 MB per round; 4 peers at 100 Mbit/s, efficiency 1:
    # ring = 2*3/4 * 32 Mbit / 100 Mbit/s = 0.48 s, plus 2*3 hops of 10 ms = 0.06 s
    argv = ["lab", "sim", "--strategy", "ddp", "--params", "1e6", "--compute-s", "0.1"]
    argv += ["--bandwidth", "100mbit", "--latency-ms", "10", "--efficiency", "1", "--peers", "4"]
    assert cli_main([*argv, "--json"]) == 0
    [r] = json.loads(capsys.readouterr().out)
    assert r["round_comm_s"] == pytest.approx(0.54)
    assert r["step_s"] == pytest.approx(0.64)
    assert r["utilization"] == pytest.approx(0.1 / 0.64)
    assert r["bytes_per_peer_per_step"] == pytest.approx(6e6)
    assert cli_main(argv) == 0
    assert "640 ms" in capsys.readouterr().out
    assert cli_main(["lab", "sim", "--strategy", "ddp"]) == 2
    assert "--compute-s" in capsys.readouterr().err


def test_cli_sim_validate_reads_run_directories(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _write_run(
        tmp_path / "r",
        strategy="diloco",
        peers=2,
        steps=20,
        sync_every=5,
        step_s=0.05,
        round_s=8 / 9.5,  # 1 MB over 2 peers: 8 Mbit at 9.5 Mbit/s
        payload=1_000_000,
    )
    assert cli_main(["lab", "sim", "--validate", str(run), "--json"]) == 0
    rows = {r["metric"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["round_comm_s"]["rel_error"] == pytest.approx(0.0, abs=1e-3)
    assert rows["step_s"]["peers"] == 2
