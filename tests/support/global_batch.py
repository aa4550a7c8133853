"""A small regression problem for the global-batch tests: a seeded two-layer model and a loss
over sample positions (positions wrap around 64 fixed samples)."""

from __future__ import annotations

from collections.abc import Callable

import torch

_X = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
_Y = torch.randn(64, 2, generator=torch.Generator().manual_seed(2))


def make_model() -> torch.nn.Module:
    """The same weights on every call (it seeds torch's global generator with 0)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def positions_loss(model: torch.nn.Module) -> Callable[[list[int]], torch.Tensor]:
    """The mean squared error of ``model`` on the samples at the given positions."""

    def loss_fn(positions: list[int]) -> torch.Tensor:
        idx = torch.tensor(positions) % len(_X)
        return torch.nn.functional.mse_loss(model(_X[idx]), _Y[idx])

    return loss_fn
