"""PowerSGD: rank-r compression by one step of power iteration, with warm start and error feedback.

Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", NeurIPS 2019 (arXiv 1905.13727). The reference implementation we match is torch's
DDP communication hook ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``; the tests
run that hook on the same inputs and check agreement over several steps.

For each tensor ``x`` (viewed as an ``n x m`` matrix, ``n = x.shape[0]``) with
``r = min(n, m, rank)``: compress only if ``(n + m) r * min_compression_rate < n m`` (torch's
rule; with the default rate 2 vectors and biases never qualify); everything else goes through a
plain sum all-reduce. For compressed tensors, on every peer:

1. ``M = x + error`` (error feedback), ``Q`` = the previous round's Q (warm start) or a fresh
   Gaussian draw, orthogonalized;
2. ``P = M Q``; all-reduce (sum) all P factors in one buffer; orthogonalize each P;
3. ``Q = M^T P``; all-reduce all Q factors; ``Q_mean = Q / c`` (``c`` = number of contributing
   peers, ``world`` normally);
4. ``approx = P Q_mean^T`` (the mean over peers, what torch's hook returns);
   ``error = M - approx``; the result is ``c * approx``, the sum. ``Q_mean`` is kept for the next
   warm start.

Orthogonalization is Gram-Schmidt for ``r <= 2`` and Householder QR (``torch.linalg.qr``) above,
as in torch. The uncompressed tensors travel in one buffer whose last slot counts contributing
peers, so ``c`` costs no extra collective.

Deliberate differences from torch's hook (all outside the tested, all-finite, all-contributing
case, where results agree to float tolerance):

* torch keeps an "error" for the uncompressed tensors too (``local - mean``, whose sum over peers
  is zero, so the reduced mean is unaffected); we keep error only for compressed tensors.
* where a column is exactly zero, torch's Gram-Schmidt (``epsilon = 0``) divides 0 by 0 and
  spreads NaN; ours leaves the column zero, and a warm-start Q with a zero column is redrawn
  instead of sticking at zero forever.
* a peer with ``contribute=False`` sends zero factors and the mean is over contributors.
* initial Q: with ``seed_scheme="torch"`` we reproduce torch's draws exactly
  (``numpy.random.RandomState(seed)`` gives one ``randint(1e9)`` per batch that needs fresh Qs,
  which seeds ``torch.randn`` for the Qs in shape-grouped order). Its RNG position depends on
  the history of calls, so the default ``seed_scheme="key"`` draws each key's Q from
  ``(seed, key, number of earlier draws for that key)`` instead, independent of batching and call
  order. Under the torch scheme a batch without compressible tensors draws no seed (torch's hook
  draws one when it first sees a bucket).

State per key: ``q`` and ``draws`` (shared: identical on all peers since Q is all-reduced),
``error`` (local). torch's scheme adds a shared ``rng`` entry under key ``"__rng__"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from isthmus.comm.group import Group, wire_bytes

from .compressor import Compressor, derive_seed, numel_of

__all__ = [
    "PowerSGD",
    "PowerSGDConfig",
    "matrix_shape",
    "orthogonalize_",
    "should_compress",
]

_RNG_KEY = "__rng__"


@dataclass(frozen=True, kw_only=True)
class PowerSGDConfig:
    """Settings of :class:`PowerSGD`."""

    #: rank r of the approximation P Q^T (torch: matrix_approximation_rank)
    rank: int = 1
    #: compress a matrix only if (n + m) r * min_compression_rate < n m
    min_compression_rate: float = 2.0
    #: reuse last round's Q (recommended; otherwise Q is redrawn every round)
    warm_start: bool = True
    #: keep the compression error and add it to the next round's input
    error_feedback: bool = True
    #: added to column norms in Gram-Schmidt (torch: orthogonalization_epsilon)
    orthogonalization_epsilon: float = 0.0
    #: seed for the initial Qs; all peers must use the same
    seed: int = 0
    #: "key" (per-key seeds, default) or "torch" (torch hook's RNG sequence; see module docs)
    seed_scheme: Literal["key", "torch"] = "key"

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"PowerSGD rank must be an int >= 1, got {self.rank!r}")
        if not self.min_compression_rate > 0:
            raise ValueError(
                f"min_compression_rate must be > 0 (2 is torch's default), got "
                f"{self.min_compression_rate!r}"
            )
        if self.orthogonalization_epsilon < 0:
            raise ValueError("orthogonalization_epsilon must be >= 0 (try 0 or 1e-8)")
        if self.seed_scheme not in ("key", "torch"):
            raise ValueError(f"seed_scheme must be 'key' or 'torch', got {self.seed_scheme!r}")


def matrix_shape(shape: Sequence[int]) -> tuple[int, int] | None:
    """The (n, m) matrix view PowerSGD uses (first dim by the rest), or None for a scalar or an
    empty tensor."""
    shape = tuple(int(s) for s in shape)
    if not shape or numel_of(shape) == 0:
        return None
    n = shape[0]
    return n, numel_of(shape) // n


def should_compress(n: int, m: int, rank: int, min_compression_rate: float) -> bool:
    """torch's rule: worth compressing iff (n + m) r * rate < n m, with r = min(n, m, rank)."""
    r = min(n, m, rank)
    return (n + m) * r * min_compression_rate < n * m


