"""The compressor interface shared by every family, staged state, and the uncompressed reducer.

A :class:`Compressor` turns each peer's tensor into a (compressed) contribution and returns the
SUM of all contributions, with identical bits on every peer, so that the shared model state a
strategy derives from it stays bit-identical. Most compressors keep per-key state between rounds
(error feedback, PowerSGD's warm-start Q, random-k round counters). Because a round may abort
after its collectives ran, every state change made by :meth:`Compressor.reduce_sum` is *staged*:
:meth:`Compressor.commit` makes it permanent once the coordinator committed the round and
:meth:`Compressor.rollback` discards it, so an aborted and retried round sees exactly the state
it saw the first time.

State comes in two scopes:

* ``shared`` state is a function of reduced (identical) data only, so it is identical on every
  in-sync peer: round counters, PowerSGD's Q memory, the EF21/EControl running aggregate, the
  count-sketch error. A peer that joins must copy it from an in-sync peer (it is part of
  :meth:`Compressor.state_dict`).
* ``local`` state belongs to this peer alone: its error-feedback residual, its EF21 estimate.
  A joiner starts with none (zeros), which every algorithm here tolerates.

Non-finite inputs are rejected with :class:`NonFiniteError` before anything is sent, so a NaN on
one peer never reaches the others.
"""

from __future__ import annotations

import copy
import hashlib
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from isthmus.comm.group import Group, wire_bytes

__all__ = [
    "Compressor",
    "NoCompression",
    "NonFiniteError",
    "StagedState",
    "all_finite",
    "check_finite",
    "derive_seed",
    "numel_of",
]


class NonFiniteError(ValueError):
    """A tensor handed to a compressor (or the sum it produced) holds NaN or Inf.

    Raised before anything is sent when the input is at fault, so no other peer ever sees the
    bad values; the caller should skip this peer's contribution (``contribute=False``) or abort
    the round. When the *result* is non-finite (an overflow of the fp32 sum), every peer holds the
    same bits and therefore raises together; the round must be aborted and staged state rolled
    back.
    """


def all_finite(t: torch.Tensor) -> bool:
    """True if ``t`` holds no NaN and no Inf (an empty tensor is finite).

    Uses the tensor's max and min, which propagate NaN: two reductions without the full-size
    boolean temporary of ``torch.isfinite(t).all()``, several times faster on large tensors."""
    if t.numel() == 0:
        return True
    if not t.is_floating_point():
        return True
    return bool(torch.isfinite(t.amax()) & torch.isfinite(t.amin()))


