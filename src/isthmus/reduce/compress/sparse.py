"""Top-k and random-k sparsification, with error feedback (EF14, EF21, EControl).

Compressors (``k = ceil(ratio * d)``, at least 1):

* top-k keeps the ``k`` entries of largest magnitude. It is contractive:
  ``||x - C(x)||^2 <= (1 - k/d) ||x||^2``.
* random-k keeps ``k`` entries chosen by a seed that every peer derives from
  ``(seed, key, round counter)``, so all peers pick the same indices and no index is sent. Used
  without feedback it is scaled by ``d/k`` and is unbiased, ``E[C(x)] = x``; with any feedback it
  is the unscaled, contractive form (the analyses of EF, EF21 and EControl assume a contractive
  compressor, and scaling by ``d/k`` would make the residual grow instead of shrink).

Error feedback, per peer ``i`` and tensor (``g_i`` is the tensor handed to ``reduce_sum``):

* ``ef`` (EF14; Seide et al., "1-Bit Stochastic Gradient Descent...", Interspeech 2014; analysed
  by Stich, Cordonnier, Jaggi, "Sparsified SGD with Memory", NeurIPS 2018):
  ``p = g_i + e_i; c_i = C(p); e_i <- p - c_i``; result ``sum_i c_i``.
* ``ef21`` (Richtárik, Sokolov, Fatkhullin, "EF21: A New, Simpler, Theoretically Better, and
  Practically Faster Error Feedback", NeurIPS 2021): ``c_i = C(g_i - v_i); v_i <- v_i + c_i``;
  result ``V <- V + sum_i c_i`` where ``V = sum_i v_i`` is kept as shared state.
  ``v_i`` starts at 0 (the paper starts at ``C(g_i^0)``; ours reaches that after one round).
* ``econtrol`` (Gao, Islamov, Stich, "EControl: Fast Distributed Optimization with Compression
  and Error Control", ICLR 2024): ``delta_i = C(eta e_i + g_i - h_i); e_i <- e_i + g_i - h_i -
  delta_i; h_i <- h_i + delta_i``; result ``H <- H + sum_i delta_i`` (shared, ``H = sum_i h_i``),
  i.e. ``sum h_old + sum delta``. This update rule is NOT checked against the paper's
  pseudocode; ``eta = 0`` reduces it to EF21, which the tests check. By default ``eta`` equals
  the ratio ``k/d`` (the contraction constant of top-k), an order of magnitude that converges on
  the test quadratic, where ``eta`` above about twice the ratio diverges.

EF21 and EControl return a running aggregate of every peer's estimate, so after a membership
change the aggregate still holds the estimates of peers that left: every peer of the new epoch
calls :meth:`~isthmus.reduce.compress.compressor.Compressor.membership_changed` before its first
reduce, which restarts estimates and aggregate from zero (EF14 has no shared aggregate and keeps
its residuals).

Reduction rule: random-k all-reduces the ``k`` selected values (indices are shared), which is
``2 (w-1)/w * 4k`` bytes per peer. Top-k indices differ per peer, so each peer either
all-gathers its ``k`` (int32 index, fp32 value) pairs, ``(w-1) * 8k`` bytes, or all-reduces its
densified fp32 contribution, ``2 (w-1)/w * 4d`` bytes: it gathers when that sends fewer bytes
(``k * w < d`` up to rounding), otherwise it densifies. Every peer evaluates the same rule on the
same numbers. Gathered pairs are summed in rank order, so the result has identical bits
everywhere and equals the dense single-process sum in rank order bit for bit. Several tensors
share the collectives: every summed vector (random-k values, densified top-k) travels in one
fp32 all-reduce and every gathered pair list in one all-gather, so a round costs at most two
collectives whatever the number of tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from isthmus.comm.group import Group, wire_bytes

from .compressor import Compressor, derive_seed, numel_of

__all__ = [
    "FEEDBACKS",
    "EControlConfig",
    "RandKConfig",
    "SparseCompressor",
    "SparseConfig",
    "TopKConfig",
    "densify",
    "econtrol_update",
    "ef14_update",
    "ef21_update",
    "k_for",
    "randk_indices",
    "sparse_reduce_mode",
    "topk_select",
]

FEEDBACKS = ("none", "ef", "ef21", "econtrol")

_INDEX_BYTES = 4
_VALUE_BYTES = 4


def k_for(ratio: float, d: int) -> int:
    """Number of entries kept from ``d``: ``ceil(ratio * d)``, at least 1 (0 for an empty tensor)."""
    if d == 0:
        return 0
    return max(1, min(d, math.ceil(ratio * d)))


def topk_select(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, values) of the ``k`` entries of the flat ``x`` with the largest magnitude."""
    flat = x.reshape(-1)
    _, idx = torch.topk(flat.abs(), k, sorted=False)
    return idx, flat[idx]


