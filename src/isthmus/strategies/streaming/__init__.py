"""Streaming DiLoCo: :mod:`.strategy` runs the fragments' overlapped rounds on the phased
skeleton and the round pipeline, :mod:`.math` cuts the model into fragments and schedules them.

``math`` is pure: it imports neither :mod:`isthmus.comm` nor ``torch.distributed``.

Like every strategy it never sees a socket. Never imports lab, integrations, run or cli
(docs/ARCHITECTURE.md, "Layers"; tools/structure.py checks it).
"""

from isthmus.strategies.streaming.math import (
    assign_fragments,
    fragment_for_round,
    layer_of,
    sync_schedule,
)
from isthmus.strategies.streaming.strategy import StreamingConfig, StreamingDiLoCo

__all__ = [
    "StreamingConfig",
    "StreamingDiLoCo",
    "assign_fragments",
    "fragment_for_round",
    "layer_of",
    "sync_schedule",
]
