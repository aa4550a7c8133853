"""Streaming DiLoCo's fragments and schedule, as pure functions (no network, no model).

Which parameters form each fragment (:func:`assign_fragments`, by numbered layer or packed by
size), which fragment a committed round syncs (:func:`fragment_for_round`) and at which steps
the regular syncs are issued and applied (:func:`sync_schedule`). Every peer computes the same
answers from the same names, sizes and round numbers. Imports neither :mod:`isthmus.comm` nor
``torch.distributed``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Literal, get_args

__all__ = [
    "PATTERNS",
    "Pattern",
    "assign_fragments",
    "fragment_for_round",
    "layer_of",
    "sync_schedule",
]

Pattern = Literal["strided", "sequential", "balanced"]
PATTERNS: tuple[str, ...] = get_args(Pattern)
_LAYER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_of(name: str) -> int | None:
    """The first numbered component of a parameter name (``blocks.3.attn.qkv.weight`` -> 3),
    or None for a parameter outside numbered layers (embeddings, final norm, head)."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def assign_fragments(
    names: Sequence[str],
    fragments: int,
    *,
    pattern: str = "strided",
    nonlayer_fragment: int = 0,
    fragment_of: Callable[[str], int] | None = None,
    sizes: Sequence[int] | None = None,
) -> list[list[int]]:
    """Split parameters (by name, in order) into ``fragments`` groups; returns the parameter
    indices of each fragment. Every parameter lands in exactly one fragment.

    ``strided`` and ``sequential`` group whole numbered layers (see the module docstring).
    ``balanced`` ignores layers and packs whole tensors (``sizes``: their element counts, needed)
    greedily, largest first, each into the currently smallest fragment (ties: the lower index),
    so that the largest fragment, and with it the peak bytes of one sync, is as close to 1/P of
    the model as whole tensors allow. It is deterministic, so every peer gets the same split.

    Raises ValueError if a fragment would be empty (more fragments than numbered layers, or than
    tensors), if the pattern is unknown, or if ``fragment_of`` returns an index outside
    ``0..fragments-1``.
    """
    if fragments < 1:
        raise ValueError(f"fragments must be >= 1, got {fragments}")
    if pattern not in PATTERNS:
        raise ValueError(f"unknown fragment pattern {pattern!r}; use one of {PATTERNS}")
    if not 0 <= nonlayer_fragment < fragments:
        raise ValueError(
            f"nonlayer_fragment must be in 0..{fragments - 1}, got {nonlayer_fragment}"
        )
    out: list[list[int]] = [[] for _ in range(fragments)]
    if fragment_of is None and pattern == "balanced":
        if sizes is None or len(sizes) != len(names):
            raise ValueError("the balanced pattern needs the element count of every parameter")
        load = [0] * fragments
        for i in sorted(range(len(names)), key=lambda i: (-sizes[i], i)):
            f = min(range(fragments), key=lambda f: (load[f], f))
            out[f].append(i)
            load[f] += sizes[i]
        for idx in out:
            idx.sort()
    elif fragment_of is not None:
        for i, n in enumerate(names):
            f = fragment_of(n)
            if not isinstance(f, int) or not 0 <= f < fragments:
                raise ValueError(f"fragment_of({n!r}) returned {f!r}; expected 0..{fragments - 1}")
            out[f].append(i)
    else:
        layers = sorted({x for x in map(layer_of, names) if x is not None})
        position = {layer: k for k, layer in enumerate(layers)}
        for i, n in enumerate(names):
            layer = layer_of(n)
            if layer is None:
                out[nonlayer_fragment].append(i)
            elif pattern == "strided":
                out[position[layer] % fragments].append(i)
            else:
                out[position[layer] * fragments // len(layers)].append(i)
        if len(layers) < fragments and fragments > 1:
            raise ValueError(
                f"{fragments} fragments but the model has {len(layers)} numbered layers "
                f"(names like 'blocks.0.*'): use fragments <= {max(1, len(layers))} or pass "
                f"fragment_of"
            )
    for f, idx in enumerate(out):
        if not idx:
            raise ValueError(
                f"fragment {f} of {fragments} would hold no parameters; use fewer fragments"
            )
    return out


def fragment_for_round(number: int, fragments: int) -> int:
    """The fragment synced by committed round ``number``: the same on every peer."""
    return number % fragments


def sync_schedule(
    sync_every: int, fragments: int, overlap: int, steps: int
) -> list[tuple[int, int]]:
    """(issue step, apply step) of every regular fragment sync up to ``steps``: applied every
    H/P steps, issued ``overlap`` steps earlier. Steps count completed inner steps."""
    interval = sync_every // fragments
    return [(a - overlap, a) for a in range(interval, steps + 1, interval)]
