"""The models of the demo, the tests and the benchmarks: a tiny byte-level GPT.

:class:`GPT` and :class:`GPTConfig` (:mod:`.gpt`), with its named sizes (``PRESETS``).
Strategies work on any ``torch.nn.Module``; nothing in isthmus depends on this model except
the built-in job that trains it.

models is part of the floor: it imports torch and nothing of isthmus. Never imports coordinator,
comm, reduce, testing, checkpoint, runconfig, strategies, lab, integrations, run or cli (docs/ARCHITECTURE.md,
"Layers"; tools/structure.py checks it).
"""

from isthmus.models.gpt import GPT, PRESETS, GPTConfig

__all__ = ["GPT", "PRESETS", "GPTConfig"]
