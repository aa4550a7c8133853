"""The lab on a user's own peer script: a scenario names the script (``[job]``), the lab runs it
in the scenario's namespaces on shaped links with its churn, and the run directory holds the same
summary, report and comparison as a run of the built-in job.

Needs root and iproute2 (network namespaces); skipped with the reason otherwise. Its own name
prefix, and nothing with it is left afterwards (the ``prefix`` fixture checks).
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest

from isthmus.lab.netns import list_namespaces
from isthmus.lab.scenario import load_scenario
from isthmus.run.lab_run import LabOptions, run_lab
from isthmus.run.report import compare_runs

SCRIPTS = Path(__file__).resolve().parent / "scripts"

SCENARIO = """
description = "a user's script on two shaped links; peer 0 fails a collective, peer 1 is killed, then back as a joiner"
[run]
name = "userscript"
steps = 50
[network]
peers = 2
rate = "20mbit"
[job]
script = "user_train.py"
args = ["--steps", "50", "--delay", "0.3"]
[[fault]]
peer = 0
spec = "fail@collective:round=3"
[[churn]]
action = "kill"
peer = 1
at_step = 7
[[churn]]
action = "join"
peer = 1
at_step = 9
"""


@pytest.mark.root
def test_a_user_script_in_the_lab_ends_in_parity_with_a_report(
    tmp_path: Path, prefix: str, capfd: pytest.CaptureFixture[str]
) -> None:
    # the scenario names its script relative to its own folder, not to the working directory
    folder = tmp_path / "scenario"
    folder.mkdir()
    shutil.copy(SCRIPTS / "user_train.py", folder / "user_train.py")
    (folder / "userscript.toml").write_text(SCENARIO)
    sc = load_scenario(folder / "userscript.toml")
    assert sc.job is not None and sc.job.script == str(folder / "user_train.py")

    run_dir = tmp_path / "run"
    s = run_lab(
        sc,
        LabOptions(network="netns", prefix=prefix),
        overrides={"run_dir": str(run_dir), "progress": False, "timeout": 240.0},
    )
    assert not [n for n in list_namespaces() if n.startswith(prefix + "-")]
    assert s.program == str(folder / "user_train.py")
    lab = s.lab
    assert lab is not None and lab.network["mode"] == "netns"
    assert lab.network["rates_mbit"] == [20, 20]

    # the kill at a step is applied from outside (a script fires no faults of ours)
    kill = next(c for c in lab.churn_applied if c["action"] == "kill")
    assert kill["peer"] == 1 and kill["how"] == "at step 7", lab.churn_applied
    assert kill["run_step"] >= 7
    assert s.exit_codes["peer0"] == 0 and s.exit_codes["peer1"] == -signal.SIGKILL
    assert s.kills == 1
    # the joiner came in and ended with the survivor (on a machine so loaded that its fresh
    # interpreter took longer than the survivor's remaining 40-odd steps, it is told so instead)
    assert ("join", 1) in {(c["action"], c["peer"]) for c in lab.churn_applied}
    if s.exit_codes["peer1.1"] == 0:
        assert s.peers_final == 2
    else:
        assert "cannot join: the run is over" in (run_dir / "peer1.1.log").read_text()

    # parity: every finished peer reported the same digest when it left
    assert s.parity_failures == 0 and s.peers_final >= 1 and s.final_digest
    assert s.rounds_committed >= 50 // 5 - 1
    # the [[fault]] entry reached the script's session, which failed its round-3 collective:
    # the round aborted, and the run went on
    assert s.rounds_aborted >= 1
    assert "injected failure at collective" in (run_dir / "events.jsonl").read_text()

    # the same run directory as the built-in job's: records from what the script reported,
    # link counters, the summary, the report with its lab section, and a comparison
    recs = [json.loads(x) for x in (run_dir / "peer0.jsonl").read_text().splitlines()]
    assert recs and recs[-1]["step"] >= 40 and all("loss" in r for r in recs)
    per_peer = lab.bytes_check["per_peer"]
    assert set(per_peer) == {"peer0", "peer1"}
    assert per_peer["peer0"]["wire_tx_bytes"] > per_peer["peer0"]["accounted_bytes"] > 0
    assert json.loads((run_dir / "scenario.json").read_text())["job"]["script"] == s.program
    report = (run_dir / "report.md").read_text()
    assert "## Lab" in report and "| kill | 1 | at step 7 |" in report
    assert (run_dir / "loss_vs_step.png").stat().st_size > 1000
    # what the script printed reached this terminal, prefixed, as with `isthmus run`
    assert "[peer0] peer0: step 50, state " in capfd.readouterr().out
    written = compare_runs([run_dir], tmp_path / "compare")
    assert (tmp_path / "compare" / "compare.md") in written
