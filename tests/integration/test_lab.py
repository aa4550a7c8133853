"""The lab runner and the all-reduce benchmark, end to end with the tiny model and a few steps.

Tests that build namespaces need root and iproute2 and are skipped with the reason otherwise;
the loopback fall-back and the benchmark's JSON run everywhere (the benchmark on loopback when
namespaces are unavailable). Every namespace test uses its own prefix and checks that nothing with
that prefix is left afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from isthmus.cli import main as cli_main
from isthmus.lab import links as links_mod
from isthmus.lab.churn_plan import ChurnPlan
from isthmus.lab.netns import LabUnavailable, list_namespaces, unavailable_reason
from isthmus.lab.scenario import load_scenario, parse_scenario
from isthmus.run import lab_run as lab_mod
from isthmus.run.lab_run import LabOptions, NamespaceSpawner, lab_config, run_lab, scenario_steps

REASON = unavailable_reason()
FAST = {
    "corpus_bytes": 200_000,
    "batch_size": 8,
    "progress": False,
    "collective_timeout": 20.0,
    "timeout": 240.0,
}


def _ours(prefix: str) -> list[str]:
    return [n for n in list_namespaces() if n.startswith(prefix + "-")]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


CHURN = """
description = "three peers, one killed and restarted, one frozen for a second"
[run]
name = "churn"
steps = 30
model = "tiny"
[strategy]
name = "ddp"
[network]
peers = 3
rate = ["20mbit", "20mbit", "10mbit"]
[[churn]]
action = "kill"
peer = 2
at_step = 5
[[churn]]
action = "join"
peer = 2
at_step = 8
[[churn]]
action = "stop"
peer = 1
at_seconds = 1.0
[[churn]]
action = "cont"
peer = 1
at_seconds = 2.0
"""


@pytest.mark.root
def test_run_on_shaped_namespaces_with_churn_and_byte_accounting(
    tmp_path: Path, prefix: str
) -> None:
    sc = parse_scenario(CHURN, source="churn.toml")
    s = run_lab(
        sc,
        LabOptions(prefix=prefix),
        overrides={"run_dir": str(tmp_path), "step_delay": 0.05, **FAST},
    )
    assert not _ours(prefix), "the network must be gone when run_lab returns"
    # peers in namespaces stand for other machines: TLS (pinned) and a join token per slot
    assert (tmp_path / "tls" / "coordinator.crt").is_file()
    lab = s.lab
    assert lab is not None
    assert lab.network["mode"] == "netns" and lab.network["rates_mbit"] == [20, 20, 10]
    done = {(c["action"], c["peer"]) for c in lab.churn_applied}
    assert done == {("kill", 2), ("join", 2), ("stop", 1), ("cont", 1)}, lab.churn_skipped
    kill = next(c for c in lab.churn_applied if c["action"] == "kill")
    assert kill["how"] == "fault at step 5"
    codes = s.exit_codes
    assert codes["peer0"] == 0 and codes["peer1"] == 0 and codes["peer2"] == -signal.SIGKILL
    assert codes["peer2.1"] in (0, 4)  # joined, or came after the run ended (late joiner)
    assert s.parity_failures == 0 and s.peers_final >= 2
    assert s.kills == 1 and s.joins == 1
    assert lab.round_latency_s["rounds"] >= 25  # DDP: one round per step, 30 steps
    # the world shrinks: to 2 while peer2 is dead or peer1 frozen, to 1 (min_peers) when the
    # freeze (by the clock) lands while peer2 is dead (by step), which a fast start allows
    assert lab.world_size[0][1] == 3 and min(w for _, w in lab.world_size) in (1, 2)
    assert lab.time_lost_to_recovery_s["windows"], "a kill and a stop must cost some time"

    # bytes: every peer put more on the wire than its payload (headers), and once headers and
    # the control plane are taken out the wire agrees with isthmus's own accounting
    bc = lab.bytes_check
    assert set(bc["per_peer"]) == {"peer0", "peer1", "peer2"}
    for row in bc["per_peer"].values():
        assert row["wire_tx_bytes"] > row["accounted_bytes"] > 0
    assert bc["control_plane_up_bytes"] > 0
    assert abs(bc["rel_diff_data_plane"]) < 0.05, bc

    links = _jsonl(tmp_path / "links.jsonl")
    nodes = {r["node"] for r in links}
    assert nodes == {"coordinator", "peer0", "peer1", "peer2"}
    assert {r["node"]: r["rate_mbit"] for r in links if r["node"] != "coordinator"} == {
        "peer0": 20,
        "peer1": 20,
        "peer2": 10,
    }
    assert len(_jsonl(tmp_path / "churn.jsonl")) == 4
    for png in ("loss_vs_step", "loss_vs_time", "loss_vs_bytes", "world_size", "link_utilization"):
        assert (tmp_path / f"{png}.png").stat().st_size > 1000, png
    report = (tmp_path / "report.md").read_text()
    assert "## Lab" in report and "payload vs accounting" in report
    assert json.loads((tmp_path / "summary.json").read_text())["bytes_check"] == bc


LOOPBACK = """
[run]
name = "loop"
steps = 12
model = "tiny"
[strategy]
name = "diloco"
[strategy.options]
sync_every = 4
[network]
peers = 2
rate = "10mbit"
[[byzantine]]
peer = 1
attack = "sign_flip"
from_step = 4
"""


def test_loopback_fallback_runs_unshaped_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(links_mod, "unavailable_reason", lambda: "no root in this test")
    sc = parse_scenario(LOOPBACK, source="loop.toml")
    with pytest.raises(LabUnavailable, match="no root in this test"):
        run_lab(
            sc, LabOptions(network="netns"), overrides={"run_dir": str(tmp_path / "strict"), **FAST}
        )
    s = run_lab(sc, LabOptions(network="auto"), overrides={"run_dir": str(tmp_path / "r"), **FAST})
    assert s.lab is not None
    net = s.lab.network
    assert net["mode"] == "loopback" and net["reason"] == "no root in this test"
    assert s.peers_final == 2 and s.parity_failures == 0
    assert "per_peer" not in s.lab.bytes_check and "loopback" in s.lab.bytes_check["note"]
    assert s.byzantine == {"peer1": "sign_flip"}
    job = json.loads((tmp_path / "r" / "peer1.job.json").read_text())["peer"]
    assert job["attack"] == "sign_flip" and job["attack_from_step"] == 4
    assert json.loads((tmp_path / "r" / "peer0.job.json").read_text())["peer"]["attack"] is None
    assert {r["node"] for r in _jsonl(tmp_path / "r" / "links.jsonl")} == {"lo"}


def test_tokens_become_steps_and_bad_options_fail_before_anything_starts(tmp_path: Path) -> None:
    sc = parse_scenario(LOOPBACK.replace("steps = 12", "tokens = 10_000"), source="t.toml")
    # 2 starting peers x batch 8 x block 32 tokens per step
    assert scenario_steps(sc, batch_size=8) == -(-10_000 // (2 * 8 * 32))
    # a bad strategy option fails when the file is read, naming the file and the key
    with pytest.raises(
        ValueError, match=r"^b.toml: strategy.options.sync_evry: unknown option 'sync_evry'"
    ):
        parse_scenario(LOOPBACK.replace("sync_every = 4", "sync_evry = 4"), source="b.toml")
    # and one from the command line before anything is written
    with pytest.raises(ValueError, match="sync_evry"):
        run_lab(
            sc,
            LabOptions(network="loopback"),
            overrides={"run_dir": str(tmp_path), "option.sync_evry": 4, **FAST},
        )
    assert not list(tmp_path.iterdir()), "nothing may be written for a bad scenario"
    with pytest.raises(ValueError, match="network: must be one of 'auto', 'netns', 'loopback'"):
        LabOptions(network="wan")


@pytest.mark.root
def test_an_error_inside_the_run_removes_the_network(
    tmp_path: Path, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[list[str]] = []

    def boom(self: NamespaceSpawner, slot: int, argv: list[str], env: object, log: object) -> None:
        seen.append(_ours(prefix))
        raise RuntimeError("launcher exploded")

    monkeypatch.setattr(NamespaceSpawner, "popen", boom)
    sc = parse_scenario(LOOPBACK.split("[[byzantine]]")[0], source="e.toml")
    with pytest.raises(RuntimeError, match="launcher exploded"):
        run_lab(sc, LabOptions(prefix=prefix), overrides={"run_dir": str(tmp_path), **FAST})
    assert len(seen[0]) == 4  # coordinator, 2 peers, bridge existed while the run was going
    assert not _ours(prefix)


SLOW_RUN = """
[run]
name = "sigint"
steps = 100000
model = "tiny"
[strategy]
name = "ddp"
[network]
peers = 2
rate = "10mbit"
"""


@pytest.mark.root
def test_ctrl_c_stops_the_peers_and_removes_the_network(tmp_path: Path, prefix: str) -> None:
    scen = tmp_path / "s.toml"
    scen.write_text(SLOW_RUN)
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "isthmus.cli", "lab", "run", str(scen), "--prefix", prefix]
    argv += ["--run-dir", str(run_dir), "--no-progress", "--corpus-bytes", "200000"]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 90
        peer_pids: list[int] = []
        # wait until a peer process runs in each peer namespace, then press Ctrl-C
        while time.monotonic() < deadline:
            ours = [ns for ns in _ours(prefix) if ns.endswith(("-p0", "-p1"))]
            peer_pids = [
                int(p)
                for ns in ours
                for p in subprocess.run(
                    ["ip", "netns", "pids", ns], capture_output=True, text=True, check=False
                ).stdout.split()
            ]
            if len(peer_pids) == 2:
                break
            assert proc.poll() is None, proc.communicate()[0].decode()[-3000:]
            time.sleep(0.1)
        else:
            raise AssertionError("the peers never started")
        assert len(_ours(prefix)) == 4
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=60)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 130, out[-3000:]
    assert "interrupted" in out
    assert not _ours(prefix)
    for pid in peer_pids:
        assert not os.path.exists(f"/proc/{pid}") or _zombie(pid), f"peer {pid} survived Ctrl-C"


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_bench_allreduce_json_has_the_promised_keys(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "allreduce", "--peers", "2", "--rate", "50mbit", "--size-mb", "0.25"]
    argv += ["--reps", "1", "--warmup", "0", "--compression", "int8", "--collectives", "--json"]
    assert cli_main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    for key in ("isthmus_busbw_mbit", "gloo_busbw_mbit", "ratio_vs_gloo", "fp32_time_s"):
        assert r[key] > 0, key
    assert r["time_s"] > 0 and r["speedup_vs_fp32"] > 0
    assert r["ratio_vs_gloo"] == pytest.approx(
        r["isthmus_busbw_mbit"] / r["gloo_busbw_mbit"], rel=1e-2
    )
    assert r["fp32_time_s"] / r["time_s"] == pytest.approx(r["speedup_vs_fp32"], rel=1e-2)
    # int8 sends about a quarter of the fp32 bytes (plus one scale per block)
    assert r["wire_bytes_per_peer"] < 0.3 * r["fp32_wire_bytes_per_peer"]
    # --collectives: raw all_to_all and all_gather, each sending one int8 stage (2 peers: half
    # of the 62,500 one-byte values)
    assert r["stage_bytes_per_peer"] == 31_250
    for key in ("all_to_all", "all_gather", "exchange"):
        t = r[f"{key}_time_s"]
        assert t > 0
        # times are rounded to 0.1 ms, the rates computed before rounding
        assert r[f"{key}_mbit"] == pytest.approx(8 * 31_250 / t / 1e6, rel=1e-2 + 1e-4 / t)
    if REASON is None:
        assert r["network"] == "netns" and r["link_mbit"] == 50
        assert r["tcp_congestion_control"]  # the host's, read inside the namespaces
        assert r["link_utilization"] == pytest.approx(r["isthmus_busbw_mbit"] / 50, rel=1e-2)
    else:
        assert r["network"] == "loopback" and r["link_mbit"] is None
        assert r["tcp_congestion_control"] is None
        assert r["link_utilization"] is None and REASON in r["network_note"]


EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "scenarios").glob("*.toml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_shipped_scenario_builds_its_strategy(path: Path) -> None:
    # what `isthmus lab run` checks before it starts anything: options the strategy accepts,
    # a compressor and aggregator that exist, attacks that parse
    sc = load_scenario(path)
    cfg = lab_config(sc)
    assert cfg.steps == scenario_steps(sc, batch_size=16) and cfg.peers == sc.peers


PLAN = """
[run]
name = "plan"
steps = 100
model = "tiny"
[strategy]
name = "ddp"
[network]
peers = 3
rate = "10mbit"
[[churn]]
action = "kill"
peer = 2
at_step = 5
[[churn]]
action = "join"
peer = 2
at_step = 8
[[churn]]
action = "stop"
peer = 2
at_step = 12
[[churn]]
action = "cont"
peer = 2
at_step = 15
[[churn]]
action = "kill"
peer = 2
at_step = 20
[[churn]]
action = "join"
peer = 1
at_seconds = 3.0
[random_churn]
failures_per_minute = 6.0
seed = 5
recover_after_seconds = 2.0
min_peers = 2
"""


def test_churn_plan_gives_each_process_the_faults_of_its_lifetime() -> None:
    sc = parse_scenario(PLAN, source="plan.toml")
    assert sc.starting_peers() == [0, 2]  # peer 1's first event is a join
    plan = ChurnPlan(lab_mod._events(sc, 60.0))
    # the first process of peer 2 kills itself at step 5; the one started at step 8 stops at 12
    # and kills itself at 20; cont and join are the launcher's
    assert plan.faults_for(2, 0) == ["kill@step:step=5"]
    assert plan.faults_for(2, 8) == ["stop@step:step=12", "kill@step:step=20"]
    assert plan.faults_for(2, 21) == []
    mine = [(p.action, p.slot, p.clock, p.when) for p in plan.pending if p.source == "scenario"]
    assert mine == [("join", 1, "seconds", 3.0), ("join", 2, "step", 8), ("cont", 2, "step", 15)]
    rnd = [p for p in plan.pending if p.source == "random"]
    expected = sc.random_churn.schedule(peers=3, duration_s=60)  # type: ignore[union-attr]
    assert [(p.action, p.slot, p.when) for p in rnd] == [
        (e.action, e.peer, e.when) for e in expected
    ]
    assert rnd and all(p.clock == "seconds" and not p.by_fault for p in rnd)


def test_a_gossip_scenario_needs_no_total_steps() -> None:
    # the lab checks the strategy as every peer builds it: with the run's length filled in
    sc = parse_scenario(
        """
[run]
name = "g"
steps = 40
model = "tiny"
[strategy]
name = "gossip"
[strategy.options]
topology = "ring"
[network]
peers = 3
rate = "10mbit"
"""
    )
    assert lab_config(sc).strategy.name == "gossip"
    with pytest.raises(ValueError, match="bogus"):
        lab_config(sc, {"strategy.options.bogus": 1})
