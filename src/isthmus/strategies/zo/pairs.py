"""Perturbation parallelism for ``zo`` (DistZO2, ``pairing="perturbation"``): the two passes
of a perturbation run on the two members of a pair (see
:attr:`~isthmus.strategies.zo.ZOConfig.pairing`). Functions of the strategy, kept apart from its
step."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from isthmus.strategies.zo.math import perturb_, perturbation_seed, projected_gradient

__all__ = ["paired_codes"]

PAIR_TAG = 7000
"""The tag of a pair's point-to-point message (apart from catch-up transfers' tags)."""

LossFn = Callable[..., torch.Tensor | float]


def paired_codes(zo: Any, loss_fn: LossFn, rnd: Any) -> list[int]:
    """Perturbation parallelism (DistZO2): this member's half of its pair's estimates, the
    pair's codes from the lead (the even rank), absent codes from its partner. A partner
    lost mid-exchange raises CollectiveError: the round aborts and is retried."""
    cfg, codec, per = zo.config, zo.codec, zo.config.perturbations
    rank, world = rnd.rank, rnd.world
    shards, shard, partner = (world + 1) // 2, rank // 2, rank ^ 1
    plan = rnd.plan
    resynced = {r for r, pid in enumerate(plan.members) if pid in plan.resynced}
    if partner >= world:  # the odd one out runs both passes alone
        if rank in resynced:
            zo.last_loss = math.nan
            return [codec.absent] * per
        return zo._codes(lambda: loss_fn(shard, shards), rnd.number, rank)
    zo.last_loss = math.nan
    if rank in resynced or partner in resynced:
        return [codec.absent] * per  # both members know: neither runs a pass
    lead = rank - rank % 2
    sign = 1.0 if rank == lead else -1.0
    mine = torch.tensor(
        _half(zo, loss_fn, rnd.number, lead, sign, shard, shards),
        dtype=torch.float32,
        device=zo._device,
    )
    zo.last_loss = float(mine.mean())
    if rank != lead:
        rnd.group.send(mine, lead, PAIR_TAG)
        return [codec.absent] * per
    theirs = torch.empty_like(mine)
    rnd.group.recv(theirs, partner, PAIR_TAG)
    zo.last_loss = float((mine.mean() + theirs.mean()) / 2)
    return [
        codec.encode(projected_gradient(float(a), float(b), cfg.eps))
        for a, b in zip(mine, theirs, strict=True)
    ]


def _half(
    zo: Any, loss_fn: LossFn, number: int, lead: int, sign: float, shard: int, shards: int
) -> list[float]:
    """The losses at ``theta + sign * eps * z_k`` for the pair's perturbations (seeded by
    the lead's rank) on the pair's data shard; parameters and buffers restored after."""
    cfg, params, keep = zo.config, zo.params, zo.keep
    backup = [params[i].detach().clone() for i in keep]
    others = [b.detach().clone() for _, b in zo.model_state.other_buffers]
    out: list[float] = []
    try:
        for k in range(cfg.perturbations):
            perturb_(params, keep, perturbation_seed(cfg.seed, number, lead, k), sign * cfg.eps)
            out.append(float(loss_fn(shard, shards)))
            zo._restore(backup)
    finally:
        zo._restore(backup)
        zo.buffers.restart()
        for (_, b), saved in zip(zo.model_state.other_buffers, others, strict=True):
            b.copy_(saved)
    return out
