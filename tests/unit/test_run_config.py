"""One run config (isthmus.run.config), its flags and its records: validated without a model."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from isthmus.run.builtin_run import DEMO_SYNC_EVERY, demo_config
from isthmus.run.config import apply_overrides, from_dict, from_flat, leaves
from isthmus.run.flags import add_config_flags, field_docs, overrides_from
from isthmus.run.job import PeerJob
from isthmus.run.record import LabSummary, RunDir, Summary
from isthmus.spec import SpecError


def test_every_leaf_has_one_flat_name_and_a_help_text() -> None:
    table = leaves()
    assert table["batch_size"].dotted == "data.batch_size"
    assert table["model"].dotted == "model.preset"
    assert table["data_seed"].dotted == "data.seed"
    assert table["timeout"].dotted == "timeouts.run_timeout"
    for flat, leaf in table.items():
        assert leaf.field.metadata.get("help"), f"{leaf.dotted} has no help text"
        assert field_docs(leaf.owner)[leaf.field.name] == leaf.field.metadata["help"]
        assert flat.isidentifier()


def test_flag_help_needs_no_source(monkeypatch: pytest.MonkeyPatch) -> None:
    # an installed package may hold no .py files: the help comes from the fields' metadata
    import inspect

    def no_source(obj: object) -> str:
        raise OSError("could not get source code")

    monkeypatch.setattr(inspect, "getsource", no_source)
    p = argparse.ArgumentParser()
    add_config_flags(p)
    helps = {a.dest: a.help for a in p._actions}
    assert helps["cfg:batch_size"].startswith("Sequences per peer per step. (default 16)")
    assert helps["cfg:progress"] == "do not: show a live progress bar."
    assert helps["cfg:straggler_policy"].startswith("What a flag does")
    missing = [d for d, h in helps.items() if d.startswith("cfg:") and not h]
    assert missing == []


def test_flat_and_dotted_overrides_are_coerced_and_validated() -> None:
    cfg = from_flat(steps="30", model="tiny", batch_size=8, **{"optim.lr": "3e-4"})
    assert (cfg.steps, cfg.model.preset, cfg.data.batch_size, cfg.optim.lr) == (30, "tiny", 8, 3e-4)
    assert cfg.name == "diloco"  # the strategy's name unless named
    cfg = apply_overrides(cfg, {"strategy": "ddp"})
    assert cfg.name == "ddp"  # a derived name follows the strategy
    cfg = apply_overrides(cfg, {"option.sync_every": "5", "strategy": "diloco"})
    assert cfg.strategy.options == {"sync_every": 5}
    with pytest.raises(SpecError, match=r"batch_sise.*did you mean 'batch_size'"):
        from_flat(batch_sise=8)
    with pytest.raises(SpecError, match=r"data.batch_size: must be an integer >= 1"):
        from_flat(batch_size=0)
    with pytest.raises(SpecError, match=r"model.preset: must be one of 'default', 'tiny'"):
        from_flat(model="huge")
    with pytest.raises(SpecError, match=r"timeouts.collective_timeout: must be a positive number"):
        from_flat(collective_timeout=-1)


def test_strategy_options_are_typed_by_the_strategy_config_without_a_model() -> None:
    cfg = from_flat(strategy="diloco", option={"sync_every": "10", "outer_lr": "0.5"})
    assert cfg.strategy.options == {"sync_every": 10, "outer_lr": 0.5}
    with pytest.raises(SpecError, match=r"strategy.options.*outer_lrr.*did you mean 'outer_lr'"):
        from_flat(option={"outer_lrr": 0.5})
    with pytest.raises(SpecError, match=r"strategy.options.sync_every: must be an integer"):
        from_flat(option={"sync_every": "often"})
    with pytest.raises(
        SpecError, match=r"strategy.name.*unknown strategy 'dilco'.*did you mean 'diloco'"
    ):
        from_flat(strategy="dilco")
    with pytest.raises(SpecError, match=r"strategy.compression: bad compression spec 'int9'"):
        from_flat(compression="int9")
    with pytest.raises(SpecError, match=r"strategy.aggregator: bad aggregator spec 'krumm'"):
        from_flat(aggregator="krumm")
    # gossip's schedules need the run's length: the run passes its steps
    assert from_flat(strategy="gossip", steps=50).strategy.name == "gossip"


def test_faults_name_existing_peers() -> None:
    cfg = from_flat(peers=2, join=[10], kill=[(2, 12)], fault={1: ["fail@collective:round=3"]})
    assert cfg.everyone == 3
    with pytest.raises(SpecError, match=r"faults.kill: names peer 3, but there are peers 0..2"):
        from_flat(peers=2, join=[10], kill=[(3, 12)])
    with pytest.raises(SpecError, match=r"faults.peer_faults\[1\].*bad fault spec"):
        from_flat(fault={1: ["explode@7"]})


def test_the_demo_preset() -> None:
    cfg = demo_config({"strategy": "ddp"})
    assert cfg.steps == 150 and "sync_every" not in cfg.strategy.options
    cfg = demo_config({})
    assert cfg.steps == 200 and cfg.strategy.options == {"sync_every": DEMO_SYNC_EVERY}
    cfg = demo_config({"strategy": "streaming", "steps": 40, "option": {"sync_every": 8}})
    assert cfg.steps == 40 and cfg.strategy.options["sync_every"] == 8


def test_command_line_flags_are_generated_from_the_config() -> None:
    p = argparse.ArgumentParser()
    add_config_flags(p, shortcuts=True)
    args = p.parse_args(
        [
            "--peers", "2", "--batch-size", "4", "--kill", "1@20", "--kill", "0@30",
            "--join", "25", "--fault", "1:fail@collective:round=2", "--byzantine", "0:sign_flip",
            "--option", "outer_lr=0.5", "--sync-every", "7", "--no-progress",
            "--set", "optim.weight_decay=0", "--model", "tiny",
        ]
    )  # fmt: skip
    over = overrides_from(args)
    assert over["kill"] == [(1, 20), (0, 30)] and over["join"] == [25]
    assert over["fault"] == {1: ["fail@collective:round=2"]}
    assert over["option"] == {"outer_lr": "0.5", "sync_every": "7"}
    cfg = from_flat(**{k: v for k, v in over.items() if k != "optim.weight_decay"})
    cfg = apply_overrides(cfg, {"optim.weight_decay": over["optim.weight_decay"]})
    assert (cfg.peers, cfg.data.batch_size, cfg.output.progress, cfg.optim.weight_decay) == (
        2,
        4,
        False,
        0.0,
    )
    assert cfg.faults.byzantine[0].attack == "sign_flip"
    assert overrides_from(p.parse_args([])) == {}  # nothing given: the preset stays in force
    # a bool that defaults to false is a switch
    switched = from_flat(**overrides_from(p.parse_args(["--probe-links", "--connections", "3"])))
    assert switched.strategy.probe_links is True and switched.strategy.connections == 3
    assert from_flat().strategy.probe_links is False
    # on by default: its negation turns it off, and its old switch still parses (hidden)
    assert from_flat().strategy.pipeline_commit is True
    off = from_flat(**overrides_from(p.parse_args(["--no-pipeline-commit"])))
    on = from_flat(**overrides_from(p.parse_args(["--pipeline-commit"])))
    assert (off.strategy.pipeline_commit, on.strategy.pipeline_commit) == (False, True)
    assert "--no-pipeline-commit" in p.format_help()
    assert "--pipeline-commit " not in p.format_help()
    with pytest.raises(SystemExit):
        p.parse_args(["--model", "huge"])
    with pytest.raises(SpecError, match="--kill takes PEER@STEP"):
        overrides_from(p.parse_args(["--kill", "1:20"]))


def test_config_and_job_round_trip_through_json() -> None:
    cfg = from_flat(steps=30, model="tiny", byzantine=[{"peer": 1, "attack": "ipm:tau=2"}], peers=3)
    back = from_dict(json.loads(json.dumps(dataclasses.asdict(cfg))))
    assert back == cfg
    job = PeerJob.from_flat(
        name="a", coordinator="h:1", token="t", out_dir="/x", steps=30, faults=["kill@5"]
    )
    assert PeerJob.from_json(job.to_json()) == job
    with pytest.raises(SpecError, match=r"data.batchsize: unknown key.*did you mean 'batch_size'"):
        from_dict({"data": {"batchsize": 3}})


def test_summary_reads_and_writes_the_old_keys(tmp_path) -> None:  # type: ignore[no-untyped-def]
    s = Summary(strategy="diloco", steps=10, peers_final=3, exit_codes={"peer0": 0})
    d = s.to_json()
    assert d["strategy"] == "diloco" and d["peers_final"] == 3 and "lab" not in d
    assert Summary.from_json(d) == s
    lab = LabSummary(
        scenario={}, network={"mode": "loopback"}, churn_applied=[], churn_skipped=[], bytes_check={},
        round_latency_s={}, world_size=[], time_lost_to_recovery_s={}, train_wall_s=None, eval={},
        link_samples=0,
    )  # fmt: skip
    s.lab = lab
    d = s.to_json()
    assert d["network"] == {"mode": "loopback"}  # lab keys at the top level, as before
    assert Summary.from_json(d) == s
    rd = RunDir.create(tmp_path / "r", "x")
    rd.write_summary(s)
    assert rd.summary() == s
    assert not s.ok or s.peers_final > 0
    rd.records_path("peer0").write_text('{"step": 0}\n{"step": 1}\n{"ste')  # a torn last line
    assert [r["step"] for r in rd.records("peer0")] == [0, 1]
    with pytest.raises(FileExistsError, match="already holds a run"):
        RunDir.create(tmp_path / "r", "x")
