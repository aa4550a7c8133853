"""The gossip strategy over real in-process Gloo groups (one thread per peer) behind a minimal
stand-in for the session whose rounds always commit: schedules, the final merge, D-PSGD's exact
mean dynamics, joiners and non-finite peers receiving copies, MoDeST, quantized messages, and
variance correction."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from isthmus.comm.group import Group
from isthmus.strategies import make_strategy
from isthmus.strategies.gossip import Gossip, GossipConfig
from isthmus.strategies.gossip.math import (
    gossip_reference,
    make_topology,
    variance_corrected_gossip_reference,
)
from isthmus.strategies.gossip.math.consensus import consensus_distance
from isthmus.testing import local_groups, run_parallel
from support.gossip import FakeSession, Layout


class Quad(torch.nn.Module):
    """loss = 0.5 ||x - target||^2: D-PSGD's mean follows plain gradient descent exactly."""

    def __init__(self, x0: torch.Tensor) -> None:
        super().__init__()
        self.x = torch.nn.Parameter(x0.clone())

    def loss(self, target: torch.Tensor) -> torch.Tensor:
        return 0.5 * ((self.x - target) ** 2).sum()


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _peers(
    n: int,
    options: dict[str, Any],
    *,
    dim: int = 6,
    lr: float = 0.1,
    compression: str | None = None,
) -> tuple[list[Group], Callable[[Group], tuple[Gossip, Quad, torch.optim.Optimizer]]]:
    groups = local_groups(n)
    members = tuple(range(n))

    def build(g: Group) -> tuple[Gossip, Quad, torch.optim.Optimizer]:
        # different starting points: initial_sync must make them equal (or not, when off)
        model = Quad(torch.full((dim,), float(g.rank)))
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        session = FakeSession(g.rank, lambda r, g=g: (g, members))
        strat = make_strategy("gossip", session, model, opt, compression=compression, **options)
        assert isinstance(strat, Gossip)
        return strat, model, opt

    return groups, build


def _targets(n: int, dim: int = 6) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(dim, generator=gen) * 3 + i for i in range(n)]


def _train(strat: Gossip, model: Quad, opt: torch.optim.Optimizer, target: torch.Tensor) -> None:
    total = strat.config.total_steps
    assert total is not None
    while strat.step_count < total:
        opt.zero_grad()
        model.loss(target).backward()
        strat.step()
    strat.finish()


def test_dpsgd_mean_follows_gradient_descent_and_the_merge_makes_peers_identical():
    n, steps, lr = 4, 20, 0.1
    targets = _targets(n)
    groups, build = _peers(
        n, {"total_steps": steps, "topology": "ring", "schedule": "constant"}, lr=lr
    )

    def body(g: Group) -> tuple[torch.Tensor, dict[str, Any], int]:
        strat, model, opt = build(g)
        _train(strat, model, opt, targets[g.rank])
        return _flat(model), strat.metrics(), strat.session.revision  # type: ignore[union-attr]

    out = run_parallel(groups, body)
    finals = [o[0] for o in out]
    assert all(torch.equal(finals[0], f) for f in finals)
    # initial_sync: everyone starts from rank 0's x = 0; gossip and the merge keep the mean, and
    # on a quadratic the mean takes exact gradient steps toward the mean target
    mean_target = torch.stack(targets).mean(0)
    expect = mean_target * (1 - (1 - lr) ** steps)
    assert torch.allclose(finals[0], expect, atol=1e-4)
    m = out[0][1]
    # a start round, gossip after steps 0..38, the merge after step 39
    assert m["rounds_by_kind"] == {"membership": 0, "gossip": steps - 1, "merge": 1, "start": 1}
    assert out[0][2] == steps + 1
    assert m["merge_consensus_distance"] > 0.01  # heterogeneous targets keep the peers apart
    assert m["graph"]["members"] == [0, 1, 2, 3] and len(m["graph"]["edges"]) == 4


def test_schedules_decide_the_rounds():
    steps = 24
    cases = {
        "single_merge": {"gossip": 0, "merge": 1},
        "constant:every=4": {"gossip": 5, "merge": 1},
        "late_heavy:start_every=8,end_every=1": None,
    }
    for schedule, expect in cases.items():
        groups, build = _peers(3, {"total_steps": steps, "schedule": schedule})

        def body(g: Group, build=build) -> tuple[dict[str, int], torch.Tensor]:
            strat, model, opt = build(g)
            _train(strat, model, opt, torch.full((6,), float(g.rank)))
            return strat.metrics()["rounds_by_kind"], _flat(model)

        out = run_parallel(groups, body)
        kinds = out[0][0]
        assert all(o[0] == kinds for o in out)
        assert all(torch.equal(out[0][1], o[1]) for o in out), schedule
        if expect is None:  # late-heavy: sparser than every step, denser than every 8th
            assert steps // 8 < kinds["gossip"] < steps - 1 and kinds["merge"] == 1
        else:
            assert {k: kinds[k] for k in expect} == expect, schedule


