"""Staging buffers: where a checkpoint's snapshot is copied, kept from one save to the next.

A snapshot copies the peer's part of the shared state and its local state (the inner
optimizer's moments, the local model) so that training can go on while the copy is written.
Copying into fresh tensors every time makes the allocator hand out (and the kernel fault in and
zero) as many new pages as the state has bytes; :class:`Staging` keeps one buffer per tensor,
found by its place in the nested state, and copies into it again at the next save. Buffers are
reallocated only when a tensor's shape, dtype, device or layout changes, and dropped when a
tensor disappears.

The caller must not stage again while a copy made by the previous staging is still being read
(the checkpointer writes one snapshot at a time and waits for it before the next).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["Staging"]

_Path = tuple[Any, ...]


def _fits(buf: torch.Tensor, t: torch.Tensor) -> bool:
    return buf.shape == t.shape and buf.dtype == t.dtype and buf.device == t.device


class Staging:
    """Reused copies of nested state (see the module doc). Not thread-safe: one caller stages
    at a time."""

    def __init__(self) -> None:
        self._buffers: dict[_Path, torch.Tensor] = {}
        self.allocated = 0
        """Bytes allocated for buffers so far (a steady run allocates them once)."""

    def copy(self, obj: Any) -> Any:
        """A copy of ``obj`` (tensors, and mappings, lists and tuples of them, and plain values)
        whose tensors are this staging's buffers holding the values of ``obj``'s. Plain values
        are deep-copied. Buffers of tensors no longer in ``obj`` are released."""
        used: set[_Path] = set()
        out = self._copy(obj, (), used)
        for path in [p for p in self._buffers if p not in used]:
            del self._buffers[path]
        return out

    def _copy(self, obj: Any, path: _Path, used: set[_Path]) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj.detach(), path, used)
        if isinstance(obj, Mapping):
            return {k: self._copy(v, (*path, k), used) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(v, (*path, i), used) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def _tensor(self, t: torch.Tensor, path: _Path, used: set[_Path]) -> torch.Tensor:
        if t.layout is not torch.strided or t.is_quantized or not t.is_contiguous():
            return t.clone()  # sparse, quantized or strided views: a plain clone
        used.add(path)
        buf = self._buffers.get(path)
        if buf is None or not _fits(buf, t):
            buf = torch.empty(t.shape, dtype=t.dtype, device=t.device)
            self._buffers[path] = buf
            self.allocated += buf.numel() * buf.element_size()
        buf.copy_(t)
        return buf
