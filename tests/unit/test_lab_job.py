"""A scenario that runs the user's own script: ``[job]`` and ``--script`` parsed and checked, what a
script cannot take refused by key, the churn a lab run applies (``[[fault]]`` entries reach the
built-in job and a script's session; a script's step-clock kills are applied from outside), and
the command line's
``--script F -- ARGS``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from isthmus.cli import main as cli_main
from isthmus.lab.churn_plan import ChurnPlan, Planned
from isthmus.lab.jobspec import JobSpec, script_spec
from isthmus.lab.scenario import load_scenario, parse_scenario
from isthmus.run import lab_run
from isthmus.run.lab_run import lab_churn, lab_config, lab_script
from isthmus.run.programs import Script
from isthmus.spec import SpecError

NET = """
[run]
name = "t"
steps = 40
[network]
peers = 2
rate = "10mbit"
"""
KILL = """
[[churn]]
action = "kill"
peer = 1
at_step = 6
"""


def _scenario_dir(tmp_path: Path, body: str) -> Path:
    folder = tmp_path / "sc"
    folder.mkdir(exist_ok=True)
    (folder / "train.py").write_text("print('hi')\n")
    path = folder / "s.toml"
    path.write_text(NET + body)
    return path


def test_job_script_is_read_from_the_scenario_folder_and_strategy_is_optional(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _scenario_dir(tmp_path, '[job]\nscript = "train.py"\nargs = ["--steps", "40"]\n')
    monkeypatch.chdir(tmp_path)  # not the scenario's folder
    sc = load_scenario(path)
    assert sc.job == JobSpec(script=str(path.parent / "train.py"), args=("--steps", "40"))
    assert sc.to_json()["job"] == {
        "script": str(path.parent / "train.py"),
        "args": ["--steps", "40"],
    }
    # the built-in job still needs its strategy
    with pytest.raises(SpecError, match=r"strategy: missing required key 'strategy'|'strategy'"):
        parse_scenario(NET, source="b.toml")


def test_job_nproc_per_peer_makes_each_peer_an_island_in_its_namespace(tmp_path: Path) -> None:
    path = _scenario_dir(tmp_path, '[job]\nscript = "train.py"\nnproc_per_peer = [2, 1]\n')
    sc = load_scenario(path)
    assert sc.job is not None and sc.job.nproc_per_peer == (2, 1)
    assert sc.to_json()["job"]["nproc_per_peer"] == [2, 1]
    program = lab_script(sc, lab_config(sc))
    assert isinstance(program, Script) and program.nprocs == (2, 1)
    # the peer's one command is the island's agent: its ranks are its children, in its namespace
    assert program.command(_Peer(0))[1:4] == ["-m", "isthmus.run.island", "2"]
    assert program.command(_Peer(1))[1:4] == ["-m", "isthmus.run.island", "1"]


def test_run_nproc_per_peer_makes_the_builtin_jobs_peers_islands(tmp_path: Path) -> None:
    from isthmus.run.programs import BuiltinJob, PeerLaunch
    from isthmus.run.record import RunDir

    body = '[strategy]\nname = "diloco"\n'
    sc = parse_scenario(NET.replace('name = "t"', 'name = "t"\nnproc_per_peer = 2') + body)
    run = lab_config(sc)
    assert run.nproc_per_peer == 2
    launch = PeerLaunch(0, "peer0", "c:1", "tok", (), None, RunDir(tmp_path))
    argv = BuiltinJob(run).command(launch)
    assert argv[1:4] == ["-m", "isthmus.run.island", "2"] and argv[4].endswith("run/job.py")
    assert argv[5] == str(tmp_path / "peer0.job.json")  # the job's own file, as for one process
    with pytest.raises(SpecError, match="nproc_per_peer"):
        lab_config(
            parse_scenario(NET.replace('name = "t"', 'name = "t"\nnproc_per_peer = 0') + body)
        )


class _Peer:
    def __init__(self, slot: int) -> None:
        self.slot = slot


@pytest.mark.parametrize(
    ("job", "key", "words"),
    [
        ('script = "missing.py"', "job.script", "no such script: "),
        ('script = ""', "job.script", "must be a non-empty string"),
        ("script = 3", "job.script", "string"),
        ('script = "train.py"\nargs = "--steps 3"', "job.args", "list of strings"),
        ('script = "train.py"\nargs = ["--steps", 3]', "job.args[1]", "must be a string"),
        ('scirpt = "train.py"', "job.scirpt", "did you mean 'script'"),
        ('args = ["x"]', "job.script", "missing required key"),
        ('script = "train.py"\nnproc_per_peer = 0', "job.nproc_per_peer", "int >= 1"),
        ('script = "train.py"\nnproc_per_peer = [2, "1"]', "job.nproc_per_peer", "int >= 1"),
    ],
)
def test_a_bad_job_section_names_the_file_and_the_key(
    tmp_path: Path, job: str, key: str, words: str
) -> None:
    path = _scenario_dir(tmp_path, f"[job]\n{job}\n")
    with pytest.raises(SpecError) as e:
        load_scenario(path)
    assert e.value.key == key and e.value.source == str(path)
    assert words in str(e.value)
    if key == "job.script" and "no such" in words:
        assert str(path.parent / "missing.py") in str(e.value)  # the path it looked at


@pytest.mark.parametrize(
    ("body", "key", "words"),
    [
        ('[[fault]]\npeer = 0\nspec = "slow:3@5-20"\n', "fault", "'slow' faults"),
        ('[[byzantine]]\npeer = 1\nattack = "sign_flip"\n', "byzantine[0]", "byzantine attacks"),
        ("[checkpoint]\nevery = 2\n", "checkpoint", "saves its own"),
    ],
)
def test_what_a_script_cannot_take_is_refused_by_key(
    tmp_path: Path, body: str, key: str, words: str
) -> None:
    strategy = '[strategy]\nname = "diloco"\n'
    path = _scenario_dir(tmp_path, strategy + body + '[job]\nscript = "train.py"\n')
    with pytest.raises(SpecError) as e:
        load_scenario(path)
    assert e.value.key == key and words in str(e.value) and e.value.source == str(path)
    # the same scenario without [job] runs the built-in job, and --script is refused alike
    sc = parse_scenario(NET + strategy + body, source="b.toml")
    job = script_spec(path.parent / "train.py", ["--x"], key="--script")
    with pytest.raises(SpecError, match=words):
        lab_script(sc, lab_config(sc), job)
    with pytest.raises(SpecError, match=words):
        lab_script(sc, lab_config(sc), Script(path.parent / "train.py"))


def test_script_spec_names_the_flag_and_the_path(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as e:
        script_spec(tmp_path / "nope.py", key="--script")
    assert e.value.key == "--script" and str(tmp_path / "nope.py") in str(e.value)


def test_the_lab_script_gets_the_runs_connection_settings(tmp_path: Path) -> None:
    body = '[strategy]\nname = "ddp"\nconnections = 3\nprobe_links = true\n'
    sc = parse_scenario(NET + body, source="b.toml")
    assert lab_script(sc, lab_config(sc)) is None  # no [job], no --script: the built-in job
    job = script_spec(_scenario_dir(tmp_path, "").parent / "train.py", ["--steps", "5"])
    program = lab_script(sc, lab_config(sc), job)
    assert program is not None and program.args == ["--steps", "5"]
    run = lab_config(sc)
    assert program.settings == {
        "ISTHMUS_CONNECTIONS": "3",
        "ISTHMUS_PROBE_LINKS": "1",
        "ISTHMUS_MESH": "0",
        "ISTHMUS_STALL_S": repr(float(run.timeouts.stall_s)),
        "ISTHMUS_LATE_S": repr(float(run.timeouts.late_s)),
    }


def test_scenario_faults_reach_the_builtin_job_and_a_scripts_kills_come_from_outside(
    tmp_path: Path,
) -> None:
    faults = '[[fault]]\npeer = 0\nspec = "slow:3@5-20"\n'
    sc = parse_scenario(NET + '[strategy]\nname = "ddp"\n' + KILL + faults, source="f.toml")
    run = lab_config(sc)
    builtin = lab_churn(sc, run)
    assert builtin.faults(0, 0) == ["slow:3@5-20"]  # the [[fault]] entry, to the first process
    assert builtin.faults(1, 0) == ["kill@step:step=6"]  # fired by the peer itself
    assert builtin.faults(0, 10) == []  # a restart does not fire it again
    assert builtin.plan.due(run_step=10, elapsed=1.0) == []

    sc2 = parse_scenario(NET + '[strategy]\nname = "ddp"\n' + KILL, source="s.toml").with_job(
        script_spec(_scenario_dir(tmp_path, "").parent / "train.py")
    )
    script = lab_churn(sc2, lab_config(sc2), script=True)
    assert script.faults(1, 0) == []
    assert script.plan.due(run_step=5, elapsed=1.0) == []
    (due,) = script.plan.due(run_step=6, elapsed=1.0)
    assert (due.action, due.slot, due.how) == ("kill", 1, "at step 6")
    # a script's [[fault]] entries (other than slow) reach its first process, for its session
    fail = '[[fault]]\npeer = 1\nspec = "fail@collective:round=3"\n'
    sc3 = parse_scenario(NET + '[strategy]\nname = "ddp"\n' + KILL + fail, source="t.toml")
    sc3 = sc3.with_job(script_spec(_scenario_dir(tmp_path, "").parent / "train.py"))
    script = lab_churn(sc3, lab_config(sc3), script=True)
    assert script.faults(1, 0) == ["fail@collective:round=3"] and script.faults(1, 10) == []
    assert script.faults(0, 0) == []


def test_a_plan_applied_from_outside_reports_unreached_step_kills_as_never_due() -> None:
    plan = ChurnPlan([Planned(action="kill", slot=0, clock="step", when=50)], self_fired=False)
    assert plan.faults_for(0, 0) == [] and plan.due(run_step=49, elapsed=9.0) == []
    assert plan.leftovers() == [(plan.pending[0], "the run ended first")]


def test_the_command_line_hands_the_script_its_arguments_after_the_dashes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _scenario_dir(tmp_path, '[strategy]\nname = "ddp"\n')
    seen: dict[str, Any] = {}

    def fake_run_lab(scenario: Any, opts: Any, *, overrides: Any, script: Any) -> Any:
        seen.update(script=script, overrides=overrides)
        raise ValueError("stop here")

    monkeypatch.setattr(lab_run, "run_lab", fake_run_lab)
    train = str(path.parent / "train.py")
    argv = ["lab", "run", str(path), "--steps", "7", "--script", train, "--", "--lr", "3", "--"]
    assert cli_main(argv) == 2
    assert seen["script"] == JobSpec(script=train, args=("--lr", "3", "--"))
    assert seen["overrides"]["steps"] == "7"  # a flag's text, checked by the run config
    assert "stop here" in capsys.readouterr().err

    assert cli_main(["lab", "run", str(path), "--", "--lr", "3"]) == 2
    assert "give --script FILE" in capsys.readouterr().err
    assert cli_main(["lab", "run", str(path), "--script", str(tmp_path / "no.py")]) == 2
    assert "--script: no such script" in capsys.readouterr().err