def test_without_final_merge_peers_stay_different():
    # four peers: a ring of three would be the complete graph, which averages exactly
    groups, build = _peers(
        4, {"total_steps": 6, "schedule": "constant:every=3", "final_merge": False}
    )

    def body(g: Group) -> torch.Tensor:
        strat, model, opt = build(g)
        _train(strat, model, opt, torch.full((6,), 10.0 * g.rank))
        assert strat.metrics()["rounds_by_kind"]["merge"] == 0
        return _flat(model)

    out = run_parallel(groups, body)
    assert consensus_distance(out) > 0.1


def test_a_joiner_gets_an_exact_copy_and_its_stale_model_is_never_mixed_in():
    # epoch 1: peers 0 and 1 (ranks 0, 1); from round 2 on, peer 2 joins (ranks 0, 1, 2)
    two, three = local_groups(2), local_groups(3)
    steps = 8  # rounds: start, gossip (steps 1, 3, 5: the joiner arrives at the second), merge
    opts = {"total_steps": steps, "topology": "ring", "schedule": "constant:every=2"}
    targets = _targets(3)
    snapshots: dict[int, list[torch.Tensor]] = {}

    def layout(peer: int) -> Layout:
        def f(r: int) -> tuple[Group, tuple[int, ...]]:
            return (two[peer], (0, 1)) if r < 2 else (three[peer], (0, 1, 2))

        return f

    def member(g: Group) -> tuple[torch.Tensor, dict[str, Any]]:
        peer = g.rank
        model = Quad(torch.zeros(6))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        strat = Gossip(FakeSession(peer, layout(peer)), model, opt, GossipConfig(**opts))
        pre: list[torch.Tensor] = []
        orig = strat._run_round

        def spy(kind: int | None, iters: int) -> None:
            pre.append(_flat(model))
            orig(kind, iters)

        strat._run_round = spy  # type: ignore[method-assign]
        _train(strat, model, opt, targets[peer])
        snapshots[peer] = pre
        return _flat(model), strat.metrics()

    def joiner(g: Group) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        model = Quad(torch.full((6,), float("nan")))  # a stale model that must never spread
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        # the members' counter at round 2: the start round, then steps 0 and 1 and a gossip
        session = FakeSession(
            2,
            lambda r: (three[2], (0, 1, 2)),
            revision=2,
            resync=(2, {"meta/step": torch.tensor(4)}),
        )
        strat = Gossip(session, model, opt, GossipConfig(**opts))
        opt.zero_grad()
        model.loss(targets[2]).backward()
        strat.step()  # first call: the catch-up round
        after_join = _flat(model)
        _train(strat, model, opt, targets[2])
        return after_join, _flat(model), strat.metrics()

    # rounds 0-1 run on the two-peer groups, then all three peers continue together
    results: dict[int, Any] = {}

    def run(idx: int) -> None:
        results[idx] = member(two[idx]) if idx < 2 else joiner(three[2])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 3, "a peer did not finish"
    after_join, final_j, mj = results[2]
    # round 2 (the joiner's first): the two members mixed only with each other (Metropolis
    # weights of the 2-ring), and the joiner got an exact copy of member 0's result
    x0, x1 = snapshots[0][2], snapshots[1][2]
    mixed = gossip_reference([x0, x1], make_topology("ring", 2))
    assert torch.equal(after_join, mixed[0])
    assert mj["copies_received"] == 1 and mj["rounds_by_kind"]["start"] == 0
    assert mj["trained_steps"] == steps - 4
    assert torch.equal(final_j, results[0][0]) and torch.equal(final_j, results[1][0])
    # the next gossip round mixed all three over the graph rebuilt for the new member list
    assert results[0][1]["graph"]["members"] == [0, 1, 2]
    assert mj["rounds_by_kind"] == {"membership": 0, "gossip": 2, "merge": 1, "start": 0}


def test_a_peer_whose_model_went_non_finite_takes_a_copy_and_the_run_goes_on():
    groups, build = _peers(3, {"total_steps": 4, "schedule": "constant:every=2"})
    targets = _targets(3)

    def body(g: Group) -> tuple[torch.Tensor, dict[str, Any]]:
        strat, model, opt = build(g)
        while strat.step_count < 4:
            opt.zero_grad()
            model.loss(targets[g.rank]).backward()
            if g.rank == 1 and strat.step_count == 1:
                with torch.no_grad():
                    model.x[2] = float("inf")  # diverged right before the first gossip
            strat.step()
        strat.finish()
        return _flat(model), strat.metrics()

    out = run_parallel(groups, body)
    assert all(bool(torch.isfinite(o[0]).all()) for o in out)
    assert all(torch.equal(out[0][0], o[0]) for o in out)
    assert out[1][1]["nonfinite_skips"] == 1 and out[1][1]["copies_received"] == 1
    assert out[0][1]["nonfinite_skips"] == 0


