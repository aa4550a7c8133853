"""Local SGD: every peer trains on its own, and parameters are averaged every H steps.

Stich, "Local SGD Converges Fast and Communicates Little", ICLR 2019, arXiv:1805.09767; as
periodic model averaging for deep learning also Lin, Stich, Patel, Jaggi, "Don't Use Large
Mini-Batches, Use Local SGD", ICLR 2020, arXiv:1808.07217.

Every ``sync_every`` (H) inner steps the peers average their parameters and all restart from the
average. isthmus runs it as the simplest member of the DiLoCo family: the averaged quantity is
the outer gradient ``theta - x_i`` and the outer step is plain SGD with learning rate 1 and no
momentum, ``theta <- theta - mean_i(theta - x_i)``, which is the parameter average
``mean_i(x_i)`` up to float rounding. Averaging differences rather than parameters keeps
compression (``--compression``) meaningful: a quantizer's error is relative to what it encodes.
Each peer keeps its own inner optimizer state (only parameters are averaged, as in the papers).

Shared state, buffers, joining and failures are DiLoCo's (see :mod:`isthmus.strategies.diloco`):
theta, the buffers' global copy (averaged at every averaging) and the step counter are shared;
the round blocks (nothing overlaps); if a peer dies during the averaging the survivors average
again among themselves, keeping their H local steps; a joiner's first step is a catch-up round
that hands it theta.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from isthmus.strategies.diloco import DiLoCo, DiLoCoConfig

__all__ = ["LocalSGD", "LocalSGDConfig"]


@dataclass(kw_only=True)
class LocalSGDConfig(DiLoCoConfig):
    """DiLoCo's config with the outer step fixed to plain averaging (lr 1, no momentum): only
    ``sync_every`` is an option."""

    sync_every: int = 80
    """H: local steps between two averagings. Where the loss hardly depends on H (see
    docs/BENCHMARKS.md, "Defaults from a search"), a larger H buys bytes; 80 keeps what a peer's
    death loses, and how long a joiner waits before it contributes, to 80 steps of work."""
    outer_lr: float = field(default=1.0, init=False)
    outer_momentum: float = field(default=0.0, init=False)
    nesterov: bool = field(default=False, init=False)


class LocalSGD(DiLoCo):
    """Periodic parameter averaging. Call :meth:`step` after every backward."""

    name = "localsgd"
    Config = LocalSGDConfig
    config: LocalSGDConfig
    islands = ""  # DiLoCo's rules with another outer step: elementwise, so by shard
