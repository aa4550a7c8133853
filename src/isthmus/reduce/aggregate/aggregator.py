"""What every robust aggregator shares: input checks, the non-finite policy, reports, rule records.

Every aggregator in this package takes ``n`` one-dimensional float tensors of equal length and an
integer ``f``, the number of them that may be byzantine (arbitrary, possibly adversarial), and
returns one tensor. This module holds the pieces the rule families and the distributed engine have
in common:

* :func:`as_matrix` validates the inputs and stacks them into an ``n x d`` matrix;
* :func:`screen_rows` applies the **non-finite policy**: a vector holding any NaN or Inf (or whose
  squared norm overflows float64) is *excluded* before any rule sees it, its index and the reason
  are recorded in the :class:`AggregationReport` and logged as a warning on the
  ``isthmus.aggregate`` logger, and the tolerated-fault budget shrinks by one per exclusion
  (``f_effective = max(0, f - excluded)``): a vector that is visibly broken is one of the ``f``
  faulty ones, so at most ``f - excluded`` undetected ones can remain among the others. When no
  finite vector is left, or fewer than the rule needs, :class:`AggregationError` is raised;
* :class:`CoordinateRule`, :class:`GramRule` and :class:`PreAggregator` describe one rule to the
  reference pipeline (:func:`run_reference`) and to the sharded engine
  (:mod:`isthmus.reduce.aggregate.sharded`). A rule is either coordinate-wise (it maps an
  ``n x d`` matrix to ``d`` numbers column by column, so it runs on any subset of columns), or
  distance-based: its decisions depend only on the ``n x n`` Gram matrix of inner products and its
  output is a linear combination of the inputs, so a sharded run needs only that small matrix.
  Each distance-based rule therefore comes twice: a plain vector-space reference and a Gram form,
  and the tests check that they agree.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from isthmus.spec import config_from

__all__ = [
    "AggregationError",
    "AggregationReport",
    "AggregationResult",
    "CoordinateRule",
    "GramRule",
    "NoOptions",
    "PreAggregator",
    "RuleInfo",
    "Stage",
    "as_matrix",
    "check_count",
    "check_f",
    "check_result",
    "check_start",
    "exclusion_reason",
    "gram_sq_dists",
    "log_exclusions",
    "make_stage",
    "map_selected",
    "median_of_rows",
    "norm_can_overflow",
    "pairwise_sq_dists",
    "pipeline_spec",
    "row_flags",
    "run_reference",
    "run_reference_pre",
    "screen_rows",
    "sq_dists_to_combination",
]

logger = logging.getLogger("isthmus.aggregate")

# Bits used to record why a vector was excluded; the sharded engine ORs them across shard owners.
NAN_BIT = 1
INF_BIT = 2
OVERFLOW_BIT = 4


class AggregationError(ValueError):
    """The inputs cannot be aggregated: malformed vectors, too few vectors for the rule and ``f``
    (after non-finite ones were excluded), or a result that overflowed to Inf. Nothing was
    produced; the round should be aborted or the configuration fixed as the message says."""


@dataclass(frozen=True, kw_only=True)
class NoOptions:
    """Options of a rule that has none."""


@dataclass(frozen=True)
class RuleInfo:
    """What a rule reports about one run, beyond its output (internal to the rule families)."""

    selected: tuple[int, ...] | None = None
    iterations: int | None = None
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class AggregationReport:
    """What happened during one aggregation, identical on every peer in a sharded run."""

    rule: str
    """The pipeline that ran, as a spec string (``"nnm+krum"``)."""
    n: int
    """Number of vectors received."""
    f: int
    """Number of byzantine vectors the caller declared tolerable."""
    f_effective: int
    """``max(0, f - len(excluded))``: the budget the rules actually used."""
    excluded: Mapping[int, str] = field(default_factory=dict)
    """Index of each excluded vector and why (``"contains NaN"``, ``"contains Inf"``, ...)."""
    selected: tuple[int, ...] | None = None
    """Krum / Multi-Krum: which vectors were picked. Indices of the inputs when every
    pre-aggregator keeps one output per input (nnm, clip); indices of buckets after bucketing."""
    iterations: int | None = None
    """Iterative rules (geometric median, centered clipping, flag): iterations run."""
    notes: tuple[str, ...] = ()
    """Adjustments made on the way (e.g. Multi-Krum's ``m`` clamped to the vectors left)."""

    @property
    def used(self) -> tuple[int, ...]:
        """Indices of the vectors that took part (all but the excluded ones)."""
        return tuple(i for i in range(self.n) if i not in self.excluded)


@dataclass(frozen=True)
class AggregationResult:
    """An aggregate and the report of how it was obtained."""

    vector: torch.Tensor
    report: AggregationReport


# -- rule records ------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False, kw_only=True)
class _RuleBase:
    name: str
    """Registry name (``"krum"``)."""
    config: type
    """Keyword-only dataclass holding the rule's options, validated on construction."""
    min_n: Callable[[int, Any], int]
    """Smallest number of vectors the rule accepts for a given ``f`` and config."""
    requirement: str
    """The same condition in words for error messages (``"n >= 2f + 3"``)."""


@dataclass(frozen=True, eq=False, kw_only=True)
class CoordinateRule(_RuleBase):
    """A rule applied independently to every coordinate: ``columns(X, f, config) -> (d,)``."""

    columns: Callable[[torch.Tensor, int, Any], torch.Tensor]


@dataclass(frozen=True, eq=False, kw_only=True)
class GramRule(_RuleBase):
    """A rule whose output is a linear combination of its inputs, chosen from inner products only.

    ``reference(X, f, config, start)`` computes it directly on the ``m x d`` matrix ``X``.
    ``weights(G, f, config, has_start)`` computes the combination coefficients from the float64
    Gram matrix ``G`` of the ``m`` points, plus the start vector as a last point when
    ``has_start``; the aggregate is then ``sum_k coeffs[k] * point_k``.
    """

    reference: Callable[
        [torch.Tensor, int, Any, torch.Tensor | None], tuple[torch.Tensor, RuleInfo]
    ]
    weights: Callable[[torch.Tensor, int, Any, bool], tuple[torch.Tensor, RuleInfo]]
    uses_start: bool = False
    """True when the rule starts from the caller's previous aggregate (centered clipping)."""


@dataclass(frozen=True, eq=False, kw_only=True)
class PreAggregator(_RuleBase):
    """A linear map from ``m`` vectors to ``output_count(m, config)`` vectors, run before a rule.

    ``reference(X, f, config)`` applies it to the ``m x d`` matrix. ``mixing(G, m, f, config)``
    returns the ``m' x m`` float64 matrix ``A`` with ``outputs = A @ X``; ``G`` is the Gram matrix
    of the inputs, or ``None`` when ``needs_gram`` is false.
    """

    reference: Callable[[torch.Tensor, int, Any], torch.Tensor]
    mixing: Callable[[torch.Tensor | None, int, int, Any], torch.Tensor]
    output_count: Callable[[int, Any], int]
    needs_gram: bool = True
    preserves_indices: bool = True
    """True when output ``i`` stands for input ``i`` (so selections can be mapped back)."""


RuleDef = CoordinateRule | GramRule | PreAggregator


@dataclass(frozen=True)
class Stage:
    """One step of a pipeline: a rule or pre-aggregator and its validated options."""

    rule: RuleDef
    config: Any

    @property
    def spec(self) -> str:
        """``name`` followed by the options that differ from their defaults (``multi_krum:m=3``)."""
        parts = []
        for fld in dataclasses.fields(self.config):
            value = getattr(self.config, fld.name)
            default = fld.default
            if default is dataclasses.MISSING or value != default:
                parts.append(f"{fld.name}={value}")
        return self.rule.name + (":" + ",".join(parts) if parts else "")


def make_stage(rule: RuleDef, options: Mapping[str, Any]) -> Stage:
    """Build a :class:`Stage` from options given in Python (``multi_krum(..., m=3)``), checked
    and coerced like a spec's. Raises :class:`~isthmus.spec.SpecError` (a ValueError) for an
    unknown option (with the closest valid one), a value of the wrong type, or one the rule's
    options refuse."""
    return Stage(rule, config_from(rule.config, options, what=rule.name))


# -- input checks and the non-finite policy ----------------------------------------------------


def check_f(f: int) -> int:
    """Return ``f`` if it is a non-negative int, else raise ``ValueError`` saying so."""
    if isinstance(f, bool) or not isinstance(f, int) or f < 0:
        raise ValueError(
            f"f (the number of byzantine vectors to tolerate) must be an int >= 0, got {f!r}"
        )
    return f


def as_matrix(vectors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Stack ``vectors`` into an ``n x d`` matrix after checking that they can be aggregated.

    Raises :class:`AggregationError` for an empty list, a non-tensor, a tensor that is not 1-D,
    not floating point, empty, or whose length, dtype or device differs from the first one.
    Non-finite values are *not* rejected here (see :func:`screen_rows`).
    """
    if isinstance(vectors, torch.Tensor):
        raise AggregationError(
            "pass a list of 1-D tensors, not one tensor (use list(matrix) for rows)"
        )
    vs = list(vectors)
    if not vs:
        raise AggregationError("no vectors to aggregate")
    first = vs[0]
    for i, v in enumerate(vs):
        if not isinstance(v, torch.Tensor):
            raise AggregationError(f"vector {i} is a {type(v).__name__}, not a torch.Tensor")
        if v.dim() != 1:
            raise AggregationError(
                f"vector {i} has shape {tuple(v.shape)}; aggregators take 1-D vectors "
                f"(flatten parameters first, e.g. torch.cat([p.reshape(-1) for p in params]))"
            )
        if not v.is_floating_point():
            raise AggregationError(f"vector {i} has dtype {v.dtype}; use a floating-point dtype")
        if v.numel() == 0:
            raise AggregationError(f"vector {i} is empty")
        if v.shape != first.shape or v.dtype != first.dtype or v.device != first.device:
            raise AggregationError(
                f"vector {i} is {tuple(v.shape)} {v.dtype} on {v.device} but vector 0 is "
                f"{tuple(first.shape)} {first.dtype} on {first.device}; all must match"
            )
    return torch.stack([v.detach() for v in vs])


def check_start(start: torch.Tensor | None, d: int, dtype: torch.dtype) -> None:
    """Reject a start vector (previous aggregate) that does not match the inputs or is not finite."""
    if start is None:
        return
    if not isinstance(start, torch.Tensor) or start.dim() != 1 or start.numel() != d:
        shape = tuple(start.shape) if isinstance(start, torch.Tensor) else type(start).__name__
        raise AggregationError(
            f"start must be a 1-D tensor of length {d} like the inputs, got {shape}"
        )
    if not start.is_floating_point():
        raise AggregationError(f"start has dtype {start.dtype}; use {dtype}")
    if not bool(torch.isfinite(start).all()):
        raise AggregationError(
            "start (the previous aggregate) contains NaN or Inf; restart from start=None (zero) "
            "or from the last finite aggregate"
        )


def row_flags(X: torch.Tensor) -> torch.Tensor:
    """Per row of ``X``: ``NAN_BIT`` if it holds a NaN, ``INF_BIT`` if it holds an Inf (int64)."""
    flags = torch.zeros(X.shape[0], dtype=torch.int64, device=X.device)
    bad = ~torch.isfinite(X).all(dim=1)
    if bool(bad.any()):  # one pass over everything; the NaN/Inf detail only for the bad rows
        sub = X[bad]
        flags[bad] = (
            torch.isnan(sub).any(dim=1).to(torch.int64) * NAN_BIT
            + torch.isinf(sub).any(dim=1).to(torch.int64) * INF_BIT
        )
    return flags


def norm_can_overflow(dtype: torch.dtype) -> bool:
    """Whether a finite vector of ``dtype`` can have a squared norm beyond float64's range.

    Only float64 can: float32's largest value squared is about 1e77, far from 1e308 even summed
    over 1e12 coordinates."""
    return dtype == torch.float64


def exclusion_reason(bits: int) -> str:
    """Human reason for the exclusion bits of one vector."""
    parts = []
    if bits & NAN_BIT:
        parts.append("NaN")
    if bits & INF_BIT:
        parts.append("Inf")
    if parts:
        return "contains " + " and ".join(parts)
    if bits & OVERFLOW_BIT:
        return "squared norm overflows float64"
    return "excluded"


def screen_rows(X: torch.Tensor) -> dict[int, str]:
    """Apply the non-finite policy to the rows of ``X``: return ``{index: reason}`` to exclude.

    A row is excluded when it holds NaN or Inf, or when its squared norm, computed in float64
    as every distance-based rule does, overflows (only possible for huge float64 inputs).
    """
    bits = row_flags(X)
    finite = bits == 0
    if norm_can_overflow(X.dtype) and bool(finite.any()):
        sq = torch.zeros(X.shape[0], dtype=torch.float64, device=X.device)
        rows = X[finite].to(torch.float64)
        sq[finite] = (rows * rows).sum(dim=1)
        bits = bits + (finite & ~torch.isfinite(sq)).to(torch.int64) * OVERFLOW_BIT
    return {i: exclusion_reason(int(b)) for i, b in enumerate(bits.tolist()) if b}


def check_count(
    stage: Stage,
    m: int,
    f: int,
    n: int,
    excluded: Mapping[int, str],
    previous: Sequence[Stage] = (),
) -> None:
    """Raise :class:`AggregationError` when ``m`` vectors are too few for ``stage`` with ``f``.

    ``previous`` are the pre-aggregators that ran before (named in the message when they changed
    the count, e.g. bucketing)."""
    need = stage.rule.min_n(f, stage.config)
    if m >= need:
        return
    if m != n - len(excluded):
        names = "+".join(s.rule.name for s in previous)
        raise AggregationError(
            f"{stage.rule.name} needs {stage.rule.requirement} (at least {need} vectors with "
            f"f={f}), but {names} left {m} of the {n - len(excluded)} usable vectors; use larger "
            f"groups only when enough vectors remain (e.g. a smaller bucket size s)"
        )
    if excluded:
        why = ", ".join(f"{i}: {r}" for i, r in sorted(excluded.items()))
        raise AggregationError(
            f"{stage.rule.name} needs {stage.rule.requirement} (at least {need} vectors with "
            f"f={f}), but only {m} of {n} remain after excluding non-finite vectors ({why})"
        )
    raise AggregationError(
        f"{stage.rule.name} needs {stage.rule.requirement} (at least {need} vectors with f={f}), "
        f"got {m}; lower f or add peers"
        + (
            ""
            if need <= 2 * f + 1
            else ", or pick a rule with a weaker requirement (median needs n > 2f)"
        )
    )


def log_exclusions(spec: str, excluded: Mapping[int, str]) -> None:
    if excluded:
        logger.warning(
            "%s: excluded %d vector(s): %s",
            spec,
            len(excluded),
            "; ".join(f"{i} ({r})" for i, r in sorted(excluded.items())),
        )


def check_result(out: torch.Tensor, spec: str) -> None:
    """Raise :class:`AggregationError` if an aggregate of finite vectors overflowed."""
    if not bool(torch.isfinite(out).all()):
        raise AggregationError(
            f"{spec}: the aggregate of the finite inputs overflowed to Inf in {out.dtype}; "
            f"the inputs are too large for this dtype (clip them, e.g. 'clip+{spec}', or use float64)"
        )


# -- small numeric helpers shared by the families ----------------------------------------------


def median_of_rows(X: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise median of the rows of ``X``; for an even count, the midpoint of the two
    middle values (torch.median would return the lower one)."""
    n = X.shape[0]
    s = torch.sort(X, dim=0).values
    if n % 2 == 1:
        return s[n // 2].clone()
    # halving first keeps two values near the dtype's maximum from overflowing when added
    return s[n // 2 - 1] * 0.5 + s[n // 2] * 0.5


def pairwise_sq_dists(X64: torch.Tensor) -> torch.Tensor:
    """Squared Euclidean distances between the rows of a float64 matrix, by explicit differences
    (no Gram-matrix shortcut, so the vector-space references stay independent of the Gram forms)."""
    n = X64.shape[0]
    D = torch.zeros(n, n, dtype=torch.float64, device=X64.device)
    for i in range(n):
        diff = X64 - X64[i]
        D[i] = (diff * diff).sum(dim=1)
    return D


def gram_sq_dists(G: torch.Tensor) -> torch.Tensor:
    """Squared distances between points from their float64 Gram matrix, clamped at zero."""
    diag = torch.diagonal(G)
    return (diag[:, None] + diag[None, :] - 2.0 * G).clamp_min(0.0)


def sq_dists_to_combination(G: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``||p_i - sum_k a_k p_k||^2`` for every point ``i`` of Gram matrix ``G``, clamped at zero."""
    Ga = G @ a
    return (torch.diagonal(G) - 2.0 * Ga + a @ Ga).clamp_min(0.0)


# -- the reference (single-process) pipeline ---------------------------------------------------


def pipeline_spec(stages: Sequence[Stage]) -> str:
    return "+".join(s.spec for s in stages)


def map_selected(
    info: RuleInfo, stages: Sequence[Stage], keep: Sequence[int]
) -> tuple[int, ...] | None:
    if info.selected is None:
        return None
    if all(isinstance(s.rule, PreAggregator) and s.rule.preserves_indices for s in stages[:-1]):
        return tuple(int(keep[i]) for i in info.selected)
    return tuple(info.selected)


def run_reference(
    stages: Sequence[Stage],
    vectors: Sequence[torch.Tensor],
    f: int,
    *,
    start: torch.Tensor | None = None,
) -> AggregationResult:
    """Run a pipeline (pre-aggregators then one rule) on ``vectors`` in this process.

    Applies the non-finite policy first (see the module docstring). Raises
    :class:`AggregationError` on malformed inputs, when too few vectors remain for a stage, or
    when the aggregate overflows. ``start`` (the previous aggregate) is used by rules that start
    from it (centered clipping) and ignored by the others.
    """
    check_f(f)
    final = stages[-1]
    if isinstance(final.rule, PreAggregator):
        raise ValueError(
            f"{final.rule.name} is a pre-aggregator; end the pipeline with an aggregator"
        )
    spec = pipeline_spec(stages)
    X = as_matrix(vectors)
    n, d = X.shape
    check_start(start, d, X.dtype)
    excluded = screen_rows(X)
    log_exclusions(spec, excluded)
    keep = [i for i in range(n) if i not in excluded]
    f_eff = max(0, f - len(excluded))
    if not keep:
        raise AggregationError(f"{spec}: all {n} vectors were excluded ({_why(excluded)})")
    Xk = X[keep]
    for k, st in enumerate(stages[:-1]):
        check_count(st, Xk.shape[0], f_eff, n, excluded, stages[:k])
        assert isinstance(st.rule, PreAggregator)
        Xk = st.rule.reference(Xk, f_eff, st.config)
    check_count(final, Xk.shape[0], f_eff, n, excluded, stages[:-1])
    info = RuleInfo()
    if isinstance(final.rule, CoordinateRule):
        out = final.rule.columns(Xk, f_eff, final.config)
    else:
        out, info = final.rule.reference(
            Xk,
            f_eff,
            final.config,
            start.detach() if final.rule.uses_start and start is not None else None,
        )
    check_result(out, spec)
    report = AggregationReport(
        rule=spec,
        n=n,
        f=f,
        f_effective=f_eff,
        excluded=dict(excluded),
        selected=map_selected(info, stages, keep),
        iterations=info.iterations,
        notes=info.notes,
    )
    return AggregationResult(out, report)


def run_reference_pre(stage: Stage, vectors: Sequence[torch.Tensor], f: int) -> list[torch.Tensor]:
    """Apply one pre-aggregator on its own; non-finite vectors are excluded first (and logged),
    so output ``i`` corresponds to the ``i``-th *finite* input. Raises like :func:`run_reference`."""
    check_f(f)
    assert isinstance(stage.rule, PreAggregator)
    X = as_matrix(vectors)
    n = X.shape[0]
    excluded = screen_rows(X)
    log_exclusions(stage.spec, excluded)
    keep = [i for i in range(n) if i not in excluded]
    if not keep:
        raise AggregationError(f"{stage.spec}: all {n} vectors were excluded ({_why(excluded)})")
    f_eff = max(0, f - len(excluded))
    check_count(stage, len(keep), f_eff, n, excluded)
    out = stage.rule.reference(X[keep], f_eff, stage.config)
    check_result(out, stage.spec)
    return list(out.unbind(0))


def _why(excluded: Mapping[int, str]) -> str:
    return ", ".join(f"{i}: {r}" for i, r in sorted(excluded.items()))


def require_positive_int(name: str, value: Any, rule: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{rule}: {name} must be an int >= 1, got {value!r}")


def require_non_negative_int(name: str, value: Any, rule: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{rule}: {name} must be an int >= 0, got {value!r}")


def require_positive_float(name: str, value: Any, rule: str, *, allow_zero: bool = False) -> float:
    """Return ``value`` as a float if it is a finite number > 0 (>= 0 with ``allow_zero``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{rule}: {name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{rule}: {name} must be a finite number {bound}, got {value!r}")
    return v
