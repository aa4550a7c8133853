"""MoDeST rounds inside the gossip strategy.

de Vos et al., "MoDeST: Bridging the Gap between Federated and Decentralized Learning with
Decentralized Sampling" (2023): each round a seeded sample of trainers sends its models to a
seeded sample of aggregators, who average them and hand the result to everyone. The math (the
samples, the aggregation over a group) is :mod:`isthmus.strategies.gossip.sampling`; this module
holds what the strategy keeps between rounds and shares with joiners.

Shared state (identical on every in-sync peer, registered with the session): the last aggregate
(``modest/anchor``, the model a round falls back to when too few trainers delivered) and the
trainers sampled for the next round (``modest/trainers``, peer ids padded with -1).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from isthmus.comm.session import Round, Session
from isthmus.strategies.gossip.exchange import MAX_ITERS_PER_ROUND
from isthmus.strategies.gossip.options import GossipConfig
from isthmus.strategies.gossip.sampling import modest_aggregate, sample_round

__all__ = ["Modest"]


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
