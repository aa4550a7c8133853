"""A model's state as the strategies share it: :class:`ModelState` enumerates it once (trainable
parameters, a tied one once; frozen parameters; persistent buffers, floating and other; a
module's non-persistent buffers stay local), :class:`SharedBuffers` is the global copy of the
floating buffers the round-based strategies average, and the helpers keep fp32 global state for
half-precision models."""

from __future__ import annotations

import io
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from isthmus.comm.layout import Placement
from isthmus.reduce.compress.compressor import all_finite
from isthmus.strategies.sharded import local_view

__all__ = [
    "ModelState",
    "SharedBuffers",
    "as_started",
    "blob",
    "global_copy",
    "load_tensors",
    "outer_dtype",
    "unblob",
]

log = logging.getLogger("isthmus.strategy")
Named = list[tuple[str, torch.Tensor]]


def outer_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype of a tensor's global copy: fp32 for fp16/bf16 tensors (so that the outer
    optimizer and the averages keep the precision half-precision steps lose), else its own."""
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


def global_copy(
    t: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    pin: bool = False,
) -> torch.Tensor:
    """A fresh contiguous copy of ``t`` in ``dtype`` (default :func:`outer_dtype`: the same
    bits for fp32) on ``device`` (default ``t``'s); in pinned host memory with ``pin`` (which
    needs CUDA: asked for only where the model is on a CUDA device)."""
    dtype = dtype or outer_dtype(t)
    if device is None and not pin:
        out = torch.empty_like(t, dtype=dtype, memory_format=torch.contiguous_format)
    else:
        out = torch.empty(t.shape, dtype=dtype, device=device or t.device, pin_memory=pin)
    return out.copy_(t.detach())


def as_started(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The global value ``g`` as the local tensor ``p`` received it (cast to ``p``'s dtype), in
    ``g``'s dtype. Outer gradients are measured from it: with a bf16 model, ``g - p`` would also
    carry the rounding of the cast, and every round would pull the fp32 state onto the bf16 grid.
    For tensors of one dtype it is ``g`` itself."""
    return g if g.dtype == p.dtype else g.to(p.dtype).to(g.dtype)


@dataclass(frozen=True)
class ModelState:
    """What a model's ``state_dict`` holds, enumerated once for every strategy.

    ``trainable`` and ``frozen`` are ``named_parameters()`` split by ``requires_grad`` (a tied or
    shared parameter appears once, under its first name); ``float_buffers`` and ``other_buffers``
    are the *persistent* buffers (a module lists the others in ``_non_persistent_buffers_set``;
    they are not in the ``state_dict`` and stay local), floating point or not. ``keys`` maps every
    ``state_dict`` key, tied duplicates included, to the first name of the tensor behind it.
    """

    trainable: Named
    frozen: Named
    float_buffers: Named
    other_buffers: Named
    keys: dict[str, str]
    placements: dict[str, Placement] = field(default_factory=dict)
    """For a model sharded inside an island (DTensor parameters): each sharded tensor's
    placement in the full tensor; the lists above then hold the local shards (views of the
    parameters' storage, :func:`~isthmus.strategies.sharded.local_view`)."""
    sources: dict[str, torch.Tensor] = field(default_factory=dict)
    """The DTensor parameters behind those local views, by name (their gradients are
    DTensors too)."""

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelState:
        """Enumerate ``model``. A ``state_dict`` entry that is none of the model's parameters or
        persistent buffers (a module's extra state, a custom ``_save_to_state_dict``) is not
        shared: it is left out of :attr:`keys` with a warning naming it."""
        first: dict[int, str] = {}
        trainable: Named = []
        frozen: Named = []
        placements: dict[str, Placement] = {}
        sources: dict[str, torch.Tensor] = {}
        for n, p in model.named_parameters():
            local, place = local_view(p)
            if local is not p:
                sources[n] = p
            if place is not None:
                placements[n] = place
            (trainable if p.requires_grad else frozen).append((n, local))
            first[id(p)] = n
        floats: Named = []
        others: Named = []
        # every module, repeats included: a buffer shared by two modules may be persistent in one
        for prefix, module in model.named_modules(remove_duplicate=False):
            for bname, b in module._buffers.items():
                if b is None or bname in module._non_persistent_buffers_set or id(b) in first:
                    continue
                full = f"{prefix}.{bname}" if prefix else bname
                first[id(b)] = full
                local, place = local_view(b)
                if place is not None:
                    placements[full] = place
                (floats if b.is_floating_point() else others).append((full, local))
        keys: dict[str, str] = {}
        unknown: list[str] = []
        for key, v in model.state_dict(keep_vars=True).items():
            if isinstance(v, torch.Tensor) and id(v) in first:
                keys[key] = first[id(v)]
            else:
                unknown.append(key)
        if unknown:
            log.warning(
                "state_dict entries that are not parameters or buffers are not shared: %s",
                ", ".join(unknown),
            )
        return cls(trainable, frozen, floats, others, keys, placements, sources)

    def state_dict_keys(self) -> dict[str, str]:
        """Every ``state_dict`` key -> the first name of its tensor (a copy)."""
        return dict(self.keys)