def check_finite(key: str, t: torch.Tensor, what: str = "input") -> None:
    """Raise :class:`NonFiniteError` naming ``key`` if ``t`` holds NaN or Inf."""
    if not all_finite(t):
        bad = int((~torch.isfinite(t)).sum())
        raise NonFiniteError(
            f"{what} for tensor {key!r} has {bad} non-finite value(s) (NaN or Inf) out of "
            f"{t.numel()}; nothing was sent. Skip this peer's contribution (contribute=False) "
            f"or abort the round."
        )


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any printable parts, identical on every machine and Python process.

    Python's ``hash`` is salted per process, so it cannot be used for seeds that all peers must
    agree on; a cryptographic digest of the parts' text can.
    """
    text = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def numel_of(shape: int | Sequence[int]) -> int:
    """Number of elements of a shape given as an int (already a numel) or a sequence."""
    if isinstance(shape, int):
        return shape
    return math.prod(int(s) for s in shape)


class StagedState:
    """Named per-key values with a committed layer and a staged layer on top of it.

    Values are never mutated in place: :meth:`put` stores a new object, so the committed layer is
    untouched until :meth:`commit`, and :meth:`rollback` only has to drop the staged layer.
    """

    def __init__(self) -> None:
        self._committed: dict[str, dict[str, Any]] = {}
        self._staged: dict[str, dict[str, Any]] = {}

    def get(self, key: str, name: str, default: Any = None) -> Any:
        staged = self._staged.get(key)
        if staged is not None and name in staged:
            return staged[name]
        return self._committed.get(key, {}).get(name, default)

    def put(self, key: str, name: str, value: Any) -> None:
        self._staged.setdefault(key, {})[name] = value

    def commit(self) -> None:
        for key, values in self._staged.items():
            self._committed.setdefault(key, {}).update(values)
        self._staged = {}

    def rollback(self) -> None:
        self._staged = {}

    @property
    def pending(self) -> bool:
        return bool(self._staged)

    def clear(self, key: str | None = None) -> None:
        if key is None:
            self._committed = {}
            self._staged = {}
        else:
            self._committed.pop(key, None)
            self._staged.pop(key, None)

    def export(self) -> dict[str, dict[str, Any]]:
        """The committed layer (a copy; tensors are cloned so the caller may keep them)."""
        return {
            k: {
                n: (v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                for n, v in vals.items()
            }
            for k, vals in self._committed.items()
        }

    def load(self, data: dict[str, dict[str, Any]]) -> None:
        self._committed = {
            str(k): {
                str(n): (v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                for n, v in vals.items()
            }
            for k, vals in data.items()
        }
        self._staged = {}


class Compressor(ABC):
    """One instance per strategy; reduces tensors by key and keeps per-key state across rounds.

    Subclasses implement :meth:`_reduce_one`, or :meth:`_reduce_many` to batch several tensors
    into the same collectives (each defaults to the other; a class that defines neither is
    refused when it is defined), and :meth:`predict_bytes`. The public entry points check
    inputs, convert to the working dtype, and check results.

    Rules every implementation follows:

    * the result has identical bits on every peer of the group (all arithmetic after the last
      collective is a deterministic function of data every peer holds identically);
    * every peer issues the same collectives in the same order with the same sizes, whatever its
      ``contribute`` flag, so a non-contributing peer never desynchronizes the group;
    * state changes are staged (see the module docstring) and only the local state of a
      non-contributing peer is left untouched; shared state advances on every peer alike.
    """

    #: canonical spec string (what :func:`isthmus.reduce.compress.make_compressor` parses)
    name: str = "?"
    #: dtype the math runs in; ``None`` keeps the input's dtype (plain all-reduce only)
    work_dtype: torch.dtype | None = torch.float32

    def __init__(self) -> None:
        self._local = StagedState()
        self._shared = StagedState()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    # -- reduction ------------------------------------------------------------------------------
    def reduce_sum(
        self, group: Group, key: str, t: torch.Tensor, *, contribute: bool = True
    ) -> torch.Tensor:
        """Return the sum over peers of their compressed contributions for tensor ``key``.

        The result has ``t``'s shape and dtype and identical bits on every peer. A peer with
        ``contribute=False`` adds nothing (its ``t`` is only used for its shape and may hold
        anything, NaN included) and leaves its local state for ``key`` untouched.

        Raises :class:`NonFiniteError` (before any byte is sent) if a contributing ``t`` holds
        NaN/Inf, or (on every peer alike) if the sum overflowed; :class:`TypeError` if ``t`` is
        not floating point; :class:`isthmus.comm.group.CollectiveError` if a collective failed.
        After any error the round must be rolled back.
        """
        return self.reduce_sum_many(group, [(key, t)], contribute=contribute)[0]

    def reduce_sum_many(
        self,
        group: Group,
        items: Sequence[tuple[str, torch.Tensor]],
        *,
        contribute: bool = True,
    ) -> list[torch.Tensor]:
        """:meth:`reduce_sum` for several tensors at once, results in the order given.

        Every peer must pass the same keys with the same shapes in the same order. Compressors
        that can batch (PowerSGD puts all P factors in one all-reduce, like torch's DDP hook does
        for a bucket) issue fewer collectives this way; the others reduce one key after another.
        All inputs are checked before anything is sent.
        """
        keys = [k for k, _ in items]
        if len(set(keys)) != len(keys):
            raise ValueError(f"keys must be unique within one call, got {keys}")
        work: list[tuple[str, torch.Tensor]] = []
        for key, t in items:
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise TypeError(
                    f"tensor {key!r} must be a floating-point torch.Tensor, got "
                    f"{getattr(t, 'dtype', type(t))}"
                )
            x = t.detach()
            if self.work_dtype is not None:
                x = x.to(self.work_dtype)
            if contribute:
                check_finite(key, x)
            else:
                x = torch.zeros_like(x)
            work.append((key, x))
        outs = self._reduce_many(group, work, contribute)
        results = []
        for (key, t), out in zip(items, outs, strict=True):
            check_finite(key, out, what="reduced sum")
            results.append(out.reshape(t.shape).to(t.dtype))
        return results

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if (
            cls._reduce_one is Compressor._reduce_one
            and cls._reduce_many is Compressor._reduce_many
        ):
            raise TypeError(f"{cls.__name__} must define _reduce_one or _reduce_many")

    def _reduce_many(
        self, group: Group, items: list[tuple[str, torch.Tensor]], contribute: bool
    ) -> list[torch.Tensor]:
        """Reduce several tensors, in order (by default one :meth:`_reduce_one` each)."""
        return [self._reduce_one(group, key, x, contribute) for key, x in items]

    def _reduce_one(
        self, group: Group, key: str, x: torch.Tensor, contribute: bool
    ) -> torch.Tensor:
        """Reduce one finite tensor ``x`` (already in the working dtype; zeros when not
        contributing). Must not modify ``x``. Returns a tensor with ``x``'s numel. By default a
        batch of one for :meth:`_reduce_many`."""
        return self._reduce_many(group, [(key, x)], contribute)[0]

    @abstractmethod
    def predict_bytes(self, shape: int | Sequence[int], world: int) -> int:
        """Bytes one peer sends (as :class:`~isthmus.comm.group.Group` records them) for one
        :meth:`reduce_sum` of a tensor of ``shape`` (or that many elements) in a group of
        ``world`` peers. Useful for benchmark tables; it does not count anything itself."""

    def predict_bytes_many(self, shapes: Sequence[int | Sequence[int]], world: int) -> int:
        """Bytes one peer sends for one :meth:`reduce_sum_many` over tensors of these shapes (the
        strategies reduce a whole model this way). Compressors that batch tensors into shared
        collectives override it where batching changes the count (ring all-reduce rounding)."""
        return sum(self.predict_bytes(s, world) for s in shapes)

    # -- state ----------------------------------------------------------------------------------
    def commit(self) -> None:
        """Make the state changes staged by reduce calls since the last commit/rollback permanent."""
        self._local.commit()
        self._shared.commit()

    def rollback(self) -> None:
        """Discard staged state changes: the state is exactly what it was after the last commit."""
        self._local.rollback()
        self._shared.rollback()

    @property
    def pending(self) -> bool:
        """True while reduce calls have staged changes that are neither committed nor rolled back."""
        return self._local.pending or self._shared.pending

    def reset(self, key: str | None = None) -> None:
        """Forget all state (or that of one key), committed and staged. Strategies call this when a
        key's meaning changes (a new model) or, for aggregate-based schemes, after membership
        changes make the shared aggregate stale (see each compressor's notes)."""
        self._local.clear(key)
        self._shared.clear(key)

    def reset_shared(self) -> None:
        """Forget the shared state of every key (committed and staged), keep the local state.

        A joiner cannot receive compressor state (only registered tensors travel), so strategies
        call this on every member at the start of each epoch: all members then continue from the
        same empty shared state, the joiner included. Takes effect at once, not staged."""
        self._shared.clear()

    def membership_changed(self) -> None:
        """Called by the strategy on every peer of a new epoch (a peer joined, left or failed)
        before its first reduce there. Takes effect at once, not staged. The default keeps all
        state; compressors whose shared state sums per-peer state (EF21, EControl) reset."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """The committed state: ``{"name", "shared", "local"}`` (staged changes are not included).

        ``shared`` must be identical on all in-sync peers; a joiner loads it from one of them
        (with an empty ``local``)."""
        return {"name": self.name, "shared": self._shared.export(), "local": self._local.export()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace all state by ``state`` (from :meth:`state_dict`); staged changes are dropped.

        Raises ValueError if it was saved by a compressor with a different spec."""
        if state.get("name") != self.name:
            raise ValueError(
                f"state was saved by compressor {state.get('name')!r}, this is {self.name!r}; "
                f"build the compressor with the same spec or call reset() instead"
            )
        self._shared.load(state.get("shared", {}))
        self._local.load(state.get("local", {}))


class NoCompression(Compressor):
    """Plain sum all-reduce in the input's own dtype (spec ``none``).

    Gloo's ring all-reduce finishes every chunk on one rank and passes the finished chunk around
    the ring, so all ranks receive the same bits (checked by the tests). No state.
    """

    name = "none"
    work_dtype = None

    def _reduce_one(
        self, group: Group, key: str, x: torch.Tensor, contribute: bool
    ) -> torch.Tensor:
        buf = x.reshape(-1).clone()  # Group reduces in place; never touch the caller's tensor
        if buf.numel():
            group.all_reduce(buf, "sum")
        return buf

    def _reduce_many(
        self, group: Group, items: list[tuple[str, torch.Tensor]], contribute: bool
    ) -> list[torch.Tensor]:
        dtypes = {x.dtype for _, x in items}
        if len(dtypes) != 1:
            return super()._reduce_many(group, items, contribute)
        # one all-reduce for all tensors (a fresh buffer: the caller's tensors are never touched)
        buf = torch.cat([x.reshape(-1) for _, x in items])
        if buf.numel():
            group.all_reduce(buf, "sum")
        outs = []
        off = 0
        for _, x in items:
            outs.append(buf[off : off + x.numel()].clone())
            off += x.numel()
        return outs

    def predict_bytes(
        self, shape: int | Sequence[int], world: int, *, element_size: int = 4
    ) -> int:
        return wire_bytes("all_reduce", numel_of(shape) * element_size, world)

    def predict_bytes_many(
        self, shapes: Sequence[int | Sequence[int]], world: int, *, element_size: int = 4
    ) -> int:
        n = sum(numel_of(s) for s in shapes)
        return wire_bytes("all_reduce", n * element_size, world) if n else 0
