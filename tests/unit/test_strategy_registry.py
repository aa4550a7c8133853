"""One constructor path for strategies: the registry, typed configs validated without a model,
the base constructor and from_options."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from isthmus.lab.scenario import STRATEGIES as SCENARIO_STRATEGIES
from isthmus.lab.scenario import parse_scenario
from isthmus.reduce.reducer import Reducer
from isthmus.spec import SpecError
from isthmus.strategies import (
    DDP,
    STRATEGIES,
    DDPConfig,
    DeMo,
    DeMoConfig,
    DiLoCo,
    DiLoCoConfig,
    Gossip,
    GossipConfig,
    LocalSGD,
    LocalSGDConfig,
    SparseLoCoConfig,
    StreamingDiLoCo,
    make_strategy,
)


def _setup() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_names_are_written_once() -> None:
    assert STRATEGIES.names() == [
        "ddp",
        "diloco",
        "localsgd",
        "streaming",
        "eager",
        "co2",
        "gossip",
        "zo",
        "sparseloco",
        "decoupled_momentum",
    ]
    assert tuple(STRATEGIES.names()) == SCENARIO_STRATEGIES
    for name in STRATEGIES.names():
        cls = STRATEGIES.lookup(name).config_cls
        assert cls is not None and cls.__name__.endswith("Config")


def test_the_old_name_of_decoupled_momentum_works_with_a_deprecation() -> None:
    """``demo`` named both a command and a strategy: it still finds the strategy, everywhere a
    strategy name is read, and the warning names the new name."""
    model, opt = _setup()
    new = "'decoupled_momentum'"
    with pytest.warns(DeprecationWarning, match=f"strategy name 'demo' is deprecated: use {new}"):
        assert STRATEGIES.lookup("demo") is STRATEGIES.lookup("decoupled_momentum")
    with pytest.warns(DeprecationWarning, match=new):
        st = make_strategy("demo", None, model, opt, top_k="4")
    assert isinstance(st, DeMo) and st.name == "decoupled_momentum" and st.config.top_k == 4
    with pytest.warns(DeprecationWarning, match=new):  # a spec string, as the grammar reads it
        entry, cfg = STRATEGIES.resolve("demo:top_k=8")
    assert entry.name == "decoupled_momentum" and cfg == DeMoConfig(top_k=8)
    scenario = '[run]\nname = "x"\nsteps = 3\n[network]\npeers = 2\nrate = "10mbit"\n'
    with pytest.warns(DeprecationWarning, match=new):  # a scenario file's [strategy]
        s = parse_scenario(scenario + '[strategy]\nname = "demo"\n')
    assert s.config.strategy.name == "demo"
    with pytest.raises(SpecError, match=r"strategy.name: unknown strategy 'demoo'"):
        parse_scenario(scenario + '[strategy]\nname = "demoo"\n')
    assert "demo" not in STRATEGIES.names()  # listed under its new name only


def test_options_are_validated_without_a_model() -> None:
    cfg = STRATEGIES.lookup("diloco").config({"sync_every": "5", "nesterov": "off"})
    assert cfg == DiLoCoConfig(sync_every=5, nesterov=False)
    assert STRATEGIES.lookup("gossip").config({"total_steps": 10}).schedule_obj is not None
    with pytest.raises(ValueError, match="gossip needs total_steps"):
        STRATEGIES.lookup("gossip").config({})
    with pytest.raises(ValueError, match=r"outer_lr: must be a number, got .fast."):
        STRATEGIES.lookup("diloco").config({"outer_lr": "fast"})
    with pytest.raises(ValueError, match="outer_momentum must be in"):
        STRATEGIES.lookup("streaming").config({"outer_momentum": 1})
    # SparseLoCo on Streaming's fragments and overlap: Streaming's options, checked alike
    cfg = STRATEGIES.lookup("sparseloco").config({"fragments": "2", "overlap": "1"})
    assert cfg == SparseLoCoConfig(fragments=2, overlap=1) and cfg.interval == 5  # H = 10
    with pytest.raises(ValueError, match=r"sparseloco restarts each synced fragment.*alpha"):
        STRATEGIES.lookup("sparseloco").config({"fragments": 2, "alpha": 0.5})
    with pytest.raises(ValueError, match=r"overlap \(tau=10\) must be in 0\.\.9"):
        STRATEGIES.lookup("sparseloco").config({"sync_every": 20, "fragments": 2, "overlap": 10})
    with pytest.raises(ValueError, match=r"start: .*\(did you mean 'paper'\?\)"):
        STRATEGIES.lookup("eager").config({"start": "papr"})
    # LocalSGD is DiLoCo with the outer step fixed to plain averaging: those are not options
    with pytest.raises(
        ValueError,
        match=r"unknown option 'outer_lr' for localsgd; valid: sync_every, inner_budget, phase_seconds, outer_state_device$",
    ):
        STRATEGIES.lookup("localsgd").config({"outer_lr": 0.5})
    with pytest.raises(
        ValueError, match="unknown option 'x' for ddp; valid: global_batch, micro_batch"
    ):
        STRATEGIES.lookup("ddp").config({"x": 1})


def test_make_strategy_names_unknown_strategies_and_options() -> None:
    model, opt = _setup()
    with pytest.raises(ValueError, match=r"unknown strategy 'dilocoo' \(did you mean 'diloco'\?\)"):
        make_strategy("dilocoo", None, model, opt)
    with pytest.raises(ValueError, match=r"unknown option 'sync_evry' .*did you mean 'sync_every'"):
        make_strategy("diloco", None, model, opt, sync_evry=4)
    with pytest.raises(ValueError, match="unknown option 'schedule_obj'"):  # built, not an option
        make_strategy("gossip", None, model, opt, total_steps=4, schedule_obj=None)
    s = make_strategy("localsgd", None, model, opt, compression="int8", sync_every="3")
    assert isinstance(s, LocalSGD) and s.config == LocalSGDConfig(sync_every=3)
    assert (s.config.outer_lr, s.config.outer_momentum, s.config.nesterov) == (1.0, 0.0, False)
    assert s.reducer.compressor is not None and s.inner is opt


def test_one_constructor_for_every_strategy() -> None:
    model, opt = _setup()
    ddp = DDP(None, model, opt)
    assert ddp.config == DDPConfig() and ddp.optimizer is opt and ddp.reducer.compressor is None
    reducer = Reducer()
    d = DiLoCo(None, model, opt, DiLoCoConfig(sync_every=2), reducer=reducer)
    assert d.reducer is reducer and d.names == ["0.weight", "0.bias", "1.weight", "1.bias"]
    with pytest.raises(TypeError, match="LocalSGD takes a LocalSGDConfig, got DiLoCoConfig"):
        LocalSGD(None, model, opt, DiLoCoConfig())
    with pytest.raises(ValueError, match="gossip needs total_steps"):
        Gossip(None, model, opt)
    g = Gossip(None, model, opt, GossipConfig(total_steps=3))
    assert g.config.total_steps == 3
    s = StreamingDiLoCo.from_options(
        None, model, opt, Reducer(), sync_every=2, fragments=2, overlap=0
    )
    assert s.fragments == [[0, 1], [2, 3]]
    custom = StreamingDiLoCo(None, model, opt, s.config, fragment_of=lambda n: 1 - int(n[0]))
    assert custom.fragments == [[2, 3], [0, 1]]


def test_a_strategys_math_is_pure_and_lives_with_its_strategy() -> None:
    """Every folder strategy's math module (and ZO's round log) imports neither the network
    layer nor torch.distributed, and no strategy's math is left in the generic reduce package."""
    src = Path(__file__).resolve().parents[2] / "src" / "isthmus"
    pure = [*sorted((src / "strategies").rglob("math.py")), src / "strategies/zo/replay.py"]
    assert {p.parent.name for p in pure} >= {"sparseloco", "zo", "decoupled_momentum"}
    for path in pure:
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for n in names:
                assert not n.startswith(("isthmus.comm", "torch.distributed")), (path, n)
                if n.startswith("isthmus."):  # only other strategies' pure math
                    assert n.endswith(".math"), (path, n)
    leftovers = sorted(
        p.name for p in (src / "reduce").glob("*.py") if p.stem.endswith(("_math", "_log"))
    )
    assert leftovers == []