class SharedBuffers:
    """The global copy of a model's floating persistent buffers (BatchNorm's running statistics),
    averaged over a round's contributors through the reducer's ``exact`` values.

    The copy (``global/<name>``, fp32 for half-precision buffers) changes only when a round
    commits, so it can be hashed and repaired like any shared tensor while the model's own
    buffers move with every forward pass. A round carries a *snapshot* of the model's buffers
    (:meth:`snapshot`, :meth:`flat`); once it committed, :meth:`land` writes the mean into the
    copy and :meth:`restart` or :meth:`rebase` brings it into the model.

    The exact values are an fp32 sum with no compression and no robust rule: a byzantine peer can
    move the buffers' average, and fp64 buffers are averaged in fp32.
    """

    def __init__(self, named: Named, device: torch.device | str | None = None) -> None:
        """``device``: where the global copy and the snapshots live (default: beside each
        buffer; ``"cpu"`` for an outer state kept on the host)."""
        self.names = [n for n, _ in named]
        self.local = [b for _, b in named]
        self.device = None if device is None else torch.device(device)
        self.globals = [global_copy(b, device=self.device) for b in self.local]
        self.numel = sum(b.numel() for b in self.local)

    def __bool__(self) -> bool:
        return bool(self.local)

    def snapshot(self) -> list[torch.Tensor]:
        """Fresh copies of the model's buffers, in the global copy's dtypes."""
        return [global_copy(b, device=self.device) for b in self.local]

    def shared(self) -> list[torch.Tensor]:
        """Fresh copies of the global copy."""
        return [g.clone() for g in self.globals]

    def flat(self, snap: Sequence[torch.Tensor]) -> torch.Tensor:
        """A snapshot as one fp32 vector (what the exact values carry)."""
        if not snap:
            return torch.zeros(0)
        return torch.cat([s.reshape(-1).to(torch.float32) for s in snap])

    def finite(self, snap: Sequence[torch.Tensor]) -> bool:
        """True if the snapshot holds no NaN/Inf. A peer whose buffers are not finite must not
        contribute: its values would reach every peer's average unchecked."""
        ok = all(all_finite(s) for s in snap)
        if not ok:
            log.warning("non-finite values in this peer's buffers: contributing nothing")
        return ok

    def land(self, mean: torch.Tensor) -> None:
        """A committed round's mean (fp32, as :meth:`flat` lays it out) becomes the copy."""
        off = 0
        with torch.no_grad():
            for g in self.globals:
                g.copy_(mean[off : off + g.numel()].view(g.shape))
                off += g.numel()

    def restart(self) -> None:
        """The model's buffers <- the global copy (cast to their dtype)."""
        with torch.no_grad():
            for b, g in zip(self.local, self.globals, strict=True):
                b.copy_(g)

    def rebase(self, ref: Sequence[torch.Tensor]) -> None:
        """Keep what the model's buffers gathered since ``ref`` (the snapshot they continued
        from), on top of the global copy: ``b <- b + (global - ref)``. The two ends are exact: a
        buffer the round did not move (one peer's own mean) is left as it is, and one that did not
        change since ``ref`` becomes the copy. Used where forward passes run while a round is in
        flight (Streaming DiLoCo's overlap, eager DiLoCo, CO2)."""
        with torch.no_grad():
            for b, g, r in zip(self.local, self.globals, ref, strict=True):
                if torch.equal(g, r):
                    continue
                # (.to is a no-op where the buffer and the copy share a device)
                if torch.equal(b.to(r.device, r.dtype), r):
                    b.copy_(g)
                else:
                    b.add_((g - r).to(b.device))


def blob(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unblob(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def load_tensors(what: str, dest: Mapping[str, torch.Tensor], saved: Mapping[str, Any]) -> None:
    """Copy ``saved[name]`` into every ``dest[name]`` (a part of a loaded local state). Raises
    ValueError naming a missing or misshapen tensor before anything is copied."""
    for n, t in dest.items():
        s = saved.get(n)
        if not isinstance(s, torch.Tensor) or s.shape != t.shape:
            raise ValueError(
                f"local state {what}/{n}: expected a {list(t.shape)} tensor, got {s!r:.80}"
            )
    with torch.no_grad():
        for n, t in dest.items():
            t.copy_(saved[n])
