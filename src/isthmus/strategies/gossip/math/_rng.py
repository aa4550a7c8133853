"""A tiny deterministic random generator shared by the gossip building blocks.

Every peer must draw *the same* topology, matching or sample from the same seed, even when peers
run different Python versions or platforms. The :mod:`random` module only promises a stable
``random()`` stream; ``shuffle``, ``sample`` and ``randrange`` may change between releases, and
:func:`hash` is salted per process. So this module uses only integer arithmetic: seeds are derived
with BLAKE2b over a canonical text of their parts, and the stream is SplitMix64 (Steele, Lea and
Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014). Not cryptographic.
"""

from __future__ import annotations

import hashlib
from collections.abc import MutableSequence
from typing import TypeVar

__all__ = ["Rng", "derive_seed"]

T = TypeVar("T")

_MASK64 = (1 << 64) - 1


def derive_seed(*parts: int | str) -> int:
    """A 64-bit seed from ``parts`` (ints and strings), identical on every machine.

    Raises ``TypeError`` for any other part type, because ``repr`` of floats or objects is not a
    stable identity across peers.
    """
    chunks: list[str] = []
    for p in parts:
        if isinstance(p, bool) or not isinstance(p, int | str):
            raise TypeError(f"derive_seed takes ints and strings, got {type(p).__name__}: {p!r}")
        # the type prefix keeps 1 and "1" apart
        chunks.append(("i" if isinstance(p, int) else "s") + str(p))
    digest = hashlib.blake2b("\x1f".join(chunks).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class Rng:
    """SplitMix64 over Python ints: same stream on every platform and Python version."""

    def __init__(self, seed: int) -> None:
        self._state = seed & _MASK64

    def next64(self) -> int:
        self._state = (self._state + 0x9E3779B97F4A7C15) & _MASK64
        z = self._state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        """Uniform integer in ``[0, n)``; rejection sampling avoids modulo bias."""
        if n <= 0:
            raise ValueError(f"below() needs n >= 1, got {n}")
        limit = ((1 << 64) // n) * n
        while True:
            x = self.next64()
            if x < limit:
                return x % n

    def shuffle(self, items: MutableSequence[T]) -> None:
        """Fisher-Yates shuffle in place."""
        for i in range(len(items) - 1, 0, -1):
            j = self.below(i + 1)
            items[i], items[j] = items[j], items[i]
