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

The walk runs on the training thread, so it does as little per tensor as it can: the copies
run under one ``torch.no_grad()`` (no ``detach()`` per tensor), a tensor whose copy is deferred
is only recorded (its checks and its copy happen in :meth:`Staging.finish`, on the writer
thread), and plain values that cannot change (numbers, strings, bytes, None) are kept as they
are instead of deep-copied.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["Staging"]

_Path = tuple[Any, ...]
# plain values nothing can change in place: the snapshot may hold them as they are
_IMMUTABLE = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)
_ATOMS = frozenset(_IMMUTABLE)  # exactly these types (subclasses go through isinstance)


def _stageable(t: torch.Tensor) -> bool:
    return t.layout is torch.strided and not t.is_quantized and t.is_contiguous()


def _fits(buf: torch.Tensor, t: torch.Tensor) -> bool:
    return buf.shape == t.shape and buf.dtype == t.dtype and buf.device == t.device


class Staging:
    """Reused copies of nested state (see the module doc). Not thread-safe: one caller stages
    at a time."""

    def __init__(self) -> None:
        self._buffers: dict[_Path, torch.Tensor] = {}
        self._pending: list[tuple[dict[Any, Any], Any, _Path, torch.Tensor]] = []
        self.allocated = 0
        """Bytes allocated for buffers so far (a steady run allocates them once)."""

    def copy(self, obj: Any, defer: Callable[[_Path], bool] | None = None) -> Any:
        """A copy of ``obj`` (tensors, and mappings, lists and tuples of them, and plain values)
        whose tensors are this staging's buffers holding the values of ``obj``'s. Immutable
        plain values are kept, other plain values deep-copied. Buffers of tensors no longer in
        ``obj`` are released.

        ``defer(path)`` true for a tensor held in a mapping (``path``: the keys down to it):
        the copy holds the live tensor there until :meth:`finish` copies it (on another thread,
        while nothing writes it)."""
        used: set[_Path] = set()
        self._pending = []
        with torch.no_grad():  # copies into buffers stay out of autograd, without a detach each
            out = self._copy(obj, (), used, defer)
        for path in [p for p in self._buffers if p not in used]:
            del self._buffers[path]
        return out

    @property
    def pending(self) -> bool:
        """Tensors deferred by the last :meth:`copy` are still to be copied."""
        return bool(self._pending)

    def finish(self) -> None:
        """Copy the tensors the last :meth:`copy` deferred into their buffers, in place in the
        copy it returned."""
        pending, self._pending = self._pending, []
        with torch.no_grad():
            for container, key, path, t in pending:
                container[key] = self._into(path, t) if _stageable(t) else t.clone()

    def _copy(self, obj: Any, path: _Path, used: set[_Path], defer: Any) -> Any:
        if type(obj) in _ATOMS:  # the most common leaf, found by one lookup
            return obj
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, path, used)
        if isinstance(obj, (dict, Mapping)):  # dict first: the ABC check is the slow one
            out: dict[Any, Any] = {}
            pending = self._pending
            for k, v in obj.items():
                p = (*path, k)
                if defer is not None and isinstance(v, torch.Tensor) and defer(p):
                    used.add(p)  # its buffer stays, for finish() to copy into
                    out[k] = v  # the live tensor, until finish() copies it
                    pending.append((out, k, p, v))
                else:
                    out[k] = self._copy(v, p, used, defer)
            return out
        if isinstance(obj, (list, tuple)):
            if all(type(v) in _ATOMS for v in obj):  # an optimizer's parameter indices, betas
                return obj if isinstance(obj, tuple) else type(obj)(obj)
            return type(obj)(self._copy(v, (*path, i), used, defer) for i, v in enumerate(obj))
        if isinstance(obj, _IMMUTABLE):
            return obj
        return copy.deepcopy(obj)

    def _tensor(self, t: torch.Tensor, path: _Path, used: set[_Path]) -> torch.Tensor:
        if not _stageable(t):
            return t.clone()  # sparse, quantized or strided views: a plain clone
        used.add(path)
        return self._into(path, t)

    def _into(self, path: _Path, t: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(path)
        if buf is None or not _fits(buf, t):
            buf = torch.empty(t.shape, dtype=t.dtype, device=t.device)
            self._buffers[path] = buf
            self.allocated += buf.numel() * buf.element_size()
        buf.copy_(t)
        return buf
