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

:func:`modest_aggregate` is one synchronous MoDeST round over a
:class:`~isthmus.comm.group.Group`: the trainers send their models to every aggregator, each
aggregator averages what it received (or keeps the previous aggregate when fewer than the
success fraction arrived), and the aggregators hand the result to everyone else, so every rank
ends the round with the same bits. :func:`modest_aggregate_reference` is its one-process
reference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch

from isthmus.comm.group import Group, Handle
from isthmus.strategies.gossip.exchange import _wait, edge_tag
from isthmus.strategies.gossip.math._rng import derive_seed
from isthmus.strategies.gossip.math.averaging import _check_received, _flat

__all__ = [
    "RoundSample",
    "aggregation_ready",
    "modest_aggregate",
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


def modest_aggregate(
    group: Group,
    vec: torch.Tensor,
    *,
    trainers: Sequence[int],
    aggregators: Sequence[int],
    expected: int,
    success_fraction: float,
    fallback: torch.Tensor,
    exchange: int,
) -> tuple[torch.Tensor, int]:
    """One synchronous MoDeST round; returns ``(aggregate, models averaged)``, the aggregate
    identical bit for bit on every rank (0 models: ``fallback`` was kept).

    ``trainers`` and ``aggregators`` are ranks of ``group``, the same on every rank. Each trainer
    sends its flat ``vec`` to every aggregator (``len(trainers) * len(aggregators)`` messages);
    aggregators average them in rank order when at least ``success_fraction`` of ``expected``
    trainer models arrived, else take ``fallback`` (the previous aggregate, identical on the
    aggregators); then every other rank receives the result from one aggregator, chosen round
    robin. ``vec`` matters only on trainers, ``fallback`` only on aggregators.

    Raises ``ValueError`` for bad role lists, a non-finite vector sent or received;
    :class:`~isthmus.comm.group.CollectiveError` if a partner fails.
    """
    me, world = group.rank, group.world
    _check_roles(trainers, aggregators, world)
    ts, aggs = sorted(trainers), list(aggregators)
    numel = vec.numel()
    handles: list[Handle] = []
    got: dict[int, torch.Tensor] = {}
    if me in ts:
        flat = _flat(vec, f"trainer rank {me}'s vector")
        got[me] = flat
        for a in aggs:
            if a != me:
                handles.append(group.send(flat, a, edge_tag(exchange, me, a, world), async_op=True))
    if me in aggs:
        for t in ts:
            if t != me:
                got[t] = torch.empty(numel, dtype=vec.dtype)
                handles.append(
                    group.recv(got[t], t, edge_tag(exchange, t, me, world), async_op=True)
                )
    _wait(handles)
    others = [r for r in range(world) if r not in set(aggs)]
    # who serves whom in the hand-out: the k-th non-aggregator gets it from aggregator k mod a
    server = {r: aggs[k % len(aggs)] for k, r in enumerate(others)}
    handles = []
    if me in aggs:
        error: ValueError | None = None
        try:
            for t in ts:
                _check_received(got[t], t)
            result, used = modest_aggregate_reference(
                [got.get(r, vec) for r in range(world)],
                ts,
                expected=expected,
                success_fraction=success_fraction,
                fallback=fallback,
            )
            if not bool(torch.isfinite(result).all()):
                raise ValueError(
                    "MoDeST aggregate is not finite (the fallback or a sum overflowed)"
                )
        except ValueError as e:
            # The ranks this aggregator serves are waiting for its send: hand them NaN, which
            # they reject with the same kind of error at once, rather than leave them to time
            # out as if this peer had died.
            error = e
            result, used = torch.full((numel,), float("nan"), dtype=vec.dtype), 0
        for r, a in server.items():
            if a == me:
                handles.append(
                    group.send(result, r, edge_tag(exchange, me, r, world, 1), async_op=True)
                )
        _wait(handles)
        if error is not None:
            raise error
        return result, used
    result = torch.empty(numel, dtype=vec.dtype)
    src = server[me]
    _wait([group.recv(result, src, edge_tag(exchange, src, me, world, 1), async_op=True)])
    _check_received(result, src)
    used = len(ts) if ts and aggregation_ready(len(ts), expected, success_fraction) else 0
    return result, used
