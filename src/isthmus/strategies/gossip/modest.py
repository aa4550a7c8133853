"""MoDeST rounds inside the gossip strategy.

de Vos et al., "MoDeST: Bridging the Gap between Federated and Decentralized Learning with
Decentralized Sampling" (2023): each round a seeded sample of trainers sends its models to a
seeded sample of aggregators, who average them and hand the result to everyone. The pure math
(the samples, the success fraction, the one-process reference of a round's aggregate) is
:mod:`isthmus.strategies.gossip.math.sampling`; this module holds one round over a group
(:func:`modest_aggregate`) and what the strategy keeps between rounds and shares with joiners.

Shared state (identical on every in-sync peer, registered with the session): the last aggregate
(``modest/anchor``, the model a round falls back to when too few trainers delivered) and the
trainers sampled for the next round (``modest/trainers``, peer ids padded with -1).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from isthmus.comm.group import Group, Handle
from isthmus.comm.session import Round, Session
from isthmus.strategies.gossip.exchange import MAX_ITERS_PER_ROUND, _wait, edge_tag
from isthmus.strategies.gossip.math.averaging import _check_received, _flat
from isthmus.strategies.gossip.math.sampling import (
    _check_roles,
    aggregation_ready,
    modest_aggregate_reference,
    sample_round,
)
from isthmus.strategies.gossip.options import GossipConfig

__all__ = ["Modest", "modest_aggregate"]


class Modest:
    """One peer's MoDeST state. ``initial`` is this peer's flat model at construction; every
    peer starts from rank 0's after the run's first round (MoDeST needs ``initial_sync``)."""

    def __init__(self, config: GossipConfig, initial: torch.Tensor) -> None:
        self.config = config
        self.anchor = initial.clone()
        self.trainers = torch.full((config.graph_capacity,), -1, dtype=torch.int64)
        self.fallbacks = 0
        """Rounds in which no aggregator had enough trainers' models and the anchor was kept."""

    def register(self, session: Session) -> None:
        session.register("modest/anchor", self.anchor)
        session.register("modest/trainers", self.trainers)

    def is_trainer(self, peer_id: int) -> bool:
        """Whether ``peer_id`` was sampled to train in the coming round."""
        return peer_id in set(self.trainers.tolist())

    def aggregate(
        self, rnd: Round, vec: torch.Tensor, rows: list[list[int]], contrib: list[int]
    ) -> tuple[torch.Tensor, int]:
        """This round's exchange: the sampled trainers' models (``rows[r][1]`` says who trained)
        go to the round's sampled aggregators and their average to everyone. Returns the new
        model and how many trainers' models it used (0: the anchor was kept). Raises
        :class:`~isthmus.comm.group.CollectiveError` if a peer fails mid-way."""
        cfg = self.config
        members = rnd.plan.members
        sampled = [int(x) for x in self.trainers.tolist() if x >= 0]
        trainers = [r for r in contrib if rows[r][1] == 1]
        aggregators = sample_round(
            [members[r] for r in contrib],
            rnd.number,
            seed=cfg.seed,
            trainers=cfg.modest_trainers,
            aggregators=cfg.modest_aggregators,
        ).aggregators
        return modest_aggregate(
            rnd.group,
            vec,
            trainers=trainers,
            aggregators=[members.index(int(a)) for a in aggregators],
            expected=len(sampled),
            success_fraction=cfg.modest_success,
            fallback=self.anchor,
            exchange=rnd.number * MAX_ITERS_PER_ROUND,
        )

    def adopt(
        self,
        new: torch.Tensor,
        *,
        members: Sequence[int],
        number: int,
        used: int | None,
        start: bool,
    ) -> None:
        """Round ``number`` over ``members`` committed with model ``new``: it becomes the anchor,
        and the trainers of round ``number + 1`` are sampled (the same on every peer)."""
        self.anchor.copy_(new)
        if used == 0 and not start:
            self.fallbacks += 1
        nxt = sample_round(
            list(members),
            number + 1,
            seed=self.config.seed,
            trainers=self.config.modest_trainers,
            aggregators=self.config.modest_aggregators,
        ).trainers
        self.trainers.fill_(-1)
        self.trainers[: len(nxt)] = torch.tensor([int(x) for x in nxt], dtype=torch.int64)


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
