"""Where the DiLoCo family keeps its outer state: on the host, or beside the model.

The outer state (the global parameters theta, the snapshot a phase started from, the outer
momentum, the global copy of the floating buffers) is read and written once per round, every
``sync_every`` inner steps. ``outer_state_device="cpu"`` keeps it in host memory:

* an island's devices then hold only the model's shards and the inner optimizer; theta and the
  momentum (fp32: 8 bytes per parameter, four times a bf16 model) live in the host's memory;
* the outer gradient ``theta - local`` is taken on the host, from a host copy of the local
  parameters made by :class:`~isthmus.comm.host_copy.HostStage` (pinned buffers, copies on a
  side stream, see there), and reduced across islands over Gloo from host memory, the
  transport the islands use by default;
* the outer step runs on the host, and its result is copied into the model's shards
  (:func:`~isthmus.comm.host_copy.upload`: from pinned theta, ``non_blocking``; the next host
  write of theta waits for those copies, :meth:`OuterHome.settle`).

On a CPU model the two places are one: ``cpu`` then runs the same staging logic with plain
copies, and the bits are those of ``same`` (a copy, a subtraction and an SGD step of fp32
values, each exact or rounded alike on the one device). On CUDA, ``cpu`` computes the same math
as ``same``; the outer step's last bit may differ where the two devices fuse a multiply-add
differently. ``same`` keeps everything on the model's device: what islands that share a fabric
reducing across islands over NCCL need (NCCL carries device tensors only).

``auto`` (the default) is ``cpu`` unless the session is set to reduce over NCCL
(``backend="nccl"``), where it is ``same``: host memory wherever the transport across islands
is Gloo, which it is by default (``backend="auto"`` picks Gloo as soon as a floating tensor of
the shared state is on the host). The reasons for the host: the outer state is touched once per
round, the shards' copy to the host is paid for Gloo in any case, and the copy back costs one
transfer of the shards per round against 8 to 12 bytes a parameter held on every device for
the whole run.

A model spread over several devices keeps ``same`` per tensor (each global copy beside its
parameter); with ``cpu`` all of it is on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch

from isthmus.comm.host_copy import HostStage, StagedCopy, cuda_usable, upload
from isthmus.strategies.model_state import global_copy

__all__ = ["OUTER_DEVICES", "OuterDevice", "OuterHome", "check_outer_device"]

OuterDevice = Literal["auto", "cpu", "same"]
OUTER_DEVICES: tuple[str, ...] = ("auto", "cpu", "same")


def check_outer_device(value: Any) -> None:
    """Raise ValueError naming the choices unless ``value`` is one of :data:`OUTER_DEVICES`."""
    if value not in OUTER_DEVICES:
        raise ValueError(
            f"outer_state_device must be 'auto' (cpu, or same with backend='nccl'), 'cpu' (the "
            f"outer state in host memory) or 'same' (beside the model, on its device), "
            f"got {value!r}"
        )


def resolve_outer_device(where: str, backend: str) -> str:
    """``cpu`` or ``same`` for the option ``where`` and the session's ``backend`` (``auto``:
    ``same`` with NCCL, which carries device tensors only; else ``cpu``)."""
    check_outer_device(where)
    if where != "auto":
        return where
    return "same" if backend == "nccl" else "cpu"


class LocalView:
    """The local parameters as the outer rule reads them: their host copies in flight
    (:class:`~isthmus.comm.host_copy.StagedCopy`), or the parameters themselves."""

    def __init__(self, params: Sequence[torch.Tensor], staged: StagedCopy | None) -> None:
        self._params = params
        self._staged = staged

    def __getitem__(self, i: int) -> torch.Tensor:
        if self._staged is None:
            return self._params[i].detach()
        return self._staged.get(i)


class OuterHome:
    """The outer state's device for one strategy, and the copies between it and the model."""

    def __init__(self, where: str, params: Sequence[torch.Tensor]) -> None:
        """``where``: ``cpu`` or ``same`` (``auto`` is resolved by :meth:`of`; here it is
        ``cpu``)."""
        where = resolve_outer_device(where, "auto")
        self.where = where
        self.host = where == "cpu"
        # pinned theta needs CUDA: only for a model that is on a CUDA device
        self.pin = self.host and any(cuda_usable(p) for p in params)
        self.stage = HostStage() if self.host else None
        self._uploads: list[Any] = []  # events of copies still reading host theta

    @classmethod
    def of(cls, strategy: Any, where: str) -> OuterHome:
        """The home of ``strategy``'s outer state (its ``params``, its ``session``; ``where``
        resolved against the session's backend). Raises ValueError for host state chosen
        explicitly on a CUDA model whose session is set to reduce over NCCL, which carries
        device tensors only."""
        session = getattr(strategy, "session", None)
        backend = getattr(getattr(session, "config", None), "backend", "auto")
        home = cls(resolve_outer_device(where, backend), strategy.params)
        if home.pin and backend == "nccl":
            raise ValueError(
                f"{strategy.name}: outer_state_device='cpu' reduces host tensors across "
                "islands, and NCCL carries device tensors only: use backend 'gloo' (or 'auto'), "
                "or outer_state_device='same' to keep the outer state on the GPU and reduce it "
                "over NCCL"
            )
        return home

    @property
    def buffers_device(self) -> torch.device | None:
        """Where the floating buffers' global copy lives (None: beside each buffer)."""
        return torch.device("cpu") if self.host else None

    def device_of(self, t: torch.Tensor) -> torch.device:
        """Where the outer copy of ``t`` lives."""
        return torch.device("cpu") if self.host else t.device

    def copy(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A fresh contiguous copy of ``t`` on the outer state's device, in ``dtype`` (``t``'s
        own by default); pinned when the model is on CUDA and the state on the host."""
        return global_copy(t, dtype=dtype, device=self.device_of(t), pin=self.pin)

    def fetch(self, params: Sequence[torch.Tensor], slot: str = "local") -> LocalView:
        """The local parameters where the outer state is: host copies started now (each
        waited for when read), or the parameters themselves with ``same``. Host copies are
        overwritten by the next fetch of ``slot``."""
        if self.stage is None:
            return LocalView(params, None)
        return LocalView(params, self.stage.stage(params, slot=slot))

    def settle(self) -> None:
        """Wait for the copies into the model still reading host theta (call before writing
        theta on the host: an outer step, a repair that lands in it)."""
        for ev in self._uploads:
            ev.synchronize()
        self._uploads.clear()

    def load(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst <- src`` (the model's tensor from the outer state, cast to its dtype)."""
        if self.stage is None or dst.device == src.device:
            with torch.no_grad():
                dst.copy_(src)
            return
        ev = upload(dst, src)
        if ev is not None:
            self._uploads.append(ev)

    def on_model(self, src: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``src`` (outer state) as an operand of arithmetic on ``like`` (a model tensor): itself
        where they share a device, else a copy on ``like``'s device."""
        # blocking: the host value may be written again by the next outer step
        return src if src.device == like.device else src.to(like.device)