_RANDPERM_MAX = 1 << 22


def randk_indices(d: int, k: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``k`` distinct indices of ``range(d)``, uniform over k-subsets and a function of ``seed``
    only (identical on every peer: drawn on CPU with torch's Mersenne Twister, then moved).

    Small tensors use a permutation of ``range(d)``. For large ``d`` with ``k <= d/4`` that would
    cost O(d) memory every round, so indices are drawn with replacement until ``k`` distinct
    ones exist and ``k`` of those are kept at random; the law of the result is invariant under
    relabelling of ``range(d)``, hence uniform over k-subsets."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    if d <= _RANDPERM_MAX or 4 * k > d:
        return torch.randperm(d, generator=g)[:k].to(device)
    chosen = torch.empty(0, dtype=torch.int64)
    while chosen.numel() < k:
        draw = torch.randint(0, d, (k + k // 4 + 64,), generator=g)
        chosen = torch.unique(torch.cat((chosen, draw)))
    keep = torch.randperm(chosen.numel(), generator=g)[:k]
    return chosen[keep].to(device)


def densify(idx: torch.Tensor, vals: torch.Tensor, d: int) -> torch.Tensor:
    """The dense vector of length ``d`` holding ``vals`` at ``idx`` (indices distinct) and 0
    elsewhere."""
    out = torch.zeros(d, dtype=vals.dtype, device=vals.device)
    out[idx] = vals
    return out


def ef14_update(
    g: torch.Tensor, e: torch.Tensor, compress: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """EF14: returns ``(c, e_new)`` with ``p = g + e``, ``c = C(p)``, ``e_new = p - c``."""
    p = g + e
    c = compress(p)
    return c, p - c


def ef21_update(
    g: torch.Tensor, v: torch.Tensor, compress: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """EF21: returns ``(c, v_new)`` with ``c = C(g - v)``, ``v_new = v + c``."""
    c = compress(g - v)
    return c, v + c


def econtrol_update(
    g: torch.Tensor,
    e: torch.Tensor,
    h: torch.Tensor,
    eta: float,
    compress: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EControl (rule unconfirmed, see module docstring): returns ``(delta, e_new, h_new)``."""
    delta = compress(eta * e + g - h)
    return delta, e + g - h - delta, h + delta


def sparse_reduce_mode(d: int, k: int, world: int) -> str:
    """``"gather"`` if all-gathering ``k`` (index, value) pairs sends fewer bytes per peer than a
    dense fp32 all-reduce of ``d`` values, else ``"dense"``."""
    gather = wire_bytes("all_gather", k * (_INDEX_BYTES + _VALUE_BYTES), world)
    dense = wire_bytes("all_reduce", d * _VALUE_BYTES, world)
    return "gather" if gather < dense else "dense"


@dataclass(frozen=True, kw_only=True)
class TopKConfig:
    """Options of the ``topk`` spec (``topk:0.01`` or ``topk:ratio=0.01``); the range of the
    ratio is checked by :class:`SparseConfig` when the compressor is built."""

    #: fraction of entries kept, in (0, 1], e.g. 0.01 for 1%; required
    ratio: float | None = None

    def __post_init__(self) -> None:
        if self.ratio is None:
            raise ValueError("the sparsifier needs a ratio, e.g. 0.01 to keep 1% ('topk:0.01')")


@dataclass(frozen=True, kw_only=True)
class RandKConfig(TopKConfig):
    """Options of the ``randk`` spec: :class:`TopKConfig`'s and the shared seed."""

    #: random-k's shared seed; all peers must use the same
    seed: int = 0


@dataclass(frozen=True, kw_only=True)
class EControlConfig:
    """Options of the ``+econtrol`` feedback spec."""

    #: EControl's feedback strength in [0, 1]; None means the sparsifier's ratio
    eta: float | None = None


@dataclass(frozen=True, kw_only=True)
class SparseConfig:
    """Settings of :class:`SparseCompressor`."""

    #: "topk" or "randk"
    kind: str
    #: fraction of entries kept, in (0, 1], e.g. 0.01 for 1%
    ratio: float
    #: one of :data:`FEEDBACKS`
    feedback: str = "none"
    #: EControl's feedback strength in [0, 1]; None means ``ratio`` (ignored by other feedbacks)
    eta: float | None = None
    #: random-k's shared seed; all peers must use the same
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("topk", "randk"):
            raise ValueError(f"sparsifier kind must be 'topk' or 'randk', got {self.kind!r}")
        if not (isinstance(self.ratio, (int, float)) and 0.0 < self.ratio <= 1.0):
            raise ValueError(
                f"{self.kind}: ratio must be in (0, 1], e.g. 0.01 for 1%; got {self.ratio!r}"
            )
        if self.feedback not in FEEDBACKS:
            raise ValueError(
                f"unknown feedback {self.feedback!r}; use one of {', '.join(FEEDBACKS)}"
            )
        if self.eta is not None and not 0.0 <= self.eta <= 1.0:
            raise ValueError(f"econtrol eta must be in [0, 1], got {self.eta!r}")


class SparseCompressor(Compressor):
    """Top-k or random-k with optional error feedback (module docstring has the math).

    State per key: ``round`` (shared, random-k's counter), ``e`` (local, EF14 and EControl),
    ``v``/``h`` (local, EF21/EControl estimate) and ``agg`` (shared, their running sum).
    """

    def __init__(self, config: SparseConfig) -> None:
        super().__init__()
        self.config = config
        self.kind = config.kind
        self.ratio = float(config.ratio)
        self.feedback = config.feedback
        self.eta = float(config.ratio if config.eta is None else config.eta)
        self.seed = int(config.seed)
        name = f"{self.kind}:{self.ratio:g}"
        if self.kind == "randk" and self.seed:
            name += f",seed={self.seed}"
        if self.feedback != "none":
            name += f"+{self.feedback}"
            if self.feedback == "econtrol" and config.eta is not None:
                name += f":eta={self.eta:g}"
        self.name = name

    def membership_changed(self) -> None:
        """EF21/EControl: forget every estimate and the shared aggregate (see module docstring),
        so that peers that left stop counting. Other feedbacks keep their state."""
        if self.feedback in ("ef21", "econtrol"):
            self.reset()

    @property
    def unbiased(self) -> bool:
        """Random-k without feedback is rescaled by d/k to be unbiased."""
        return self.kind == "randk" and self.feedback == "none"

    def predict_bytes(self, shape: int | Sequence[int], world: int) -> int:
        d = numel_of(shape)
        k = k_for(self.ratio, d)
        if d == 0:
            return 0
        if self.kind == "randk":
            return wire_bytes("all_reduce", k * _VALUE_BYTES, world)
        if sparse_reduce_mode(d, k, world) == "gather":
            return wire_bytes("all_gather", k * (_INDEX_BYTES + _VALUE_BYTES), world)
        return wire_bytes("all_reduce", d * _VALUE_BYTES, world)

    def predict_bytes_many(self, shapes: Sequence[int | Sequence[int]], world: int) -> int:
        """Bytes one peer sends for one :meth:`reduce_sum_many` over tensors of these shapes (all
        summed values share one all-reduce, all gathered pairs one all-gather)."""
        dense, pairs = 0, 0
        for shape in shapes:
            d = numel_of(shape)
            if d == 0:
                continue
            k = k_for(self.ratio, d)
            if self.kind == "randk":
                dense += k
            elif sparse_reduce_mode(d, k, world) == "gather":
                pairs += k
            else:
                dense += d
        out = 0
        if dense:
            out += wire_bytes("all_reduce", dense * _VALUE_BYTES, world)
        if pairs:
            out += wire_bytes("all_gather", pairs * (_INDEX_BYTES + _VALUE_BYTES), world)
        return out

    # -- reduction --------------------------------------------------------------------------------
    def _reduce_many(
        self, group: Group, items: list[tuple[str, torch.Tensor]], contribute: bool
    ) -> list[torch.Tensor]:
        # Phase 1, per key: select what to send and stage the local state. Phase 2: one fp32
        # all-reduce carries every summed vector (random-k values, densified top-k) and one
        # all-gather every top-k (index, value) list. Phase 3, per key: unpack and finish.
        world = group.world
        picks = [self._select(key, x.reshape(-1), contribute, world) for key, x in items]
        dense_parts: list[torch.Tensor] = []
        pair_parts: list[torch.Tensor] = []
        for pk in picks:
            if pk is None:
                continue
            _, idx, vals, d, k, mode = pk
            if mode == "values":
                dense_parts.append(vals.to(torch.float32))
            elif mode == "dense":
                dense_parts.append(densify(idx, vals.to(torch.float32), d))
            else:
                pair_parts.append(idx.to(torch.int32))
                pair_parts.append(vals.to(torch.float32).view(torch.int32))
        summed = torch.cat(dense_parts) if dense_parts else None
        if summed is not None:
            group.all_reduce(summed, "sum")
        gathered = None
        if pair_parts:
            flat_pairs = torch.cat(pair_parts)
            gathered = group.all_gather_flat(flat_pairs).reshape(world, flat_pairs.numel())

        outs = []
        doff = poff = 0
        for (key, x), pk in zip(items, picks, strict=True):
            if pk is None:
                outs.append(x.reshape(-1).clone())
                continue
            _, idx, _, d, k, mode = pk
            total = torch.zeros(d, dtype=torch.float32, device=x.device)
            if mode == "values":
                assert summed is not None
                total[idx] = summed[doff : doff + k]
                doff += k
            elif mode == "dense":
                assert summed is not None
                total = summed[doff : doff + d].clone()
                doff += d
            else:
                assert gathered is not None
                for r in range(world):  # rank order: same bits on every peer
                    ri = gathered[r, poff : poff + k].to(torch.int64)
                    rv = gathered[r, poff + k : poff + 2 * k].view(torch.float32)
                    total.index_add_(0, ri, rv)
                poff += 2 * k
            if self.unbiased:
                total = total * (d / k)
            if self.feedback in ("ef21", "econtrol"):
                agg = self._shared.get(key, "agg", torch.zeros_like(total)) + total
                self._shared.put(key, "agg", agg)
                total = agg.clone()
            outs.append(total)
        return outs

    def _select(
        self, key: str, flat: torch.Tensor, contribute: bool, world: int
    ) -> tuple[str, torch.Tensor, torch.Tensor, int, int, str] | None:
        """(key, indices, values, d, k, how they travel) for one tensor, staging its state;
        None for an empty tensor. ``how``: "values" (random-k: only the values, all-reduced),
        "dense" (densified and all-reduced) or "gather" (all-gathered pairs)."""
        d = flat.numel()
        if d == 0:
            return None
        if d >= 2**31:
            raise ValueError(f"tensor {key!r} has {d} values; int32 indices need fewer than 2^31")
        k = k_for(self.ratio, d)
        rnd = int(self._shared.get(key, "round", 0))
        self._shared.put(key, "round", rnd + 1)
        shared_idx = None
        if self.kind == "randk":
            shared_idx = randk_indices(d, k, derive_seed(self.seed, key, rnd), flat.device)
            mode = "values"
        else:
            mode = sparse_reduce_mode(d, k, world)

        def select(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if shared_idx is not None:
                return shared_idx, v[shared_idx]
            return topk_select(v, k)

        picked: list[tuple[torch.Tensor, torch.Tensor]] = []

        def compress(v: torch.Tensor) -> torch.Tensor:
            i, val = select(v)
            picked.append((i, val))  # what goes on the wire
            return densify(i, val, d)

        zeros = torch.zeros_like(flat)
        fb = self.feedback
        if not contribute:
            # send zeros of the right size; local state stays as it is
            if shared_idx is not None:
                idx, vals = shared_idx, zeros[:k]
            else:
                idx, vals = torch.arange(k, device=flat.device), zeros[:k]
        elif fb == "none":
            idx, vals = select(flat)
        elif fb == "ef":
            e = self._local.get(key, "e", zeros)
            _, e_new = ef14_update(flat, e, compress)
            self._local.put(key, "e", e_new)
            idx, vals = picked[-1]
        elif fb == "ef21":
            v = self._local.get(key, "v", zeros)
            _, v_new = ef21_update(flat, v, compress)
            self._local.put(key, "v", v_new)
            idx, vals = picked[-1]
        else:  # econtrol
            e = self._local.get(key, "e", zeros)
            h = self._local.get(key, "h", zeros)
            _, e_new, h_new = econtrol_update(flat, e, h, self.eta, compress)
            self._local.put(key, "e", e_new)
            self._local.put(key, "h", h_new)
            idx, vals = picked[-1]
        return key, idx, vals, d, k, mode
