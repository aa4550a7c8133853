"""Host copies of device tensors, into buffers kept from one round to the next.

What crosses islands over Gloo travels from host memory, and the DiLoCo family may keep its
outer state there (``outer_state_device="cpu"``). :class:`HostStage` takes a round's device
tensors to the host, and :func:`upload` brings a host value back:

* **on CUDA**, :meth:`HostStage.stage` copies each tensor into a page-locked (pinned) host
  buffer with ``non_blocking`` copies issued on a side stream, after the work already queued on
  the tensor's current stream (so the copy sees the values the training step wrote). The
  training thread only enqueues the copies: it returns at once, and (``fence``, the default)
  the compute stream is told to wait for them before it runs anything queued later (a GPU-side
  wait, not a CPU one), so a later kernel that overwrites the source cannot race the copy; a
  caller whose later kernels only read the sources, or that reads every copy before it queues a
  write, passes ``fence=False`` and its kernels run beside the copies. Each tensor gets an event;
  :meth:`StagedCopy.get` waits for that tensor's copy alone, so the host work on the first
  tensors runs while the last ones are still copying.
* **on the CPU** (or with no CUDA device at all), the same calls make plain copies into the same
  kept buffers: the logic (which buffer, when it is reused or replaced, what ``get`` returns)
  is the CUDA path's, and is what the CPU tests check; the CUDA calls themselves go through
  :class:`CudaOps`, which a test replaces to check their order. Nothing is pinned and no stream
  is touched without CUDA.

Buffers are kept per slot (a caller's key, a tensor's position) and replaced when the shape,
dtype or pinning they need changes. A buffer is handed out until the next :meth:`stage` of its
slot: a caller that must keep a value longer copies it (the DiLoCo family's outer gradients are
fresh tensors computed from it).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

__all__ = ["CudaOps", "HostStage", "StagedCopy", "cuda_usable", "upload"]


def cuda_usable(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on a CUDA device of a torch that has CUDA (the only case where pinned
    memory, streams and events are used)."""
    return t.is_cuda and torch.cuda.is_available()


class CudaOps:
    """The CUDA calls staging makes, in one place: a test without a GPU gives
    :class:`HostStage` and :func:`upload` an object with the same methods that records them, to
    check their order (which stream waits for which, where each event is recorded)."""

    def usable(self, t: torch.Tensor) -> bool:
        return cuda_usable(t)

    def pinned(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.is_pinned()

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device=device)

    def on(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def event(self) -> Any:
        return torch.cuda.Event()

    def keep_for(self, t: torch.Tensor, stream: Any) -> None:
        t.record_stream(stream)


CUDA = CudaOps()


class StagedCopy:
    """Host copies in flight: :meth:`get` ``(i)`` is tensor ``i``'s host copy once its copy is
    done (it waits for that one only); :meth:`tensors` waits for all. On the CPU every copy is
    already done when :meth:`HostStage.stage` returns."""

    def __init__(self, buffers: list[torch.Tensor], events: list[Any | None]) -> None:
        self._buffers = buffers
        self._events = events

    def __len__(self) -> int:
        return len(self._buffers)

    def get(self, i: int) -> torch.Tensor:
        ev = self._events[i]
        if ev is not None:
            ev.synchronize()
            self._events[i] = None
        return self._buffers[i]

    def tensors(self) -> list[torch.Tensor]:
        return [self.get(i) for i in range(len(self._buffers))]

    def ready(self) -> bool:
        """Whether every copy has finished (never blocks)."""
        return all(ev is None or ev.query() for ev in self._events)


class HostStage:
    """Kept host buffers and, on CUDA, the side stream the copies run on (see the module
    docstring). One instance per user of it: its buffers are reused by the next :meth:`stage`
    of the same slot."""

    def __init__(self, ops: CudaOps = CUDA) -> None:
        self.ops = ops
        self._buffers: dict[Hashable, tuple[torch.Tensor, bool]] = {}  # buffer, pinned
        self._streams: dict[torch.device, Any] = {}
        self.allocations = 0
        """Buffers allocated so far (a buffer reused does not count)."""
        self.staged_bytes = 0
        """Bytes copied to the host so far."""

    def _buffer(self, key: Hashable, t: torch.Tensor, pin: bool) -> torch.Tensor:
        kept = self._buffers.get(key)
        if kept is not None and (kept[0].shape, kept[0].dtype, kept[1]) == (t.shape, t.dtype, pin):
            return kept[0]
        # pin_memory needs CUDA: only asked for when the source is on a CUDA device
        if pin:
            buf = self.ops.pinned(t.shape, t.dtype)
        else:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        self._buffers[key] = (buf, pin)
        self.allocations += 1
        return buf

    def _side(self, device: torch.device) -> Any:
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = self.ops.new_stream(device)
        return s

    def stage(
        self, tensors: Sequence[torch.Tensor], *, slot: Hashable = "", fence: bool = True
    ) -> StagedCopy:
        """Start copying ``tensors`` to the host, into this stage's buffers of ``slot`` (one per
        position); returns at once on CUDA, after the copies on the CPU. The values copied are
        those the tensors hold once the work queued before this call has run; with ``fence``
        the work queued after it waits for the copies (see the module docstring). A buffer given
        out for ``slot`` earlier is overwritten."""
        buffers: list[torch.Tensor] = []
        events: list[Any | None] = []
        fences: dict[torch.device, Any] = {}
        ops = self.ops
        for i, t in enumerate(tensors):
            src = t.detach()
            on_cuda = ops.usable(src)
            buf = self._buffer((slot, i), src, on_cuda)
            self.staged_bytes += src.numel() * src.element_size()
            if not on_cuda:
                buf.copy_(src)
                buffers.append(buf)
                events.append(None)
                continue
            main = ops.current_stream(src.device)
            side = self._side(src.device)
            side.wait_stream(main)  # the copy reads what the queued training work wrote
            with ops.on(side):
                buf.copy_(src, non_blocking=True)
                ev = ops.event()
                ev.record(side)
            # the caching allocator must not hand the source's memory to the compute stream
            # until the side stream has read it
            ops.keep_for(src, side)
            buffers.append(buf)
            events.append(ev)
            fences[src.device] = ev
        for device, ev in fences.items() if fence else ():
            # later kernels on the compute stream (one that overwrites a source) wait for the
            # copies on the GPU; the training thread does not
            ops.current_stream(device).wait_event(ev)
        return StagedCopy(buffers, events)


def upload(dst: torch.Tensor, src: torch.Tensor, ops: CudaOps = CUDA) -> Any | None:
    """``dst.copy_(src)`` (cast to ``dst``'s dtype), where ``src`` is a host tensor and ``dst``
    may be on a device. From pinned host memory to a CUDA tensor the copy is ``non_blocking``
    and an event is returned that completes with it: ``src`` must not be written before it has
    (the caller waits for it before it next writes ``src``). Otherwise the copy is done on
    return and None is returned."""
    with torch.no_grad():
        if ops.usable(dst) and ops.is_pinned(src):
            if dst.dtype == src.dtype:
                dst.copy_(src, non_blocking=True)
            else:  # the bytes as they are, then the cast on the device (no host temporary)
                dst.copy_(src.to(dst.device, non_blocking=True))
            ev = ops.event()
            ev.record(ops.current_stream(dst.device))
            return ev
        dst.copy_(src)
    return None
