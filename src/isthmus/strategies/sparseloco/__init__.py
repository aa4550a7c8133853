"""SparseLoCo: :mod:`.strategy` runs its rounds (on Streaming DiLoCo's schedule), :mod:`.math`
holds its codec (chunk-wise top-k, quantization, the message's bytes and their sum).

``math`` is pure: it imports neither :mod:`isthmus.comm` nor ``torch.distributed``, so every rule
of the message is tested in one process.

Like every strategy it never sees a socket. Never imports lab, integrations, run or cli
(docs/ARCHITECTURE.md, "Layers"; tools/structure.py checks it).
"""

from isthmus.strategies.sparseloco.strategy import (
    SparseGroup,
    SparseLoCo,
    SparseLoCoConfig,
    SparseRound,
    gather_messages,
)

__all__ = ["SparseGroup", "SparseLoCo", "SparseLoCoConfig", "SparseRound", "gather_messages"]
