"""Shared state: the named tensors that must be bit-identical on every in-sync peer.

A strategy registers its global tensors here (parameters, optimizer state, counters). The session
hashes them for parity checks (xxh3-64 over the raw bytes: fast, non-cryptographic; it detects
corruption and divergence, it does not defend against a peer forging a collision) and overwrites
them in place when the coordinator orders a resync. Registration order is the schema order, and
every peer of a run must register the same names, shapes and dtypes in the same order.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch
import xxhash

from isthmus.coordinator.protocol import TensorSpec

__all__ = ["CatchUp", "SharedState", "tensor_bytes", "tensor_hash"]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of ``t`` (copied to host memory if it lives on an accelerator)."""
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return memoryview(flat.view(torch.uint8).numpy())


def tensor_hash(t: torch.Tensor) -> str:
    """Hex xxh3-64 of a tensor's bytes. Equal bytes give equal hashes on every machine."""
    return xxhash.xxh3_64_hexdigest(tensor_bytes(t))


class CatchUp(Protocol):
    """A strategy's way to bring a stale peer up to date by replaying the rounds it missed
    instead of receiving its tensors (:mod:`isthmus.comm.transfer` runs the exchange and verifies
    the result by hash either way). The zeroth-order strategy provides one: its rounds are a few
    bytes each, far less than the state they change."""

    def revision(self) -> int:
        """The revision this peer's shared state is at (where a replay would start)."""
        ...

    def wish(self) -> int:
        """How this peer wants to be caught up: 0 state transfer, 1 replay, 2 decide by cost."""
        ...

    def covers(self) -> frozenset[str]:
        """The shared tensors a replay reproduces; the others are sent as they are."""
        ...

    def offer(self, since: int, upto: int, transfer_bytes: int, wish: int) -> bytes | None:
        """Source side: the log of rounds ``since`` to ``upto - 1`` if this peer holds it and a
        replay is chosen (``wish``, or the cost against ``transfer_bytes`` of tensors), else
        None (a state transfer)."""
        ...

    def replay(self, log: bytes, since: int, upto: int) -> dict[str, torch.Tensor]:
        """Destination side: new tensors for the covered names, this peer's state replayed
        through ``log``; the live state is not changed. Raises ValueError for a log that does
        not hold exactly rounds ``since`` to ``upto - 1``."""
        ...

    def adopt(self, log: bytes) -> None:
        """Destination side, once the replayed state matched the run's hashes and was taken:
        keep the log (this peer can then serve replays of those rounds)."""
        ...


class SharedState:
    """An ordered registry of named tensors, held by reference and mutated in place."""

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}
        self.catch_up: CatchUp | None = None
        """Set by a strategy that can replay missed rounds (see :class:`CatchUp`); None: stale
        peers always receive the tensors."""

    def register(self, name: str, tensor: torch.Tensor) -> None:
        """Add ``tensor`` under ``name``. The tensor must stay the same object for the whole run
        (strategies update it in place) and must be contiguous.

        Raises ValueError on a duplicate name or a non-contiguous tensor.
        """
        if not name or not isinstance(name, str):
            raise ValueError("a shared tensor needs a non-empty string name")
        if name in self._tensors:
            raise ValueError(f"shared tensor {name!r} is already registered")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"shared state {name!r} must be a torch.Tensor, got {type(tensor).__name__}"
            )
        if not tensor.is_contiguous():
            raise ValueError(
                f"shared tensor {name!r} must be contiguous (call .contiguous() first)"
            )
        self._tensors[name] = tensor

    def unregister_prefix(self, prefix: str) -> None:
        for n in [n for n in self._tensors if n.startswith(prefix)]:
            del self._tensors[n]

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._tensors.items())

    def schema(self) -> list[TensorSpec]:
        return [TensorSpec(n, tuple(t.shape), str(t.dtype)) for n, t in self._tensors.items()]

    def hashes(self) -> dict[str, str]:
        return {n: tensor_hash(t) for n, t in self._tensors.items()}

    def digest(self) -> str:
        """One hash of the whole state (names and bytes), handy for logs and tests."""
        h = xxhash.xxh3_64()
        for n, t in self._tensors.items():
            h.update(n.encode())
            h.update(tensor_bytes(t))
        return h.hexdigest()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Detached copies of every tensor (for saving or comparing)."""
        return {n: t.detach().clone() for n, t in self._tensors.items()}
