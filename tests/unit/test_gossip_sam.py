"""DFedSAM's local step: the SAM update on a quadratic, exact restore, zero and bad gradients."""

from __future__ import annotations

import pytest
import torch

from isthmus.strategies.gossip.math.sam import sam_perturb, sam_restore, sam_step

A = torch.tensor([1.0, 4.0, 9.0], dtype=torch.float64)


class Quadratic(torch.nn.Module):
    def __init__(self, w: list[float]) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(w, dtype=torch.float64))


def loss_fn(m: Quadratic) -> torch.Tensor:
    return 0.5 * (A * m.w * m.w).sum()  # gradient A * w


def test_sam_step_on_a_quadratic_matches_the_closed_form():
    w0 = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    m = Quadratic(w0.tolist())
    lr, rho = 0.05, 0.1
    loss = sam_step(m, loss_fn, torch.optim.SGD(m.parameters(), lr=lr), rho)
    g = A * w0
    perturbed = w0 + rho * g / torch.linalg.vector_norm(g)
    expected = w0 - lr * (A * perturbed)
    assert loss == pytest.approx(float(0.5 * (A * w0 * w0).sum()))
    assert torch.allclose(m.w.detach(), expected, rtol=0, atol=1e-12)
    # and it differs from a plain SGD step, so the perturbation was really applied
    assert not torch.allclose(m.w.detach(), w0 - lr * g, rtol=0, atol=1e-6)


def test_weights_are_restored_exactly_before_the_optimizer_step():
    m = Quadratic([0.3, 0.7, -1.1])
    before = m.w.detach().clone()
    sam_step(m, loss_fn, torch.optim.SGD(m.parameters(), lr=0.0), rho=0.37)
    assert torch.equal(m.w.detach(), before)


def test_zero_gradient_means_no_perturbation_and_rho_zero_is_sgd():
    m = Quadratic([0.0, 0.0, 0.0])
    sam_step(m, loss_fn, torch.optim.SGD(m.parameters(), lr=0.1), rho=0.5)
    assert torch.equal(m.w.detach(), torch.zeros(3, dtype=torch.float64))
    m = Quadratic([1.0, 1.0, 1.0])
    sam_step(m, loss_fn, torch.optim.SGD(m.parameters(), lr=0.1), rho=0.0)
    assert torch.allclose(m.w.detach(), 1.0 - 0.1 * A)


def test_sam_reaches_the_minimum():
    m = Quadratic([2.0, -1.0, 0.5])
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    for _ in range(300):
        sam_step(m, loss_fn, opt, rho=0.01)
    # SAM with a fixed rho orbits within about rho of the minimum of this quadratic
    assert torch.linalg.vector_norm(m.w.detach()) < 0.02


def test_non_finite_loss_or_gradient_raises_and_leaves_weights_alone():
    m = Quadratic([1.0, 2.0, 3.0])
    before = m.w.detach().clone()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="loss is NaN or Inf at the current weights"):
        sam_step(m, lambda mod: mod.w.sum() * float("nan"), opt, rho=0.1)
    calls = []

    def blows_up_when_perturbed(mod):
        calls.append(1)
        return loss_fn(mod) * (float("inf") if len(calls) == 2 else 1.0)

    with pytest.raises(ValueError, match="SAM-perturbed"):
        sam_step(m, blows_up_when_perturbed, opt, rho=0.1)
    assert torch.equal(m.w.detach(), before)
    with pytest.raises(ValueError, match="rho"):
        sam_step(m, loss_fn, opt, rho=-1.0)


def test_two_phase_perturb_restore_equals_sam_step_bitwise():
    w0 = [1.0, -2.0, 0.5]
    ref = Quadratic(w0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    sam_step(ref, loss_fn, ref_opt, 0.3)
    m = Quadratic(w0)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    loss_fn(m).backward()
    saved = sam_perturb(list(m.parameters()), 0.3)
    assert not torch.equal(m.w.detach(), torch.tensor(w0, dtype=torch.float64))
    m.zero_grad()
    loss_fn(m).backward()  # the gradient at the perturbed weights
    sam_restore(list(m.parameters()), saved)
    opt.step()
    assert torch.equal(m.w, ref.w)


def test_perturb_refuses_missing_or_non_finite_gradients():
    m = Quadratic([1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="backward"):
        sam_perturb(list(m.parameters()), 0.1)
    m.w.grad = torch.tensor([1.0, float("nan"), 0.0], dtype=torch.float64)
    with pytest.raises(ValueError, match="NaN"):
        sam_perturb(list(m.parameters()), 0.1)
    assert m.w.tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="saved"):
        sam_restore(list(m.parameters()), [])
