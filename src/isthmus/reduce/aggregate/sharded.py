"""Robust aggregation across peers without a central server, for about the bytes of one all-reduce.

Each of the ``n = group.world`` peers holds one vector of length ``d``. The coordinates are cut
into ``n`` contiguous shards and peer ``s`` *owns* shard ``s``:

1. **header** (tiny all-gather, 5 integers per peer): vector length, dtype, whether a start
   vector is used, ``f`` and a fingerprint of the pipeline spec. Peers that disagree all raise
   the same :class:`~isthmus.reduce.aggregate.aggregator.AggregationError` here, before any bulk
   transfer: Gloo's all-to-all with mismatched sizes silently fills buffers with garbage or
   aborts the whole process, so this check is not optional. A peer whose own input is malformed
   announces it in the header, so every peer raises at once instead of waiting for a timeout.
2. **all-to-all** (bulk): every peer sends slice ``s`` of its vector to the owner of shard ``s``,
   which then holds the ``n x d/n`` block of all peers' slices.
3. **geometry** (tiny all-gather of ``2n + p^2`` float64 per peer, ``p = n`` or ``n + 1`` with a
   start vector): each owner reports, for its block, which rows hold NaN/Inf, the partial squared
   norms, and (when a stage needs distances) the partial Gram matrix of the rows (plus the
   start's slice). Every peer ORs the flags and sums the partial Grams *in rank order* from the
   same gathered bytes, so every peer holds bit-for-bit the same exclusion set and Gram matrix
   and takes the same decisions (which vectors Krum picks, Weiszfeld weights, ...).
4. Each owner runs the pipeline on its shard: coordinate-wise rules (mean, median, trimmed mean,
   meamed) directly on its columns; distance-based rules (Krum, Multi-Krum, geometric median,
   centered clipping, Flag) compute their combination coefficients from the Gram matrix and
   apply them to the columns; pre-aggregators (nnm, bucketing, clip) are linear maps computed
   from the Gram matrix and applied the same way.
5. **all-gather** (bulk): owners share their result shards; every peer concatenates them, so the
   aggregate is bit-identical on all peers by construction.

Cost. The two bulk steps move ``(n-1)/n * d`` elements each per peer, together exactly the
``2 (n-1)/n * d`` of a ring all-reduce (plus at most ``n - 1`` elements of padding when ``d`` is
not a multiple of ``n``). The two small all-gathers add ``(n-1) * (5 * 8 + (2n + p^2) * 8)``
bytes, independent of ``d``. Iterative rules cost **no** extra communication per iteration:
every iterate of Weiszfeld, centered clipping or Flag's IRLS is a linear combination of the
inputs (and the start vector), so its distances to the inputs follow from the Gram matrix and the
combination coefficients. Latency is four collectives. Distances are computed from a float64
Gram matrix; inputs in float32 make every product exact in float64, so the cancellation in
``G_ii + G_jj - 2 G_ij`` only matters for vectors closer than about ``1e-8`` times their norm.

Threat model (details in docs/ROBUST.md). Tolerated: up to ``f`` peers sending arbitrary *vectors*
(finite or not), provided every peer runs this protocol honestly otherwise. Not tolerated: a
malicious *shard owner* can write anything into the aggregate of the shard it owns, lie in the
partial Gram entries and non-finite flags it reports (steering every peer's decisions, e.g. making
its own vector look central, or excluding honest peers), and, as a relay in Gloo's ring
all-gather, alter the blocks it forwards so that honest peers end up with different aggregates
(the state hash at commit detects that divergence). Closing this needs each shard computed by
``2f + 1`` owners and majority-checked, which multiplies the scatter traffic by ``2f + 1``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from isthmus.comm.group import Group
from isthmus.reduce.aggregate.aggregator import (
    OVERFLOW_BIT,
    AggregationError,
    AggregationReport,
    AggregationResult,
    CoordinateRule,
    GramRule,
    PreAggregator,
    RuleInfo,
    Stage,
    check_count,
    check_f,
    check_result,
    check_start,
    exclusion_reason,
    log_exclusions,
    map_selected,
    norm_can_overflow,
    pipeline_spec,
    row_flags,
)

__all__ = ["run_sharded", "shard_sizes"]

_DTYPE_CODES = {torch.float32: 1, torch.float64: 2, torch.float16: 3, torch.bfloat16: 4}
_HEADER = ("vector length", "dtype", "use of a start vector", "f", "aggregator spec")


def shard_sizes(d: int, world: int) -> list[int]:
    """Lengths of the ``world`` contiguous shards of a length-``d`` vector (the first ``d % world``
    shards are one longer)."""
    base, extra = divmod(d, world)
    return [base + (1 if r < extra else 0) for r in range(world)]


def _fingerprint(spec: str) -> int:
    # hashlib, not hash(): Python salts str hashes per process, peers must agree
    return int.from_bytes(hashlib.blake2b(spec.encode(), digest_size=7).digest(), "big")


def _local_problem(vector: object, start: torch.Tensor | None) -> str | None:
    if not isinstance(vector, torch.Tensor):
        return f"vector is a {type(vector).__name__}, not a torch.Tensor"
    if vector.dim() != 1 or vector.numel() == 0:
        return f"vector has shape {tuple(vector.shape)}; pass a non-empty 1-D tensor"
    if vector.dtype not in _DTYPE_CODES:
        return f"vector has dtype {vector.dtype}; use float32, float64, float16 or bfloat16"
    try:
        check_start(start, vector.numel(), vector.dtype)
    except AggregationError as e:
        return str(e)
    return None


# Float64 work on a shard runs over column chunks of this many elements per row, so the temporary
# float64 copies stay small even when a peer owns millions of coordinates.
_CHUNK = 1 << 16


def _chunks(width: int) -> range:
    return range(0, width, _CHUNK)


def _block_geometry(
    block: torch.Tensor,
    bad_rows: torch.Tensor,
    start_slice: torch.Tensor | None,
    need_gram: bool,
    need_norms: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Partial squared norms of the rows of ``block`` (zeros unless ``need_norms``) and, if
    ``need_gram``, the partial Gram matrix of the rows (plus ``start_slice`` as a last row), all
    in float64."""
    n, width = block.shape
    p = n + (1 if start_slice is not None else 0)
    sq = torch.zeros(n, dtype=torch.float64, device=block.device)
    gram = torch.zeros(p, p, dtype=torch.float64, device=block.device) if need_gram else None
    if not (need_gram or need_norms):
        return sq, gram
    for lo in _chunks(width):
        rows = block[:, lo : lo + _CHUNK].to(torch.float64)
        # rows with NaN/Inf are excluded by everyone once flags are combined; zeroing them keeps
        # the partial sums finite so they cannot poison the entries of healthy rows
        rows[bad_rows] = 0.0
        sq += (rows * rows).sum(dim=1)
        if gram is not None:
            if start_slice is not None:
                rows = torch.cat([rows, start_slice[lo : lo + _CHUNK].to(torch.float64)[None]])
            gram += rows @ rows.T
    return sq, gram


