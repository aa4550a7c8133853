"""Scenario files: the shipped examples parse into a RunConfig and the lab's sections; every kind
of mistake names the file, key and fix."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest

from isthmus.lab.scenario import (
    ChurnEvent,
    RandomChurn,
    Scenario,
    format_rate,
    load_scenario,
    parse_rate,
    parse_scenario,
)
from isthmus.spec import SpecError

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "scenarios").glob("*.toml"))

BASE = """
[run]
name = "t"
steps = 100

[strategy]
name = "diloco"

[network]
peers = 4
rate = "10mbit"
"""


def _err(text: str, source: str = "case.toml") -> str:
    with pytest.raises(SpecError) as info:
        parse_scenario(text, source=source)
    msg = str(info.value)
    assert msg.startswith(f"{source}: "), msg
    return msg


def _with(section: str, body: str) -> str:
    """BASE with ``body`` appended to ``section`` (a header present in BASE) or at the end."""
    if section:
        return BASE.replace(f"[{section}]\n", f"[{section}]\n{body}\n", 1)
    return BASE + "\n" + body


# ---------------------------------------------------------------- examples and the happy path


def test_shipped_examples_parse() -> None:
    assert len(EXAMPLES) >= 4
    names = set()
    for path in EXAMPLES:
        s = load_scenario(path)
        assert s.source == str(path)
        assert len(s.network.rates_bps) == s.peers
        names.add(s.strategy.name)
    assert {"ddp", "diloco", "streaming"} <= names


def test_full_scenario_is_typed() -> None:
    s = parse_scenario(
        """
        description = "all sections"
        [run]
        name = "x"
        tokens = 1_000
        seed = 3
        model = "default"
        [strategy]
        name = "streaming"
        compression = "topk:0.01+ef21"
        aggregator = "nnm+multi_krum:m=3"
        [strategy.options]
        sync_every = 100
        alpha = 0.5
        fragments = 2
        pattern = "sequential"
        [network]
        peers = 3
        rate = ["1gbit", "unlimited", "512kbit"]
        coordinator_rate = "100Mbit"
        [[churn]]
        action = "stop"
        peer = 2
        at_seconds = 10
        [[churn]]
        action = "cont"
        peer = 2
        at_seconds = 12.5
        [[byzantine]]
        peer = 1
        attack = "ipm"
        options = { tau = 0.5 }
        """
    )
    assert s.run.tokens == 1000 and s.run.steps is None and s.run.model == "default"
    assert s.strategy.options == {
        "sync_every": 100,
        "alpha": 0.5,
        "fragments": 2,
        "pattern": "sequential",
    }
    # the run itself: 3 starting peers x 16 sequences x 64 tokens per step
    assert s.config.steps == 1 and s.config.model.seed == 3 and s.config.peers == 3
    assert (s.config.strategy.compression, s.config.strategy.byzantine_f) == ("topk:0.01+ef21", 1)
    assert s.network.rates_bps == (1e9, None, 512e3)
    assert s.network.coordinator_rate_bps == 100e6
    assert s.churn == (
        ChurnEvent(action="stop", peer=2, at_seconds=10.0),
        ChurnEvent(action="cont", peer=2, at_seconds=12.5),
    )
    assert s.byzantine[0].attack == "ipm:tau=0.5"
    assert s.config.faults.byzantine[0].peer == 1
    assert s.description == "all sections"


# ---------------------------------------------------------------- rates


@pytest.mark.parametrize(
    ("text", "bps"),
    [
        ("100mbit", 100e6),
        ("10Mbit", 10e6),
        ("1gbit", 1e9),
        ("1.5Gbit", 1.5e9),
        ("512kbit", 512e3),
        (" 2 mbit ", 2e6),
        ("1mibit", 2.0**20),
        ("2e3kbit", 2e6),
        ("800bit", 800.0),
    ],
)
def test_parse_rate(text: str, bps: float) -> None:
    assert parse_rate(text) == pytest.approx(bps)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("-5mbit", "not a rate"),
        ("fast", "not a rate"),
        ("100", "not a rate"),
        ("", "not a rate"),
        ("0mbit", "above zero"),
        ("1e400gbit", "finite"),
        ("100mbps", "ambiguous"),
        ("100MB", "ambiguous"),
        ("100mbits", "unknown unit"),
        ("10 furlongs", "unknown unit"),
        (100, "must be a string"),
    ],
)
def test_parse_rate_rejects(text: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_rate(text)  # type: ignore[arg-type]


def test_format_rate_round_trips() -> None:
    for bps in (1e9, 2.5e9, 100e6, 512e3, 800.0):
        assert parse_rate(format_rate(bps)) == pytest.approx(bps)
    assert format_rate(None) == "unlimited"
    assert format_rate(10e6) == "10mbit"


# ---------------------------------------------------------------- each class of mistake


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    f = tmp_path / "broken.toml"
    f.write_text("[run\nname = 1\n")
    with pytest.raises(SpecError, match=rf"^{f}: not valid TOML"):
        load_scenario(f)


def test_unknown_keys_are_rejected_with_a_suggestion(tmp_path: Path) -> None:
    f = tmp_path / "typo.toml"
    f.write_text(_with("run", "stpes = 10"))
    with pytest.raises(SpecError) as info:
        load_scenario(f)
    assert str(info.value).startswith(f"{f}: run.stpes: unknown key (did you mean 'steps'?)")
    msg = _err(BASE + "\n[netwrok]\npeers = 2\n")
    assert "netwrok: unknown key (did you mean 'network'?)" in msg
    assert "strategy.optoins: unknown key (did you mean 'options'?)" in _err(
        _with("strategy", "optoins = {}")
    )
    assert "churn[0].peeer" in _err(BASE + '[[churn]]\naction = "kill"\npeeer = 1\nat_step = 3\n')


def test_latency_key_points_to_rtt_ms() -> None:
    msg = _err(_with("network", 'latency = "50ms"'))
    assert "network.latency: unknown key (write the round trip as rtt_ms" in msg


def test_missing_sections_and_keys() -> None:
    assert "network: missing required key" in _err(BASE.split("[network]")[0])
    assert "network.rate: missing required key" in _err(BASE.replace('rate = "10mbit"', ""))


@pytest.mark.parametrize(
    ("rate", "key", "match"),
    [
        ('"-5mbit"', "network.rate", "not a rate"),
        ('"fast"', "network.rate", "not a rate"),
        ("100", "network.rate", "must be a string"),
        ('["1gbit", "1gbit", "-5mbit", "1mbit"]', r"network.rate\[2\]", "not a rate"),
        ('["1gbit", "1gbit", "1gbit"]', "network.rate", "3 rates for 4 peers"),
    ],
)
def test_bad_rates_name_the_key(rate: str, key: str, match: str) -> None:
    msg = _err(BASE.replace('rate = "10mbit"', f"rate = {rate}"))
    assert re.search(rf"case.toml: {key}: .*{match}", msg), msg


def test_coordinator_rate_is_checked() -> None:
    assert "network.coordinator_rate" in _err(_with("network", 'coordinator_rate = "quick"'))


def test_congestion_control_is_a_name_or_absent() -> None:
    assert parse_scenario(BASE).network.congestion_control is None
    s = parse_scenario(_with("network", 'congestion_control = "reno"'))
    assert s.network.congestion_control == "reno"
    for bad in ('"Reno; rm"', "3", '""'):
        msg = _err(_with("network", f"congestion_control = {bad}"))
        assert "network.congestion_control" in msg, msg


@pytest.mark.parametrize(
    ("peers", "match"),
    [
        ("0", "at least 1"),
        ('"4"', "must be an integer"),
        ("2.5", "must be an integer"),
        ("300", "simulator"),
    ],
)
def test_bad_peer_counts(peers: str, match: str) -> None:
    msg = _err(
        BASE.replace("peers = 4", f"peers = {peers}").replace('rate = "10mbit"', 'rate = "1mbit"')
    )
    assert "network.peers" in msg and match in msg


def test_steps_versus_tokens() -> None:
    both = _err(_with("run", "tokens = 1000"))
    neither = _err(BASE.replace("steps = 100", ""))
    for msg in (both, neither):
        assert "run.steps: give exactly one of run.steps" in msg
    assert "run.steps: must be an integer >= 1, got 0" in _err(
        BASE.replace("steps = 100", "steps = 0")
    )
    assert "run.steps: must be an integer" in _err(BASE.replace("steps = 100", "steps = 1e3"))
    assert "run.steps: must be an integer" in _err(BASE.replace("steps = 100", "steps = true"))


def test_names_get_suggestions() -> None:
    assert "strategy.name: unknown strategy 'dilocco' (did you mean 'diloco'?)" in _err(
        BASE.replace('name = "diloco"', 'name = "dilocco"')
    )
    assert (
        "run.model: must be one of 'default', 'tiny', 'medium', got 'tinny' (did you mean 'tiny'?)"
        in _err(_with("run", 'model = "tinny"'))
    )


def test_strategy_options_are_scalars_and_finite() -> None:
    nested = _err(BASE + "\n[strategy.options.inner]\nx = 1\n")
    assert (
        "strategy.options.inner: options are strings, numbers, booleans or lists of those" in nested
    )
    assert "strategy.options.lr: must be finite" in _err(BASE + "\n[strategy.options]\nlr = nan\n")
    assert "strategy.options.lrs[1]: must be finite" in _err(
        BASE + "\n[strategy.options]\nlrs = [1.0, inf]\n"
    )


def test_specs_are_checked_by_their_factories() -> None:
    assert "strategy.compression: bad compression spec 'int9'" in _err(
        _with("strategy", 'compression = "int9"')
    )
    assert "strategy.aggregator: bad aggregator spec 'krumm'" in _err(
        _with("strategy", 'aggregator = "krumm"')
    )
    msg = _err(BASE + '[[byzantine]]\npeer = 1\nattack = "alie"\noptions = { sigma = 2 }\n')
    assert "byzantine[0].attack: bad attack spec 'alie:sigma=2'" in msg


def _churn(*events: str) -> str:
    return BASE + "".join(f"\n[[churn]]\n{e}\n" for e in events)


def test_churn_errors() -> None:
    assert "churn[0].peer: peer 4 does not exist: network.peers = 4, so peers are 0..3" in _err(
        _churn('action = "kill"\npeer = 4\nat_step = 5')
    )
    assert "churn[0].action: unknown churn action 'restart'" in _err(
        _churn('action = "restart"\npeer = 1\nat_step = 5')
    )
    assert "churn[0].at_step: give exactly one of at_step" in _err(
        _churn('action = "kill"\npeer = 1\nat_step = 5\nat_seconds = 3.0')
    )
    assert "churn[0].at_step: step 500 is after the run ends" in _err(
        _churn('action = "kill"\npeer = 1\nat_step = 500')
    )
    assert "churn[0].at_seconds: must be at least 0" in _err(
        _churn('action = "kill"\npeer = 1\nat_seconds = -1.0')
    )


def test_churn_sequences_must_make_sense() -> None:
    twice = _err(
        _churn('action = "kill"\npeer = 1\nat_step = 5', 'action = "kill"\npeer = 1\nat_step = 9')
    )
    assert "churn[1].action: cannot kill peer 1 at step 9: it is dead then" in twice
    cont = _err(_churn('action = "cont"\npeer = 2\nat_step = 5'))
    assert "cannot cont peer 2" in cont and "needs a stopped peer" in cont
    same = _err(
        _churn('action = "stop"\npeer = 1\nat_step = 5', 'action = "cont"\npeer = 1\nat_step = 5')
    )
    assert "at the same step 5" in same
    everyone = [f'action = "kill"\npeer = {p}\nat_step = {10 + p}' for p in range(4)]
    assert "churn[3]: after this event no peer is left running (at step 13)" in _err(
        _churn(*everyone)
    )
    # a kill and a join of another peer at the same step are fine: arrivals count first
    ok = [f'action = "kill"\npeer = {p}\nat_step = 10' for p in range(3)]
    ok += ['action = "join"\npeer = 3\nat_step = 10', 'action = "kill"\npeer = 3\nat_step = 20']
    assert "no peer is left running (at step 20)" in _err(_churn(*ok))
    s = parse_scenario(_churn(*ok[:4]))
    assert len(s.churn) == 4


def test_byzantine_errors() -> None:
    entry = '[[byzantine]]\npeer = {p}\nattack = "sign_flip"\n'
    assert "byzantine[0].peer: peer 7 does not exist" in _err(BASE + entry.format(p=7))
    assert "byzantine[1].peer: peer 1 is listed twice" in _err(
        BASE + entry.format(p=1) + entry.format(p=1)
    )
    assert "byzantine: all 4 peers are byzantine" in _err(
        BASE + "".join(entry.format(p=p) for p in range(4))
    )
    assert "byzantine[0].attack: attack names are lowercase identifiers" in _err(
        BASE + '[[byzantine]]\npeer = 0\nattack = "Sign Flip"\n'
    )
    assert "write each entry as a [[byzantine]] table" in _err(BASE + "[byzantine]\npeer = 0\n")


def test_random_churn() -> None:
    assert "random_churn.failures_per_minute: must be a positive number, got 0" in _err(
        BASE + "[random_churn]\nfailures_per_minute = 0\n"
    )
    assert "random_churn.min_peers: min_peers = 5 but network.peers = 4" in _err(
        BASE + "[random_churn]\nfailures_per_minute = 1\nmin_peers = 5\n"
    )
    rc = RandomChurn(failures_per_minute=6.0, seed=5, recover_after_seconds=15.0, min_peers=2)
    events = rc.schedule(peers=4, duration_s=600.0)
    assert events == rc.schedule(peers=4, duration_s=600.0)  # reproducible
    assert events != RandomChurn(
        failures_per_minute=6.0, seed=6, recover_after_seconds=15.0
    ).schedule(peers=4, duration_s=600.0)
    kills = [e for e in events if e.action == "kill"]
    assert 20 <= len(kills) <= 100  # Poisson with mean 60, thinned by min_peers
    # replaying the schedule: every join follows a kill of the same peer 15 s earlier, and at
    # least min_peers are always running
    down: set[int] = set()
    for e in events:
        if e.action == "kill":
            assert e.peer not in down
            down.add(e.peer)
            assert 4 - len(down) >= 2
        else:
            assert e.action == "join" and e.peer in down
            assert any(
                k.peer == e.peer and math.isclose(k.when + 15.0, e.when, abs_tol=1e-5)
                for k in kills
            )
            down.discard(e.peer)
    # without recovery, failures stop once min_peers would be crossed
    never = RandomChurn(failures_per_minute=60.0, seed=1, min_peers=3).schedule(
        peers=4, duration_s=60.0
    )
    assert [e.action for e in never] == ["kill"]


def test_dataclasses_validate_on_direct_construction() -> None:
    with pytest.raises(SpecError, match="at_step"):
        ChurnEvent(action="kill", peer=0)
    base = parse_scenario(BASE)
    with pytest.raises(SpecError, match=r"churn\[0\].peer"):
        Scenario(
            config=base.config,
            network=base.network,
            churn=(ChurnEvent(action="kill", peer=9, at_step=1),),
        )
    with pytest.raises(SpecError, match=r"network.peers: the run has 3 peers"):
        Scenario(config=dataclasses.replace(base.config, peers=3), network=base.network)


def test_fault_entries_reach_the_run_config() -> None:
    from isthmus.run.lab_run import lab_config

    s = parse_scenario(_with("", '[[fault]]\npeer = 1\nspec = "slow:3@5-10"\n'))
    assert [(f.peer, f.spec) for f in s.faults] == [(1, "slow:3@5-10")]
    assert lab_config(s).faults.peer_faults == {1: ["slow:3@5-10"]}
    assert "fault[0].spec" in _err(_with("", '[[fault]]\npeer = 0\nspec = "slow:fast"\n'))
    assert "fault[0].peer" in _err(_with("", '[[fault]]\npeer = 99\nspec = "slow:2"\n'))


def test_checkpoint_section_reaches_the_run_config(tmp_path: Path) -> None:
    from isthmus.run.lab_run import checkpoint_dir, lab_config

    s = parse_scenario(_with("", "[checkpoint]\nevery = 50\nkeep = 2\n"))
    assert s.checkpoint is not None
    assert (s.checkpoint.every, s.checkpoint.keep, s.checkpoint.dir) == (50, 2, "checkpoints")
    run = lab_config(s)
    assert (run.checkpoint.checkpoint_every, run.checkpoint.checkpoint_keep) == (50, 2)
    # a relative dir lands inside the run's own directory, so two lab runs never share one
    assert checkpoint_dir(s, run, tmp_path) == str(tmp_path.resolve() / "checkpoints")
    # an absolute path, a URL or --checkpoint-dir from the command line is used as it is
    absolute = parse_scenario(_with("", f'[checkpoint]\nevery = 5\ndir = "{tmp_path}/c"\n'))
    assert checkpoint_dir(absolute, lab_config(absolute), tmp_path / "x") == f"{tmp_path}/c"
    url = parse_scenario(_with("", '[checkpoint]\nevery = 5\ndir = "memory://ck"\n'))
    assert checkpoint_dir(url, lab_config(url), tmp_path) == "memory://ck"
    given = lab_config(s, {"checkpoint_dir": "elsewhere"})
    assert checkpoint_dir(s, given, tmp_path) == "elsewhere"
    # without the section: no checkpoints, as before
    plain = parse_scenario(BASE)
    assert plain.checkpoint is None and lab_config(plain).checkpoint.checkpoint_dir is None


def test_checkpoint_section_errors() -> None:
    assert "checkpoint.every: missing required key" in _err(_with("", "[checkpoint]\nkeep = 2\n"))
    assert "checkpoint.every: must be at least 1" in _err(_with("", "[checkpoint]\nevery = 0\n"))
    assert "checkpoint.dir: must be a non-empty string" in _err(
        _with("", '[checkpoint]\nevery = 5\ndir = ""\n')
    )
    assert "checkpoint.keep" in _err(_with("", "[checkpoint]\nevery = 5\nkeep = 0\n"))
    msg = _err(_with("", "[checkpoint]\nevery = 5\ndirectory = 'x'\n"))
    assert "checkpoint" in msg and "dir" in msg


def test_striping_and_probing_reach_the_run_config() -> None:
    from isthmus.run.lab_run import lab_config

    assert lab_config(parse_scenario(BASE)).strategy.connections == 1
    s = parse_scenario(_with("strategy", "connections = 4\nprobe_links = true"))
    assert (s.strategy.connections, s.strategy.probe_links) == (4, True)
    cfg = lab_config(s)
    assert (cfg.strategy.connections, cfg.strategy.probe_links) == (4, True)
    assert lab_config(s, {"connections": 2}).strategy.connections == 2  # the command line wins
    assert "strategy.connections" in _err(_with("strategy", "connections = 0"))
    assert "strategy.probe_links" in _err(_with("strategy", "probe_links = 1"))


# ---------------------------------------------------------------- one loader for the run and the lab


def test_a_scenario_is_a_run_config_plus_the_lab_sections() -> None:
    from isthmus.run.config import RunConfig
    from isthmus.run.lab_run import lab_config

    s = parse_scenario(
        _with("", "[data]\nbatch_size = 8\n[timeouts]\nheartbeat_timeout = 5.0\n[optim]\nlr = 3e-4")
    )
    assert isinstance(s.config, RunConfig)
    assert (s.config.data.batch_size, s.config.timeouts.heartbeat_timeout) == (8, 5.0)
    assert (s.config.peers, s.config.steps, s.config.model.preset) == (4, 100, "tiny")
    run = lab_config(s)
    assert (run.data.batch_size, run.optim.lr) == (8, 3e-4)
    assert lab_config(s, {"batch_size": 2}).data.batch_size == 2  # the command line wins
    # tokens become steps with the file's batch size, and again with the command line's
    t = parse_scenario(
        BASE.replace("steps = 100", "tokens = 40_960") + "\n[data]\nbatch_size = 8\n"
    )
    assert t.config.steps == 40_960 // (4 * 8 * 32)
    assert lab_config(t, {"batch_size": 4}).steps == 40_960 // (4 * 4 * 32)


def test_loader_errors_name_the_file_and_the_dotted_key(tmp_path: Path) -> None:
    f = tmp_path / "run.toml"
    f.write_text(_with("", '[data]\nbatch_size = "8"\n'))
    with pytest.raises(SpecError) as info:
        load_scenario(f)
    e = info.value
    assert (e.source, e.key) == (str(f), "data.batch_size")
    assert str(e) == f"{f}: data.batch_size: must be an integer, got '8'"
    # a wrong type in the lab's spelling of the run names the file's key, not the config's
    assert "case.toml: run.model: must be one of 'default', 'tiny', 'medium', got 3" in _err(
        _with("run", "model = 3")
    )
    assert "case.toml: strategy.connections: must be an integer, got '4'" in _err(
        _with("strategy", 'connections = "4"')
    )
    assert "case.toml: run.seed: must be an integer, got 1.5" in _err(_with("run", "seed = 1.5"))
    assert "case.toml: data.batch_size: must be an integer >= 1, got 0" in _err(
        _with("", "[data]\nbatch_size = 0\n")
    )


def test_loader_suggests_the_closest_key_everywhere() -> None:
    assert "case.toml: timeouts.heartbeat: unknown key (did you mean 'heartbeat_timeout'?)" in (
        _err(_with("", "[timeouts]\nheartbeat = 3.0\n"))
    )
    assert "case.toml: dta: unknown key (did you mean 'data'?)" in _err(_with("", "[dta]\nx = 1\n"))
    assert "strategy.options.sync_evry: unknown option 'sync_evry' for diloco" in _err(
        _with("", "[strategy.options]\nsync_evry = 5\n")
    )
    assert "(did you mean 'sync_every'?)" in _err(_with("", "[strategy.options]\nsync_evry = 5\n"))


def test_the_old_error_name_still_works() -> None:
    import isthmus.lab.scenario as scenario_mod

    with pytest.warns(DeprecationWarning, match="isthmus.spec.SpecError"):
        old = scenario_mod.ScenarioError
    assert old is SpecError
    with pytest.raises(old):
        parse_scenario("[run\n", source="x.toml")
