"""Zeroth-order training with shared randomness: :mod:`.strategy` runs one round per step,
:mod:`.math` holds the seeds, perturbations, the scalar codec and the update, :mod:`.replay` the
log of committed rounds that catches a stale peer up.

``math`` and ``replay`` are pure: they import neither :mod:`isthmus.comm` nor
``torch.distributed``.

Like every strategy it never sees a socket. Never imports lab, integrations, run or cli
(docs/ARCHITECTURE.md, "Layers"; tools/structure.py checks it).
"""

from isthmus.strategies.zo.strategy import ZO, ZOConfig

__all__ = ["ZO", "ZOConfig"]