def _combine(
    coeffs: torch.Tensor,
    rows: torch.Tensor,
    start_coeff: torch.Tensor | None,
    start_slice: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``coeffs @ rows (+ start_coeff * start_slice)`` in float64, returned in ``dtype``."""
    out = torch.empty(rows.shape[1], dtype=dtype, device=rows.device)
    for lo in _chunks(rows.shape[1]):
        acc = coeffs @ rows[:, lo : lo + _CHUNK].to(torch.float64)
        if start_coeff is not None and start_slice is not None:
            acc = acc + start_coeff * start_slice[lo : lo + _CHUNK].to(torch.float64)
        out[lo : lo + _CHUNK] = acc.to(dtype)
    return out


def _mix(A: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``A @ rows`` in float64, returned in ``dtype`` (pre-aggregators before a coordinate rule)."""
    out = torch.empty(A.shape[0], rows.shape[1], dtype=dtype, device=rows.device)
    for lo in _chunks(rows.shape[1]):
        out[:, lo : lo + _CHUNK] = (A @ rows[:, lo : lo + _CHUNK].to(torch.float64)).to(dtype)
    return out


def _needs_gram(stages: Sequence[Stage]) -> bool:
    return any(
        isinstance(s.rule, GramRule) or (isinstance(s.rule, PreAggregator) and s.rule.needs_gram)
        for s in stages
    )


def run_sharded(
    group: Group,
    vector: torch.Tensor,
    stages: Sequence[Stage],
    f: int,
    *,
    start: torch.Tensor | None = None,
) -> AggregationResult:
    """Aggregate one vector per peer of ``group`` with the pipeline ``stages`` (see module doc).

    Every peer must call this with the same ``stages``, ``f``, vector length and dtype, and a
    start vector on all peers or on none (checked: a disagreement raises
    :class:`~isthmus.reduce.aggregate.aggregator.AggregationError` on every peer). The non-finite
    policy is the reference one: a peer whose vector holds NaN/Inf anywhere is excluded by every
    peer, and ``f`` shrinks by one per exclusion. Raises ``AggregationError`` on all peers alike
    when too few vectors remain or the aggregate overflows, and
    :class:`~isthmus.comm.group.CollectiveError` when a peer fails or the group is aborted.
    Returns the aggregate (bit-identical on every peer) and a report (identical on every peer).
    """
    final = stages[-1]
    if isinstance(final.rule, PreAggregator):
        raise ValueError(
            f"{final.rule.name} is a pre-aggregator; end the pipeline with an aggregator"
        )
    check_f(f)
    spec = pipeline_spec(stages)
    world, rank = group.world, group.rank
    n = world

    # -- 1. header ---------------------------------------------------------------------------
    problem = _local_problem(vector, start)
    uses_start = isinstance(final.rule, GramRule) and final.rule.uses_start and start is not None
    if problem is None:
        d, dtype, device = vector.numel(), vector.dtype, vector.device
        header = [d, _DTYPE_CODES[dtype], int(uses_start), f, _fingerprint(spec)]
    else:
        d, dtype, device = 0, torch.float32, torch.device("cpu")
        if isinstance(vector, torch.Tensor):
            device = vector.device
        header = [-1, 0, int(uses_start), f, _fingerprint(spec)]
    headers = group.all_gather_flat(torch.tensor(header, dtype=torch.int64, device=device))
    headers = headers.view(world, len(header)).tolist()
    if problem is not None:
        raise AggregationError(f"{problem} (the other peers were told and raise too)")
    invalid = [r for r in range(world) if headers[r][0] < 0]
    if invalid:
        raise AggregationError(
            f"peer(s) {invalid} passed an invalid vector (their own errors say why); "
            f"nothing was aggregated"
        )
    for col, what in enumerate(_HEADER):
        values = [headers[r][col] for r in range(world)]
        if len(set(values)) > 1:
            raise AggregationError(
                f"peers disagree on the {what} ({values} by rank); every peer must aggregate "
                f"the same model with the same aggregator, f and start policy"
            )
    has_start = uses_start
    assert start is None or isinstance(start, torch.Tensor)

    # -- 2. scatter the shards ---------------------------------------------------------------
    sizes = shard_sizes(d, world)
    ds = sizes[rank]
    off = sum(sizes[:rank])
    block = group.all_to_all(
        vector.detach().contiguous(), in_splits=sizes, out_splits=[ds] * world
    ).view(world, ds)

    # -- 3. geometry: flags, norms, Gram ------------------------------------------------------
    need_gram = _needs_gram(stages)
    p = n + 1 if has_start else n
    bits_local = row_flags(block)
    start_slice = start[off : off + ds] if (has_start and start is not None) else None
    payload = torch.zeros(2 * n + (p * p if need_gram else 0), dtype=torch.float64, device=device)
    payload[:n] = bits_local.to(torch.float64)
    sq_local, gram_local = _block_geometry(
        block, bits_local != 0, start_slice, need_gram, norm_can_overflow(dtype)
    )
    payload[n : 2 * n] = sq_local
    if gram_local is not None:
        payload[2 * n :] = gram_local.reshape(-1)
    parts = group.all_gather_flat(payload).view(world, -1)
    bits = torch.zeros(n, dtype=torch.int64, device=device)
    sq = parts[0, n : 2 * n].clone()
    for k in range(world):
        bits |= parts[k, :n].to(torch.int64)
        if k:
            sq += parts[k, n : 2 * n]
    bits |= ((bits == 0) & ~torch.isfinite(sq)).to(torch.int64) * OVERFLOW_BIT
    excluded = {i: exclusion_reason(int(b)) for i, b in enumerate(bits.tolist()) if b}
    log_exclusions(spec, excluded)
    keep = [i for i in range(n) if i not in excluded]
    if not keep:
        raise AggregationError(
            f"{spec}: all {n} vectors were excluded ("
            + ", ".join(f"{i}: {r}" for i, r in sorted(excluded.items()))
            + ")"
        )
    f_eff = max(0, f - len(excluded))
    G: torch.Tensor | None = None
    if need_gram:
        total = parts[0, 2 * n :].clone()
        for k in range(1, world):
            total += parts[k, 2 * n :]  # fixed order: the same bits on every peer
        idx = keep + ([n] if has_start else [])
        G = total.view(p, p)[idx][:, idx]

    # -- 4. run the pipeline on this shard ----------------------------------------------------
    m = len(keep)
    A: torch.Tensor | None = None  # outputs of the pre-aggregators = A @ kept inputs
    for k, st in enumerate(stages[:-1]):
        assert isinstance(st.rule, PreAggregator)
        check_count(st, m, f_eff, n, excluded, stages[:k])
        M = st.rule.mixing(
            G[:m, :m] if (G is not None and st.rule.needs_gram) else None, m, f_eff, st.config
        )
        M = M.to(device)
        A = M if A is None else M @ A
        if G is not None:
            if has_start:
                Maug = torch.zeros(M.shape[0] + 1, m + 1, dtype=torch.float64, device=device)
                Maug[:-1, :-1] = M
                Maug[-1, -1] = 1.0
                M = Maug
            G = M @ G @ M.T
        m = A.shape[0]
    check_count(final, m, f_eff, n, excluded, stages[:-1])
    kept = block[keep]
    info = RuleInfo()
    if isinstance(final.rule, CoordinateRule):
        pts_x = kept if A is None else _mix(A, kept, dtype)
        out_shard = final.rule.columns(pts_x, f_eff, final.config)
    else:
        assert G is not None
        coeffs, info = final.rule.weights(G, f_eff, final.config, has_start)
        cx = coeffs[:m] if A is None else coeffs[:m] @ A
        out_shard = _combine(cx, kept, coeffs[m] if has_start else None, start_slice, dtype)

    # -- 5. gather the result shards ----------------------------------------------------------
    width = max(sizes)
    buf = torch.zeros(width, dtype=dtype, device=device)
    buf[:ds] = out_shard
    full = group.all_gather_flat(buf).view(world, width)
    out = torch.cat([full[k, : sizes[k]] for k in range(world)])
    check_result(out, spec)
    report = AggregationReport(
        rule=spec,
        n=n,
        f=f,
        f_effective=f_eff,
        excluded=excluded,
        selected=map_selected(info, stages, keep),
        iterations=info.iterations,
        notes=info.notes,
    )
    return AggregationResult(out, report)