def test_modest_rounds_leave_every_peer_with_the_same_aggregate():
    n = 5
    groups, build = _peers(
        n,
        {
            "total_steps": 12,
            "schedule": "constant:every=3",
            "modest_trainers": 2,
            "modest_aggregators": 2,
            "seed": 4,
        },
    )
    targets = _targets(n)

    def body(g: Group) -> tuple[list[torch.Tensor], dict[str, Any], list[bool]]:
        strat, model, opt = build(g)
        after: list[torch.Tensor] = []
        trains: list[bool] = []
        orig = strat._apply

        def spy(t: Any) -> None:
            orig(t)
            after.append(_flat(model))
            trains.append(strat._takes_local_step())

        strat._apply = spy  # type: ignore[method-assign]
        _train(strat, model, opt, targets[g.rank])
        return after, strat.metrics(), trains

    out = run_parallel(groups, body)
    rounds = len(out[0][0])
    assert rounds == 5  # start, three MoDeST rounds, the final (MoDeST) merge
    for r in range(rounds):
        assert all(torch.equal(out[0][0][r], o[0][r]) for o in out), f"round {r}"
    # exactly two peers train in each phase; a phase's trainers are the same on every peer's view
    for r in range(rounds - 1):
        assert sum(o[2][r] for o in out) == 2
    trained = [o[1]["trained_steps"] for o in out]
    assert sum(trained) == 2 * 12 and max(trained) < 12
    assert all(o[1]["modest_fallbacks"] == 0 for o in out)


def test_quantized_gossip_keeps_the_mean_and_sends_fewer_bytes():
    n = 4
    targets = _targets(n, dim=256)

    def run(compression: str | None) -> tuple[list[torch.Tensor], list[int]]:
        groups, build = _peers(
            n,
            {"total_steps": 3, "schedule": "constant", "final_merge": False, "initial_sync": False},
            dim=256,
            compression=compression,
        )

        def body(g: Group) -> tuple[torch.Tensor, int]:
            strat, model, opt = build(g)
            _train(strat, model, opt, targets[g.rank])
            return _flat(model), g.stats.by_op.get("send", 0)

        out = run_parallel(groups, body)
        return [o[0] for o in out], [o[1] for o in out]

    plain, plain_bytes = run(None)
    quant, quant_bytes = run("int8")
    assert torch.allclose(torch.stack(quant).mean(0), torch.stack(plain).mean(0), atol=1e-4)
    assert not torch.equal(quant[0], plain[0])  # the messages really were quantized
    assert sum(quant_bytes) * 3 < sum(plain_bytes)


def test_variance_correction_applies_the_vanishing_variance_rescaling():
    n = 3
    groups = local_groups(n)
    inits = [
        torch.randn(40, generator=torch.Generator().manual_seed(i)) * (i + 1) for i in range(n)
    ]

    def body(g: Group) -> torch.Tensor:
        model = Quad(inits[g.rank])
        opt = torch.optim.SGD(model.parameters(), lr=0.0)  # no learning: isolate the mixing
        cfg = GossipConfig(
            total_steps=2,
            schedule="constant:every=2",
            final_merge=False,
            initial_sync=False,
            variance_correction=True,
        )
        strat = Gossip(FakeSession(g.rank, lambda r: (g, (0, 1, 2))), model, opt, cfg)
        _train(strat, model, opt, torch.zeros(40))
        return _flat(model)

    out = run_parallel(groups, body)
    ref = variance_corrected_gossip_reference(inits, make_topology("ring", n), [40])
    for a, b in zip(out, ref, strict=True):
        assert torch.equal(a, b)


def test_membership_rounds_and_an_early_finish_still_end_on_one_merge():
    groups, build = _peers(
        3, {"total_steps": 12, "schedule": "single_merge", "membership_every": 3}
    )
    targets = _targets(3)

    def body(g: Group) -> tuple[torch.Tensor, dict[str, int]]:
        strat, model, opt = build(g)
        for _ in range(7):  # stop early: finish() must hold the merge itself
            opt.zero_grad()
            model.loss(targets[g.rank]).backward()
            strat.step()
        strat.finish()
        return _flat(model), strat.metrics()["rounds_by_kind"]

    out = run_parallel(groups, body)
    assert all(torch.equal(out[0][0], o[0]) for o in out)
    # membership rounds after steps 2 and 5 exchange nothing; the merge comes from finish()
    assert out[0][1] == {"membership": 2, "gossip": 0, "merge": 1, "start": 1}


def test_one_peer_exponential_with_log2_n_gossip_steps_averages_exactly():
    n = 4
    groups, build = _peers(
        n,
        {
            "total_steps": 2,
            "topology": "one_peer_exponential",
            "schedule": "constant:every=2",
            "gossip_steps": 2,
            "final_merge": False,
            "initial_sync": False,
        },
        lr=0.0,
    )

    def body(g: Group) -> torch.Tensor:
        strat, model, opt = build(g)
        _train(strat, model, opt, torch.zeros(6))
        return _flat(model)

    out = run_parallel(groups, body)
    # pairs i^1 then i^2, each averaging exactly: everyone holds the mean 1.5 of 0, 1, 2, 3
    for o in out:
        assert torch.equal(o, torch.full((6,), 1.5))
