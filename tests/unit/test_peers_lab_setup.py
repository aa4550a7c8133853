"""benchmarks/peers_lab.py's Setup: the scenario it writes for a goodput run, the model preset and
a scenario file's ``[network]`` taken whole."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(_BENCH))
import peers_lab  # noqa: E402

from isthmus.lab.scenario import parse_scenario  # noqa: E402

_ROOT = _BENCH.parent


def test_network_section_keeps_the_sub_tables_and_nothing_else() -> None:
    text = (_ROOT / "scenarios" / "two_region.toml").read_text()
    net = peers_lab.network_section(text)
    assert net.startswith("[network]")
    assert net.count("[[network.sites]]") == 2 and "[[network.site_links]]" in net
    assert "[strategy" not in net and "[run]" not in net
    with pytest.raises(ValueError, match="no \\[network\\]"):
        peers_lab.network_section('[run]\nname = "x"\n')


def test_goodput_scenario_kills_and_restarts_each_scheduled_peer() -> None:
    setup = peers_lab.Setup(
        model="default", fail_every=10.0, restart_after=3.0, fail_until=45.0, steps=20
    )
    failures = setup.failures()
    assert [f.at_s for f in failures] == [10.0, 20.0, 30.0, 40.0]
    text = setup.scenario(
        "g", "streaming", {"sync_every": 20}, False, compression="e3m0", failures=failures
    )
    sc = parse_scenario(text, source="g")
    assert sc.run.model == "default"
    assert sc.strategy.compression == "e3m0"
    churn = [(c.action, c.peer, c.at_seconds) for c in sc.churn]
    expected = [a for f in failures for a in (("kill", f.peer, f.at_s), ("join", f.peer, f.back_s))]
    assert sorted(churn, key=lambda c: c[2]) == sorted(expected, key=lambda c: c[2])
    assert setup.block_size == 64 and peers_lab.Setup().block_size == 32
    assert peers_lab.Setup().failures() == []
    with pytest.raises(ValueError, match="--model"):
        peers_lab.Setup(model="huge")


def test_a_scenario_files_network_replaces_rate_and_rtt() -> None:
    net = peers_lab.network_section((_ROOT / "scenarios" / "two_region.toml").read_text())
    sc = parse_scenario(peers_lab.Setup(network=net).scenario("n", "diloco", {}, False), source="n")
    assert [s.name for s in sc.network.sites.sites] == ["eu", "us"]


def test_the_medium_preset_reaches_every_system() -> None:
    """``--model medium``: the command line takes it, the isthmus scenario names it, and the
    foreign workers' Trainer builds the same GPT from the job."""
    import peers
    import peers_common

    args = peers.parser().parse_args(["--model", "medium", "--collective-timeout", "300"])
    assert (args.model, args.collective_timeout) == ("medium", 300.0)
    with pytest.raises(SystemExit):
        peers.parser().parse_args(["--model", "huge"])
    setup = peers_lab.Setup(model="medium")
    assert setup.block_size == 64
    sc = parse_scenario(setup.scenario("m", "diloco", {"sync_every": 20}, False), source="m")
    assert sc.run.model == "medium"
    job = {"model": "medium", "model_seed": 0, "corpus_bytes": 20_000, "data_seed": 0}
    threads = torch.get_num_threads()
    try:
        trainer = peers_common.Trainer(job, 0)  # it sets one thread, as a worker runs
    finally:
        torch.set_num_threads(threads)
    assert trainer.model.num_parameters() == 10_770_432 and trainer.block_size == 64
