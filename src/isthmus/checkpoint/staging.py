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

__all__ = ["DeferredChanged", "Staging"]

_Path = tuple[Any, ...]
# plain values nothing can change in place: the snapshot may hold them as they are
_IMMUTABLE = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)
_ATOMS = frozenset(_IMMUTABLE)  # exactly these types (subclasses go through isinstance)


def _stageable(t: torch.Tensor) -> bool:
    return t.layout is torch.strided and not t.is_quantized and t.is_contiguous()


def _fits(buf: torch.Tensor, t: torch.Tensor) -> bool:
    return buf.shape == t.shape and buf.dtype == t.dtype and buf.device == t.device


class DeferredChanged(RuntimeError):
    """A subtree deferred whole (see :class:`Staging`) held, when the writer thread walked it,
    something ``defer`` does not cover: that snapshot is not a consistent cut, so it is not
    written (the checkpointer counts a failure; the next save walks the subtree again)."""


class Staging:
    """Reused copies of nested state (see the module doc). Not thread-safe: one caller stages
    at a time.

    With ``defer``, a mapping whose every tensor was deferred at the previous save (and which
    held nothing but tensors and such mappings) is deferred whole at the next one: the training
    thread only records it, and :meth:`finish` walks it (an optimizer's per-parameter state).
    If that walk meets a tensor ``defer`` does not cover, or a plain value, :meth:`finish`
    raises :class:`DeferredChanged`."""

    def __init__(self) -> None:
        self._buffers: dict[_Path, torch.Tensor] = {}
        self._pending: list[tuple[dict[Any, Any], Any, _Path, Any]] = []
        self._defer: Callable[[_Path], bool] | None = None
        self._used: set[_Path] = set()
        self._whole: set[_Path] = set()  # mappings deferred whole at the last save
        self._whole_next: set[_Path] = set()  # ... and those found so at this one
        self.allocated = 0
        """Bytes allocated for buffers so far (a steady run allocates them once)."""

    def copy(self, obj: Any, defer: Callable[[_Path], bool] | None = None) -> Any:
        """A copy of ``obj`` (tensors, and mappings, lists and tuples of them, and plain values)
        whose tensors are this staging's buffers holding the values of ``obj``'s. Immutable
        plain values are kept, other plain values deep-copied. Buffers of tensors no longer in
        ``obj`` are released (with ``defer``: by :meth:`finish`).

        ``defer(path)`` true for a tensor held in a mapping (``path``: the keys down to it):
        the copy holds the live tensor there until :meth:`finish` copies it (on another thread,
        while nothing writes it); see the class doc for mappings deferred whole."""
        self._used = used = set()
        self._pending = []
        self._defer = defer
        self._whole_next = set()
        with torch.no_grad():  # copies into buffers stay out of autograd, without a detach each
            out = self._copy(obj, (), used, defer)
        if defer is None:
            self._prune()
        return out

    @property
    def pending(self) -> bool:
        """Tensors deferred by the last :meth:`copy` are still to be copied."""
        return bool(self._pending)

    def finish(self) -> None:
        """Copy the tensors the last :meth:`copy` deferred into their buffers, in place in the
        copy it returned, and release the buffers of tensors that are gone. Raises
        :class:`DeferredChanged` (and forgets which mappings to defer whole) if a mapping
        deferred whole now holds what ``defer`` does not cover."""
        pending, self._pending = self._pending, []
        used, defer = self._used, self._defer
        try:
            with torch.no_grad():
                for container, key, path, live in pending:
                    if isinstance(live, torch.Tensor):
                        container[key] = self._deferred(path, live, used)
                    else:
                        container[key] = self._whole_tree(live, path, used, defer)
        except DeferredChanged:
            self._whole = self._whole_next = set()
            raise
        self._whole = self._whole_next
        if defer is not None:
            self._prune()

    def _prune(self) -> None:
        used = self._used
        for path in [p for p in self._buffers if p not in used]:
            del self._buffers[path]

    def _deferred(self, path: _Path, t: torch.Tensor, used: set[_Path]) -> torch.Tensor:
        if not _stageable(t):
            return t.clone()
        used.add(path)
        return self._into(path, t)

    def _whole_tree(self, obj: Any, path: _Path, used: set[_Path], defer: Any) -> dict[Any, Any]:
        """The copy of a mapping deferred whole (on the writer thread)."""
        out: dict[Any, Any] = {}
        for k, v in obj.items():
            p = (*path, k)
            if isinstance(v, torch.Tensor) and defer(p):
                out[k] = self._deferred(p, v, used)
            elif isinstance(v, Mapping) and v:
                out[k] = self._whole_tree(v, p, used, defer)
            else:
                raise DeferredChanged(
                    f"{'/'.join(map(str, p))}: {type(v).__name__} in a part of the local state "
                    "copied after the step it belongs to"
                )
        self._whole_next.add(path)
        return out

    def _copy(self, obj: Any, path: _Path, used: set[_Path], defer: Any) -> Any:
        if type(obj) in _ATOMS:  # the most common leaf, found by one lookup
            return obj
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, path, used)
        if isinstance(obj, (dict, Mapping)):  # dict first: the ABC check is the slow one
            out: dict[Any, Any] = {}
            pending = self._pending
            whole = defer is not None and bool(obj)  # so far every entry deferred
            for k, v in obj.items():
                p = (*path, k)
                if defer is None:
                    out[k] = self._copy(v, p, used, None)
                elif p in self._whole and isinstance(v, Mapping):
                    out[k] = v  # the live mapping, until finish() walks it
                    pending.append((out, k, p, v))
                elif isinstance(v, torch.Tensor) and defer(p):
                    out[k] = v  # the live tensor, until finish() copies it
                    pending.append((out, k, p, v))
                else:
                    out[k] = self._copy(v, p, used, defer)
                    whole = whole and p in self._whole_next  # a mapping deferred throughout
            if whole and path:
                self._whole_next.add(path)
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
