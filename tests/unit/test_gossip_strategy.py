"""The gossip strategy in one process: SAM's two-phase form, the plain optimizer without a
session, what is shared state, option coercion and the configuration errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from isthmus.strategies import make_strategy
from isthmus.strategies.gossip import Gossip, GossipConfig
from isthmus.strategies.gossip.math import (
    LateHeavySchedule,
    PoissonSchedule,
    TopologySpec,
    sam_step,
)
from isthmus.testing import local_groups
from support.gossip import FakeSession


def _tiny_setup(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt, torch.randn(16, 5)


def test_two_phase_sam_and_closure_sam_equal_sam_step_bit_for_bit():
    batch = torch.randn(16, 5, generator=torch.Generator().manual_seed(1))

    def loss_of(m: torch.nn.Module) -> torch.Tensor:
        return (m(batch) ** 2).mean()

    ref, ref_opt, _ = _tiny_setup()
    for _ in range(3):
        sam_step(ref, loss_of, ref_opt, 0.05)
    cfg = GossipConfig(total_steps=10, sam_rho=0.05)
    # two phases: the loop computes the gradient again at the perturbed weights
    two, two_opt, _ = _tiny_setup()
    strat = Gossip(None, two, two_opt, cfg)
    calls = 0
    while strat.step_count < 3:
        two_opt.zero_grad()
        loss_of(two).backward()
        strat.step()
        calls += 1
    assert calls == 6
    # closure form
    clo, clo_opt, _ = _tiny_setup()
    strat2 = Gossip(None, clo, clo_opt, GossipConfig(total_steps=10, sam_rho=0.05))

    def closure() -> torch.Tensor:
        clo_opt.zero_grad()
        loss = loss_of(clo)
        loss.backward()
        return loss

    for _ in range(3):
        clo_opt.zero_grad()
        loss_of(clo).backward()
        strat2.step(closure)
    for a, b, c in zip(ref.parameters(), two.parameters(), clo.parameters(), strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_without_a_session_it_is_the_plain_optimizer_and_relays_do_not_train():
    a, a_opt, x = _tiny_setup()
    b, b_opt, _ = _tiny_setup()
    strat = Gossip(None, b, b_opt, GossipConfig(total_steps=4))
    for _ in range(4):
        for m, o in ((a, a_opt), (b, b_opt)):
            o.zero_grad()
            m(x).sum().backward()
        a_opt.step()
        strat.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    relay, r_opt, _ = _tiny_setup()
    before = [p.detach().clone() for p in relay.parameters()]
    s = Gossip(None, relay, r_opt, GossipConfig(total_steps=4, train=False))
    r_opt.zero_grad()
    relay(x).sum().backward()
    s.step()
    assert s.step_count == 1 and s.trained_steps == 0
    assert all(torch.equal(p, q) for p, q in zip(before, relay.parameters(), strict=True))


def test_shared_state_is_only_what_is_identical_on_every_peer():
    def names(**opts: Any) -> list[str]:
        model, opt, _ = _tiny_setup()
        session = FakeSession(0, lambda r: (local_groups(1)[0], (0,)))
        Gossip(session, model, opt, GossipConfig(total_steps=5, **opts))
        return list(session.state)

    assert names() == ["meta/step"]
    assert names(rebuild="repair") == ["meta/step", "gossip/graph_ids", "gossip/graph_adj"]
    assert names(modest_trainers=1, modest_aggregators=1) == [
        "meta/step",
        "modest/anchor",
        "modest/trainers",
    ]


def test_topology_and_schedule_specs_are_coerced_through_their_dataclasses():
    spec = TopologySpec.parse("Barabasi-Albert:m=3", seed=2)
    assert (spec.name, dict(spec.options), spec.seed) == ("barabasi_albert", {"m": 3}, 2)
    cfg = GossipConfig(total_steps=10, schedule="late-heavy:start_every=16,shape=Geometric")
    assert cfg.schedule_name == "late_heavy"
    assert cfg.schedule_obj == LateHeavySchedule(
        start_every=16, shape="geometric", iters=1, final_merge=True
    )
    poisson = GossipConfig(total_steps=10, schedule="poisson:rate=0.5,final_merge=false")
    assert poisson.schedule_obj == PoissonSchedule(rate=0.5, seed=0, final_merge=False)
    with pytest.raises(ValueError, match="write '4' as KEY=VALUE"):
        GossipConfig(total_steps=10, schedule="constant:4")
    with pytest.raises(ValueError, match=r"degree: .* must be an integer"):
        GossipConfig(total_steps=10, topology="random_regular:degree=three")
    with pytest.raises(ValueError, match=r"unknown topology 'rign' \(did you mean 'ring'\?\)"):
        GossipConfig(total_steps=10, topology="rign")
    with pytest.raises(ValueError, match=r"unknown option 'evry' for constant \(did you mean"):
        GossipConfig(total_steps=10, schedule="constant:evry=2")


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({}, "total_steps"),
        ({"total_steps": 5, "topology": "star"}, "unknown topology"),
        ({"total_steps": 5, "schedule": "sometimes"}, "unknown schedule"),
        ({"total_steps": 5, "schedule": "constant:every=0"}, "every"),
        ({"total_steps": 5, "schedule": "constant:often=2"}, "often"),
        ({"total_steps": 5, "schedule": "single_merge", "final_merge": False}, "contradicts"),
        ({"total_steps": 5, "rebuild": "repair", "topology": "random_matching"}, "static"),
        ({"total_steps": 5, "rebuild": "sometimes"}, "rebuild"),
        ({"total_steps": 5, "modest_trainers": 2}, "modest_aggregators"),
        ({"total_steps": 5, "sam_rho": -1.0}, "sam_rho"),
        ({"total_steps": 5, "gossip_steps": 0}, "gossip_steps"),
        ({"total_steps": 5, "gamma": 0.0}, "gamma"),
        ({"total_steps": 5, "transport": "carrier-pigeon"}, "transport"),
        ({"total_steps": 5, "colour": "blue"}, "unknown option"),
    ],
)
def test_bad_options_are_refused_with_a_useful_message(options, match):
    model, opt, _ = _tiny_setup()
    with pytest.raises(ValueError, match=match):
        make_strategy("gossip", None, model, opt, **options)


def test_unsupported_reductions_are_refused():
    model, opt, _ = _tiny_setup()
    with pytest.raises(ValueError, match="quantizers"):
        make_strategy("gossip", None, model, opt, compression="topk:0.1", total_steps=5)
    with pytest.raises(ValueError, match="robust aggregation"):
        make_strategy("gossip", None, model, opt, aggregator="median", total_steps=5)
    with pytest.raises(ValueError, match="variance_correction"):
        make_strategy(
            "gossip", None, model, opt, compression="int8", total_steps=5, variance_correction=True
        )
