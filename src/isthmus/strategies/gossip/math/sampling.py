"""Seeded per-round sampling of trainers and aggregators (MoDeST).

"MoDeST: Bridging the Gap between Federated and Decentralized Learning with Decentralized
Sampling" (de Vos et al., 2023): every round a random sample of ``s`` nodes trains and a random
sample of ``a`` nodes aggregates; aggregators move on once a success fraction of the expected
models arrived, which keeps training going when most nodes are unresponsive. Every peer must compute the same sample without talking to anyone, so the sample is
a pure function of ``(seed, round, members)``.

We use rendezvous (highest-random-weight) hashing: each member gets a 64-bit key from
``(seed, role, round, member)`` and the ``k`` smallest keys are chosen. That is a uniform sample
without replacement, identical on every platform and Python version, and stable under membership
change: a member leaving never reorders the others.

:func:`modest_aggregate_reference` is the aggregate of one round computed in one process: the
round over a group (:func:`isthmus.strategies.gossip.modest.modest_aggregate`) must give every
rank exactly its bits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch

from isthmus.strategies.gossip.math._rng import derive_seed

__all__ = [
    "RoundSample",
    "aggregation_ready",
    "modest_aggregate_reference",
    "sample_round",
]

Member = int | str


@dataclass(frozen=True)
class RoundSample:
    """Who trains and who aggregates in one round (each tuple in sampling order)."""

    round: int
    trainers: tuple[Member, ...]
    aggregators: tuple[Member, ...]


def _ranked(members: Sequence[Member], seed: int, role: str, round: int) -> list[Member]:
    return sorted(members, key=lambda m: (derive_seed(seed, role, round, m), str(m)))


def sample_round(
    members: Sequence[Member],
    round: int,
    *,
    seed: int,
    trainers: int,
    aggregators: int,
    disjoint: bool = False,
) -> RoundSample:
    """The trainers and aggregators of ``round`` among ``members`` (peer ids, ints or strings).

    The order of ``members`` does not matter. When fewer members are left than requested, every
    member is sampled (the run shrank; MoDeST keeps going). With ``disjoint`` no member holds both
    roles: aggregators are chosen first (at most ``n - 1`` of them), trainers from the rest; with
    a single member, it does both.

    Raises ``ValueError`` for an empty or duplicated member list, a negative round, or sample
    sizes below 1.
    """
    if not members:
        raise ValueError("cannot sample a round from an empty member list")
    if len(set(members)) != len(members):
        raise ValueError(f"member list has duplicates: {list(members)!r}")
    if round < 0:
        raise ValueError(f"round must be >= 0, got {round}")
    if trainers < 1 or aggregators < 1:
        raise ValueError(
            f"each round needs at least one trainer and one aggregator, got trainers={trainers} "
            f"aggregators={aggregators}"
        )
    n = len(members)
    agg_order = _ranked(members, seed, "aggregator", round)
    if disjoint and n >= 2:
        aggs = agg_order[: min(aggregators, n - 1)]
        chosen = set(aggs)
        pool = [m for m in members if m not in chosen]
        trains = _ranked(pool, seed, "trainer", round)[:trainers]
    else:
        aggs = agg_order[:aggregators]
        trains = _ranked(members, seed, "trainer", round)[:trainers]
    return RoundSample(round=round, trainers=tuple(trains), aggregators=tuple(aggs))


def aggregation_ready(received: int, expected: int, success_fraction: float) -> bool:
    """True once an aggregator holds enough models to move on: at least
    ``ceil(success_fraction * expected)`` and at least one.

    The fraction is read as the nearest fraction with denominator up to 10^6, so ``0.1 * 10``
    needs exactly 1 model, not 2 as float rounding would give. Raises ``ValueError`` for a
    fraction outside ``(0, 1]`` or negative counts.
    """
    if not 0.0 < success_fraction <= 1.0:
        raise ValueError(f"success_fraction must be in (0, 1], got {success_fraction}")
    if received < 0 or expected < 0:
        raise ValueError(f"counts must be >= 0, got received={received} expected={expected}")
    frac = Fraction(success_fraction).limit_denominator(1_000_000)
    need = max(1, math.ceil(frac * expected))
    return received >= need


def _check_roles(trainers: Sequence[int], aggregators: Sequence[int], world: int) -> None:
    for label, ranks in (("trainers", trainers), ("aggregators", aggregators)):
        if len(set(ranks)) != len(ranks) or any(not 0 <= r < world for r in ranks):
            raise ValueError(f"{label} {list(ranks)} must be distinct ranks in 0..{world - 1}")
    if not aggregators:
        raise ValueError("a MoDeST round needs at least one aggregator")


def _average_in_order(models: Sequence[torch.Tensor]) -> torch.Tensor:
    # a fixed order and plain elementwise adds: every aggregator gets the same bits
    acc = models[0].clone()
    for m in models[1:]:
        acc.add_(m)
    return acc.div_(len(models))


def modest_aggregate_reference(
    vectors: Sequence[torch.Tensor],
    trainers: Sequence[int],
    *,
    expected: int,
    success_fraction: float,
    fallback: torch.Tensor,
) -> tuple[torch.Tensor, int]:
    """The aggregate :func:`modest_aggregate` gives every rank: the average of the trainers'
    flat vectors, summed in increasing rank order, or a copy of ``fallback`` when
    :func:`aggregation_ready` says too few arrived. Returns ``(aggregate, models averaged)``
    (0 when the fallback was used)."""
    ts = sorted(trainers)
    if ts and aggregation_ready(len(ts), expected, success_fraction):
        return _average_in_order([vectors[t].detach().reshape(-1) for t in ts]), len(ts)
    return fallback.detach().reshape(-1).clone(), 0
