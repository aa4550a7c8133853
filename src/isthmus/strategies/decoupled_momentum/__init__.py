"""DeMo, decoupled momentum (registered as ``decoupled_momentum``; ``demo`` is its deprecated
name): :mod:`.strategy` runs one round per step, :mod:`.math` holds the DCT codec.

``math`` is pure: it imports neither :mod:`isthmus.comm` nor ``torch.distributed``.

Like every strategy it never sees a socket. Never imports lab, integrations, run or cli
(docs/ARCHITECTURE.md, "Layers"; tools/structure.py checks it).
"""

from isthmus.strategies.decoupled_momentum.strategy import DeMo, DeMoConfig

__all__ = ["DeMo", "DeMoConfig"]
