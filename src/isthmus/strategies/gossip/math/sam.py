"""Sharpness-aware local steps for decentralized training (DFedSAM).

"Improving the Model Consistency of Decentralized Federated Learning" (DFedSAM, Shi et al., ICML
2023) runs Sharpness Aware Minimization (Foret, Kleiner, Mobahi and Neyshabur, ICLR 2021) for the
local steps of decentralized FL, so each client drifts toward a flat region, and then gossips (DFedSAM-MGS: ``Q`` gossip steps per round, see
:func:`isthmus.strategies.gossip.exchange.gossip`). One SAM step:

    g = grad L(w);  e = rho * g / ||g||;  g_sam = grad L(w + e);  w <- optimizer step with g_sam

``||g||`` is the global L2 norm over all parameters that received a gradient.

Two ways to run it: :func:`sam_step` takes a closure that recomputes the loss on the current
batch; :func:`sam_perturb` / :func:`sam_restore` split the step in two for a training loop that
cannot hand over a closure (the gossip strategy uses them: one call perturbs with the gradient
the loop just computed, the loop computes the gradient again on the same batch, the next call
restores the weights and steps). Both give the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["sam_perturb", "sam_restore", "sam_step"]


def _require_finite_loss(loss: torch.Tensor, where: str) -> None:
    if loss.numel() != 1:
        raise ValueError(f"loss_fn must return a scalar, got shape {tuple(loss.shape)}")
    if not bool(torch.isfinite(loss.detach()).all()):
        raise ValueError(f"loss is NaN or Inf {where}; lower the learning rate or rho")


def sam_perturb(
    params: Sequence[torch.nn.Parameter], rho: float, *, eps: float = 1e-12
) -> list[torch.Tensor]:
    """Move each parameter that has a gradient to ``w + rho * g / ||g||`` (``||g||`` the global
    L2 norm of those gradients) and return copies of the original weights, in order, for
    :func:`sam_restore`. A zero gradient means no move. Parameters without a gradient are left
    alone (their copy is still returned).

    Raises ``ValueError`` for ``rho < 0``, when no parameter has a gradient, or for a non-finite
    gradient, leaving the weights unchanged.
    """
    if not rho >= 0.0:
        raise ValueError(f"rho must be >= 0, got {rho}")
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        raise ValueError("no parameter has a gradient; call backward() before the SAM step")
    norm = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(p.grad.detach().double()) for p in with_grad])
    )
    if not bool(torch.isfinite(norm)):
        raise ValueError("gradient is NaN or Inf; not taking a SAM step")
    saved = [p.detach().clone() for p in params]
    scale = rho / (float(norm) + eps) if float(norm) > 0 else 0.0
    with torch.no_grad():
        for p in with_grad:
            p.add_(p.grad, alpha=scale)
    return saved


def sam_restore(params: Sequence[torch.nn.Parameter], saved: Sequence[torch.Tensor]) -> None:
    """Put back the weights :func:`sam_perturb` saved (exact copies, not a subtraction).

    Raises ``ValueError`` if the lists differ in length or shape.
    """
    if len(params) != len(saved):
        raise ValueError(f"{len(saved)} saved tensors for {len(params)} parameters")
    with torch.no_grad():
        for p, s in zip(params, saved, strict=True):
            if p.shape != s.shape:
                raise ValueError(f"saved tensor of shape {tuple(s.shape)} for {tuple(p.shape)}")
            p.copy_(s)


def sam_step(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    rho: float,
    *,
    eps: float = 1e-12,
) -> float:
    """One SAM step: perturb by ``rho * g / ||g||``, take the gradient there, restore the
    weights exactly (from a copy, not by subtracting), and let ``optimizer`` step with that
    gradient. Returns the loss at the unperturbed weights.

    ``loss_fn(model)`` computes the loss on the current batch; it is called twice, so it must use
    the same batch both times. Gradients already stored on the parameters are cleared first
    (SAM needs the gradient of this batch alone). A zero gradient means no perturbation (plain
    step). Raises ``ValueError`` for ``rho < 0``, a non-scalar or non-finite loss, or a
    non-finite gradient, leaving the weights unchanged.
    """
    if not rho >= 0.0:
        raise ValueError(f"rho must be >= 0, got {rho}")
    params = [p for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model)
    _require_finite_loss(loss, "at the current weights")
    loss.backward()
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        raise ValueError("loss_fn produced no gradient for any trainable parameter")
    saved = sam_perturb(with_grad, rho, eps=eps)
    try:
        model.zero_grad(set_to_none=True)
        perturbed = loss_fn(model)
        _require_finite_loss(perturbed, "at the SAM-perturbed weights")
        perturbed.backward()
    finally:
        # restore even when the perturbed pass raised, so the caller's model is untouched
        sam_restore(with_grad, saved)
    for p in with_grad:
        if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
            model.zero_grad(set_to_none=True)
            raise ValueError("gradient at the SAM-perturbed weights is NaN or Inf; step skipped")
    optimizer.step()
    return float(loss.detach())
