"""CO2 (Sun et al., ICLR 2024) formula by formula, as docs/STRATEGIES.md's paper-vs-isthmus table
states them: one peer, plain SGD on a constant gradient, so that every value is a hand
computation in exactly representable numbers."""

from __future__ import annotations

import torch

from isthmus.reduce.reducer import Reduced
from isthmus.strategies import CO2, CO2Config

W0 = 1.0  # the initial weight
ETA = 0.25  # the inner SGD learning rate
TAU = 2  # local steps per round: one phase moves the weight by TAU * ETA = 0.5


def _co2(cfg: CO2Config) -> tuple[CO2, torch.nn.Parameter]:
    w = torch.nn.Parameter(torch.full((2,), W0))
    model = torch.nn.Module()
    model.w = w
    return CO2(None, model, torch.optim.SGD([w], lr=ETA), cfg), w


def _steps(st: CO2, w: torch.nn.Parameter, n: int) -> None:
    for _ in range(n):
        w.grad = torch.ones(2)  # a constant gradient: each local step moves w by -ETA
        st.step()


def test_local_updating_and_one_round_staleness():
    # paper: tau local steps, then the all-reduce of round t runs during round t+1; its outer
    # update is applied at the next boundary. isthmus: at the first boundary nothing is applied
    # (the round is in flight); at the second, round 1's outer gradient (0.5) is.
    st, w = _co2(CO2Config(sync_every=TAU, outer_momentum=0.0, gap_penalty=1.0, clip=None))
    _steps(st, w, TAU - 1)
    assert w.tolist() == [W0 - ETA] * 2  # local updating: the user's optimizer
    _steps(st, w, 1)
    assert st.global_params[0].tolist() == [W0] * 2  # round 1 in flight, x_old unchanged
    _steps(st, w, TAU)
    assert st.global_params[0].tolist() == [W0 - 0.5] * 2  # round 1 applied, one round late


def test_restart_from_the_global_parameters_without_the_round_in_flight():
    # paper: x_{t+1,0} = x_{t+1}: each worker restarts from the global parameters, which do not
    # hold the round still being reduced. isthmus: after every boundary the model holds x_old.
    st, w = _co2(CO2Config(sync_every=TAU, outer_momentum=0.0, gap_penalty=1.0, clip=None))
    _steps(st, w, TAU)
    assert w.tolist() == [W0] * 2  # not W0 - 0.5: round 1 is still in flight
    _steps(st, w, TAU)
    assert w.tolist() == st.global_params[0].tolist() == [W0 - 0.5] * 2


def test_outer_momentum_with_the_gap_penalty_and_the_outer_step():
    # m <- beta m + D / penalty; x_old <- x_old - outer_lr m
    st, w = _co2(
        CO2Config(sync_every=TAU, outer_lr=1.0, outer_momentum=0.5, gap_penalty=2.0, clip=None)
    )
    _steps(st, w, 2 * TAU)  # round 1 applied: m = 0.5 / 2 = 0.25
    assert st.momentum[0].tolist() == [0.25] * 2
    assert st.global_params[0].tolist() == [W0 - 0.25] * 2
    st.finish()  # round 2 (D = 0.5) settles: m = 0.5 * 0.25 + 0.25 = 0.375
    assert st.momentum[0].tolist() == [0.375] * 2
    assert st.global_params[0].tolist() == [W0 - 0.25 - 0.375] * 2
    assert w.tolist() == [W0 - 0.625] * 2  # the run ends on x_old


def test_outer_lr_scales_the_step():
    st, w = _co2(
        CO2Config(sync_every=TAU, outer_lr=0.5, outer_momentum=0.0, gap_penalty=1.0, clip=None)
    )
    _steps(st, w, 2 * TAU)
    assert st.global_params[0].tolist() == [W0 - 0.5 * 0.5] * 2


def test_outer_momentum_clipping_clamps_element_wise():
    # paper: clip the outer momentum; the public code's clamp discards its result, isthmus's
    # clamps in place: m = 0.375 is clamped to 0.3125 before the outer step
    st, w = _co2(CO2Config(sync_every=TAU, outer_momentum=0.5, gap_penalty=2.0, clip=0.3125))
    _steps(st, w, 2 * TAU)
    st.finish()
    assert st.momentum[0].tolist() == [0.3125] * 2
    assert st.global_params[0].tolist() == [W0 - 0.25 - 0.3125] * 2
    assert st.clipped == 2
    # negative side, directly on the outer step: D = -1 gives m = -1, clamped to -0.3125
    st.momentum[0].zero_()
    before = st.global_params[0].clone()
    st.apply_outer(Reduced([torch.full((2,), -1.0)], None, 1))
    assert st.momentum[0].tolist() == [-0.3125] * 2
    assert torch.equal(st.global_params[0], before + 0.3125)
