"""Count-sketch aggregation with error kept in sketch space (FetchSGD style).

Rothchild, Panda, Ullah, Ivkin, Stoica, Braverman, Gonzalez, Arora, "FetchSGD:
Communication-Efficient Federated Learning with Sketching", ICML 2020. Count sketch: Charikar,
Chen, Farach-Colton, "Finding Frequent Items in Data Streams", ICALP 2002.

A count sketch of a vector ``x`` of length ``d`` is an ``R x W`` table: row ``j`` adds
``s_j(i) x_i`` into column ``h_j(i)``, with bucket hashes ``h_j`` and signs ``s_j`` drawn from a
seed derived from ``(seed, key, d)``, so every peer builds the same tables. Sketching is linear,
so the sum of the peers' sketches is the sketch of the sum and one plain all-reduce of the
``R x W`` table aggregates everything. The coordinate estimate is
``median_j s_j(i) S[j, h_j(i)]`` (lower median for an even ``R``).

Per round and tensor, identically on every peer (everything after the all-reduce is shared):

1. ``S = sum_i sketch(x_i)`` (all-reduce; all tensors' tables share one);
2. optional momentum in sketch space, ``U <- rho U + S`` (``U = S`` when ``rho = 0``);
3. ``E <- E + U`` (error accumulated in sketch space);
4. ``delta = top-k(unsketch(E))`` using the sketch's estimates as values;
   ``E <- E - sketch(delta)``; the result is ``delta``.

``E`` (and ``U``) are shared state. Differences from the paper: FetchSGD multiplies the learning
rate into ``E`` (``E += lr U``); here the optimizer applies the learning rate to ``delta``,
which is the same for a constant rate. FetchSGD optionally spends a second round to fetch exact
values of the top-k coordinates and zeroes momentum/error at them; this does neither (whether
the paper's main algorithm zeroes them is not checked against the paper).

Index arithmetic uses ``index_add_``, which is deterministic on CPU. On CUDA, float
``index_add_`` with repeated indices uses atomics and is not bitwise reproducible; there
``torch.use_deterministic_algorithms(True)`` is needed for the shared state to stay identical
(tests/unit/test_cuda.py found two CUDA peers identical on a small sketch, which atomics do not
guarantee in general).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from isthmus.comm.group import Group, wire_bytes

from .compressor import Compressor, derive_seed, numel_of

__all__ = ["CountSketch", "SketchConfig", "SketchReducer"]


@dataclass(frozen=True, kw_only=True)
class SketchConfig:
    """Settings of :class:`SketchReducer`."""

    #: fraction of coordinates returned per round (top-k of the unsketched error), in (0, 1]
    k: float = 0.01
    #: sketch rows (independent hash functions); more rows, more robust estimates
    rows: int = 5
    #: sketch columns as a fraction of the tensor size (at least 1 column)
    width: float = 0.1
    #: momentum kept in sketch space (0 disables it; then use momentum in the optimizer)
    momentum: float = 0.0
    #: seed of the hash tables; all peers must use the same
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.k <= 1.0:
            raise ValueError(f"sketch k must be a fraction in (0, 1], e.g. 0.01; got {self.k!r}")
        if not isinstance(self.rows, int) or self.rows < 1:
            raise ValueError(f"sketch rows must be an int >= 1, got {self.rows!r}")
        if not self.width > 0:
            raise ValueError(f"sketch width must be > 0 (fraction of the size), got {self.width!r}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"sketch momentum must be in [0, 1), got {self.momentum!r}")

    def columns(self, d: int) -> int:
        return max(1, math.ceil(self.width * d))

    def topk(self, d: int) -> int:
        return max(1, min(d, math.ceil(self.k * d))) if d else 0


class CountSketch:
    """The hash tables of one (seed, key, d) count sketch, and its linear maps. Pure."""

    def __init__(
        self, d: int, rows: int, cols: int, seed: int, device: torch.device | str = "cpu"
    ) -> None:
        g = torch.Generator(device="cpu").manual_seed(seed)
        buckets = torch.randint(0, cols, (rows, d), generator=g)
        signs = torch.randint(0, 2, (rows, d), generator=g).to(torch.float32) * 2 - 1
        offsets = torch.arange(rows).unsqueeze(1) * cols
        self.d, self.rows, self.cols = d, rows, cols
        self.flat_index = (buckets + offsets).reshape(-1).to(device)
        self.signs = signs.to(device)

    def sketch(self, x: torch.Tensor) -> torch.Tensor:
        """(rows, cols) table of the flat ``x``."""
        vals = (self.signs * x.reshape(1, -1)).reshape(-1)
        out = torch.zeros(self.rows * self.cols, dtype=torch.float32, device=x.device)
        out.index_add_(0, self.flat_index, vals)
        return out.reshape(self.rows, self.cols)

    def estimate(self, table: torch.Tensor) -> torch.Tensor:
        """Median-of-rows estimate of every coordinate, length d."""
        per_row = table.reshape(-1)[self.flat_index].reshape(self.rows, self.d) * self.signs
        return per_row.median(dim=0).values


class SketchReducer(Compressor):
    """Count-sketch sum with top-k unsketching and sketch-space error (spec ``sketch``)."""

    def __init__(self, config: SketchConfig | None = None) -> None:
        super().__init__()
        self.config = config or SketchConfig()
        c = self.config
        name = f"sketch:k={c.k:g},rows={c.rows},width={c.width:g}"
        if c.momentum:
            name += f",momentum={c.momentum:g}"
        if c.seed:
            name += f",seed={c.seed}"
        self.name = name
        self._tables: dict[tuple[str, int, str], CountSketch] = {}

    def _table(self, key: str, d: int, device: torch.device) -> CountSketch:
        k = (key, d, str(device))
        cs = self._tables.get(k)
        if cs is None:
            c = self.config
            cs = CountSketch(d, c.rows, c.columns(d), derive_seed(c.seed, "sketch", key, d), device)
            self._tables[k] = cs
        return cs

    def predict_bytes(self, shape: int | Sequence[int], world: int) -> int:
        d = numel_of(shape)
        if d == 0:
            return 0
        return wire_bytes("all_reduce", 4 * self.config.rows * self.config.columns(d), world)

    def predict_bytes_many(self, shapes: Sequence[int | Sequence[int]], world: int) -> int:
        """Bytes for one :meth:`reduce_sum_many`: every table travels in one all-reduce."""
        cells = sum(
            self.config.rows * self.config.columns(numel_of(s)) for s in shapes if numel_of(s)
        )
        return wire_bytes("all_reduce", 4 * cells, world) if cells else 0

    def _reduce_many(
        self, group: Group, items: list[tuple[str, torch.Tensor]], contribute: bool
    ) -> list[torch.Tensor]:
        # sketches are linear: every tensor's table goes into one all-reduce
        sketches = []
        for key, x in items:
            flat = x.reshape(-1)
            if flat.numel() == 0:
                sketches.append(None)
                continue
            cs = self._table(key, flat.numel(), flat.device)
            sketches.append((cs, cs.sketch(flat)))  # zeros when not contributing (base passes 0)
        tables = [t.reshape(-1) for st in sketches if st is not None for t in (st[1],)]
        if not tables:
            return [x.reshape(-1).clone() for _, x in items]
        buf = torch.cat(tables)
        group.all_reduce(buf, "sum")
        outs = []
        off = 0
        for (key, x), st in zip(items, sketches, strict=True):
            if st is None:
                outs.append(x.reshape(-1).clone())
                continue
            cs = st[0]
            size = cs.rows * cs.cols
            outs.append(self._finish(key, cs, buf[off : off + size].reshape(cs.rows, cs.cols)))
            off += size
        return outs

    def _finish(self, key: str, cs: CountSketch, table: torch.Tensor) -> torch.Tensor:
        """Steps 2-4 of the module docstring for one tensor's summed sketch."""
        d = cs.d
        c = self.config
        if c.momentum:
            u = self._shared.get(key, "u")
            if u is not None and u.shape == table.shape:
                table = c.momentum * u + table
            self._shared.put(key, "u", table)
        err = self._shared.get(key, "err")
        if err is not None and err.shape == table.shape:
            table = err + table
        est = cs.estimate(table)
        k = c.topk(d)
        _, idx = torch.topk(est.abs(), k, sorted=False)
        delta = torch.zeros(d, dtype=torch.float32, device=table.device)
        delta[idx] = est[idx]
        self._shared.put(key, "err", table - cs.sketch(delta))
        return delta
