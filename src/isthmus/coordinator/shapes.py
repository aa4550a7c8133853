"""The shape of a declared tensor, checked before anything computes with it.

A peer declares its shared tensors' shapes (:class:`~isthmus.coordinator.protocol.TensorSpec`)
and the coordinator compares, stores and hands them on; a dimension no tensor can have (a
fraction, NaN, infinity, a negative or absurdly large number) is a malformed request, answered
400 naming it, never an exception deep inside the coordinator.
"""

from __future__ import annotations

from typing import Any

from isthmus.coordinator.wire import WireError

__all__ = ["MAX_DIM", "MAX_ELEMENTS", "decode_shape"]

MAX_DIM = 2**40
"""The largest dimension a tensor schema may declare (a shape beyond it is a malformed request,
not a tensor anyone can hold)."""
MAX_ELEMENTS = 2**48
"""The most elements one declared tensor may have."""


def decode_shape(shape: Any, path: str) -> tuple[int, ...]:
    """``shape`` as a tuple of dimensions; raises :class:`WireError` naming the first one that is
    not a whole number from 0 to :data:`MAX_DIM` (a float, NaN, infinity, negative, too large),
    or the shape when its element count exceeds :data:`MAX_ELEMENTS`."""
    if not isinstance(shape, list | tuple):
        raise WireError(path, f"expected a list of dimensions, got {type(shape).__name__}")
    if len(shape) > 64:
        raise WireError(path, f"has {len(shape)} dimensions; at most 64 are accepted")
    dims = []
    total = 1
    for i, d in enumerate(shape):
        at = f"{path}[{i}]"
        if isinstance(d, bool) or not isinstance(d, int):
            raise WireError(at, f"expected an integer (a number of elements), got {d!r:.40}")
        if d < 0:
            raise WireError(at, f"is negative ({d})")
        if d > MAX_DIM:
            raise WireError(at, f"is absurdly large ({d:.3g} > {MAX_DIM})")
        total *= d
        dims.append(d)
    if total > MAX_ELEMENTS:
        raise WireError(path, f"declares {total:.3g} elements (more than {MAX_ELEMENTS})")
    return tuple(dims)