def orthogonalize_(mat: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Orthonormalize the columns of an (n, r) matrix in place and return it.

    Gram-Schmidt, left to right, for r <= 2 (as torch's hook); Householder QR for larger r. With
    ``epsilon = 0`` a zero column stays zero (torch would produce NaN)."""
    r = mat.shape[1]
    if r > 2:
        mat.copy_(torch.linalg.qr(mat).Q)
        return mat
    for i in range(r):
        col = mat[:, i : i + 1]
        norm = torch.linalg.vector_norm(col, dim=0, keepdim=True)
        if epsilon == 0:
            col.div_(torch.where(norm > 0, norm, torch.ones_like(norm)))
        else:
            col.div_(norm + epsilon)
        if i + 1 < r:
            rest = mat[:, i + 1 :]
            rest.sub_((col * rest).sum(dim=0, keepdim=True) * col)
    return mat


@dataclass
class _Item:
    pos: int
    key: str
    x: torch.Tensor
    n: int = 0
    m: int = 0
    r: int = 0
    mat: torch.Tensor | None = None  # M = x + error
    q: torch.Tensor | None = None
    p: torch.Tensor | None = None


class PowerSGD(Compressor):
    """Rank-r PowerSGD reducer (module docstring); one instance per strategy."""

    def __init__(self, config: PowerSGDConfig | None = None) -> None:
        super().__init__()
        self.config = config or PowerSGDConfig()
        c = self.config
        name = f"powersgd:rank={c.rank}"
        if c.min_compression_rate != 2.0:
            name += f",min_rate={c.min_compression_rate:g}"
        if not c.warm_start:
            name += ",warm=0"
        if not c.error_feedback:
            name += ",ef=0"
        if c.orthogonalization_epsilon:
            name += f",eps={c.orthogonalization_epsilon:g}"
        if c.seed:
            name += f",seed={c.seed}"
        if c.seed_scheme != "key":
            name += f",seeds={c.seed_scheme}"
        self.name = name

    # -- bytes --------------------------------------------------------------------------------------
    def predict_bytes(self, shape: int | Sequence[int], world: int) -> int:
        return self.predict_bytes_many([shape], world)

    def predict_bytes_many(self, shapes: Sequence[int | Sequence[int]], world: int) -> int:
        """Bytes one peer sends for one :meth:`reduce_sum_many` over tensors of these shapes."""
        unc, ps, qs = 1, 0, 0  # 1: the contributor counter
        for s in shapes:
            shp = (s,) if isinstance(s, int) else tuple(s)
            nm = matrix_shape(shp)
            if nm is not None and should_compress(
                *nm, self.config.rank, self.config.min_compression_rate
            ):
                r = min(nm[0], nm[1], self.config.rank)
                ps += nm[0] * r
                qs += nm[1] * r
            else:
                unc += numel_of(shp)
        return sum(wire_bytes("all_reduce", 4 * n, world) for n in (unc, ps, qs) if n)

    # -- reduction -----------------------------------------------------------------------------------
    def _reduce_many(
        self, group: Group, items: list[tuple[str, torch.Tensor]], contribute: bool
    ) -> list[torch.Tensor]:
        cfg = self.config
        if _RNG_KEY in {k for k, _ in items}:
            raise ValueError(f"key {_RNG_KEY!r} is reserved by PowerSGD")
        comp: list[_Item] = []
        unc: list[_Item] = []
        for pos, (key, x) in enumerate(items):
            it = _Item(pos, key, x)
            nm = matrix_shape(x.shape)
            if nm is not None and should_compress(*nm, cfg.rank, cfg.min_compression_rate):
                it.n, it.m = nm
                it.r = min(it.n, it.m, cfg.rank)
                comp.append(it)
            else:
                unc.append(it)
        # torch's hook visits compressed tensors grouped by shape, in order of first appearance;
        # the same order keeps its RNG stream and buffer layout
        by_shape: dict[tuple[int, ...], list[_Item]] = {}
        for it in comp:
            by_shape.setdefault(tuple(it.x.shape), []).append(it)
        comp = [it for group_items in by_shape.values() for it in group_items]

        for it in comp:
            mat = it.x.reshape(it.n, it.m)
            if contribute and cfg.error_feedback:
                err = self._local.get(it.key, "error")
                if err is not None and err.shape == mat.shape:
                    mat = mat + err
            it.mat = mat
        self._init_qs(comp)

        device = items[0][1].device if items else torch.device("cpu")
        counter = torch.tensor([1.0 if contribute else 0.0], dtype=torch.float32, device=device)
        ubuf = torch.cat([it.x.reshape(-1) for it in unc] + [counter])
        pbuf = torch.cat([(it.mat @ it.q).reshape(-1) for it in comp]) if comp else None
        group.all_reduce(ubuf, "sum")
        if pbuf is not None:
            group.all_reduce(pbuf, "sum")
        n_contrib = round(float(ubuf[-1]))

        outs: list[torch.Tensor | None] = [None] * len(items)
        off = 0
        for it in unc:
            k = it.x.numel()
            outs[it.pos] = ubuf[off : off + k].clone()
            off += k
        if comp and pbuf is not None:
            off = 0
            for it in comp:
                k = it.n * it.r
                it.p = orthogonalize_(
                    pbuf[off : off + k].reshape(it.n, it.r).clone(), cfg.orthogonalization_epsilon
                )
                off += k
            qbuf = torch.cat([(it.mat.t() @ it.p).reshape(-1) for it in comp])
            group.all_reduce(qbuf, "sum")
            off = 0
            for it in comp:
                k = it.m * it.r
                q_sum = qbuf[off : off + k].reshape(it.m, it.r)
                off += k
                assert it.mat is not None and it.p is not None
                if n_contrib == 0:
                    outs[it.pos] = torch.zeros(it.x.numel(), dtype=it.x.dtype, device=it.x.device)
                    continue
                q_mean = q_sum / n_contrib
                approx = it.p @ q_mean.t()
                if cfg.warm_start:
                    self._shared.put(it.key, "q", q_mean.clone())
                if contribute and cfg.error_feedback:
                    self._local.put(it.key, "error", it.mat - approx)
                outs[it.pos] = (approx * n_contrib).reshape(-1)
        missing = [items[i][0] for i, o in enumerate(outs) if o is None]
        if missing:
            raise AssertionError(f"PowerSGD produced no result for {missing}")
        return [o for o in outs if o is not None]

    def _init_qs(self, comp: list[_Item]) -> None:
        """Set ``it.q`` for every compressed item: the orthogonalized warm Q or a fresh draw."""
        cfg = self.config
        fresh: list[_Item] = []
        for it in comp:
            q = self._shared.get(it.key, "q") if cfg.warm_start else None
            usable = (
                q is not None
                and tuple(q.shape) == (it.m, it.r)
                and bool((torch.linalg.vector_norm(q, dim=0) > 0).all())
            )
            if usable:
                it.q = q.clone()
            else:
                fresh.append(it)
        if fresh:
            if cfg.seed_scheme == "torch":
                seed = self._torch_scheme_seed()
                gen = torch.Generator(device="cpu").manual_seed(seed)
                for it in fresh:
                    it.q = torch.randn(it.m, it.r, generator=gen, dtype=torch.float32)
            else:
                for it in fresh:
                    draws = int(self._shared.get(it.key, "draws", 0))
                    self._shared.put(it.key, "draws", draws + 1)
                    gen = torch.Generator(device="cpu").manual_seed(
                        derive_seed(cfg.seed, it.key, draws)
                    )
                    it.q = torch.randn(it.m, it.r, generator=gen, dtype=torch.float32)
        for it in comp:
            assert it.q is not None
            it.q = orthogonalize_(it.q.to(it.x.device), cfg.orthogonalization_epsilon)

    def _torch_scheme_seed(self) -> int:
        rng = np.random.RandomState(self.config.seed)
        state: Any = self._shared.get(_RNG_KEY, "rng")
        if state is not None:
            rng.set_state(state)
        seed = int(rng.randint(1_000_000_000))
        self._shared.put(_RNG_KEY, "rng", rng.get_state())
        return seed
