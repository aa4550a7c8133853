"""Aggregator pipelines: the registry of rules (:data:`AGGREGATORS`), their specs in the one
grammar of :mod:`isthmus.spec`, and the one object callers hold.

A spec names zero or more pre-aggregators and one aggregator, joined by ``+``, each optionally
followed by ``:key=value,key=value``::

    mean | median | trimmed_mean | meamed | krum | multi_krum:m=3 | geometric_median:nu=0.1
    cc:tau=10,iterations=3 | flag:r=2,lambda=0.1 | nnm+krum | bucketing:s=2,seed=7+median
    clip:c=5+cc:tau=10

:func:`make_aggregator` turns a spec into an :class:`Aggregator` (the CLI's ``--aggregator`` uses
it); :func:`compose` and ``Aggregator(rule, pre=[...])`` build the same from names, the public
functions (``compose(nnm, krum)``) or stages. An :class:`Aggregator` runs in one process
(:meth:`Aggregator.aggregate`, the reference) or across the peers of a
:class:`~isthmus.comm.group.Group` (:meth:`Aggregator.distributed`, sharded; see
:mod:`isthmus.reduce.aggregate.sharded`), with the same results up to float rounding.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from isthmus.comm.group import Group
from isthmus.reduce.aggregate import clipping, coordinate, flagagg, geomed, multikrum, preagg
from isthmus.reduce.aggregate.aggregator import (
    AggregationResult,
    CoordinateRule,
    GramRule,
    PreAggregator,
    RuleDef,
    Stage,
    make_stage,
    pipeline_spec,
    run_reference,
)
from isthmus.reduce.aggregate.sharded import run_sharded
from isthmus.spec import Part, Registry, parse

__all__ = [
    "AGGREGATORS",
    "Aggregator",
    "available",
    "compose",
    "distributed_aggregate",
    "make_aggregator",
]

_FINAL_RULES = (
    coordinate.MEAN,
    coordinate.MEDIAN,
    coordinate.TRIMMED_MEAN,
    coordinate.MEAMED,
    multikrum.KRUM,
    multikrum.MULTI_KRUM,
    geomed.GEOMETRIC_MEDIAN,
    clipping.CENTERED_CLIPPING,
    flagagg.FLAG,
)
_PRE_AGGREGATORS = (preagg.NNM, preagg.BUCKETING, preagg.CLIP)
_ALIASES = {
    "mean": ("average", "avg"),
    "trimmed_mean": ("tm", "trmean"),
    "multi_krum": ("multikrum", "mkrum"),
    "geometric_median": ("gm", "geomed", "rfa"),
    "centered_clipping": ("cc",),
    "flag": ("fa", "flag_aggregator"),
    "bucketing": ("bucket",),
}
# option spellings accepted in specs besides the dataclass field names ("lambda" is a keyword)
_OPTION_ALIASES = {"flag": {"lambda": "lam"}}


def _help(rule: RuleDef) -> str:
    kind = "pre-aggregator" if isinstance(rule, PreAggregator) else "aggregator"
    opts = ", ".join(fld.name for fld in dataclasses.fields(rule.config))
    return f"{kind}, {rule.requirement}" + (f"; options: {opts}" if opts else "")


AGGREGATORS: Registry[Stage] = Registry("aggregator")
"""Every rule and pre-aggregator by spec name; an entry's config is the rule's options
dataclass and its builder makes the :class:`Stage`."""

for _rule in (*_FINAL_RULES, *_PRE_AGGREGATORS):
    AGGREGATORS.add(
        _rule.name,
        config=_rule.config,
        build=functools.partial(Stage, _rule),
        aliases=_ALIASES.get(_rule.name, ()),
        option_aliases=_OPTION_ALIASES.get(_rule.name),
        help=_help(_rule),
    )

_FUNCTIONS: dict[Callable[..., Any], CoordinateRule | GramRule | PreAggregator] = {
    coordinate.mean: coordinate.MEAN,
    coordinate.median: coordinate.MEDIAN,
    coordinate.trimmed_mean: coordinate.TRIMMED_MEAN,
    coordinate.meamed: coordinate.MEAMED,
    multikrum.krum: multikrum.KRUM,
    multikrum.multi_krum: multikrum.MULTI_KRUM,
    geomed.geometric_median: geomed.GEOMETRIC_MEDIAN,
    clipping.centered_clipping: clipping.CENTERED_CLIPPING,
    flagagg.flag: flagagg.FLAG,
    preagg.nnm: preagg.NNM,
    preagg.bucketing: preagg.BUCKETING,
    preagg.clip: preagg.CLIP,
}

StageLike = str | Callable[..., Any] | Stage


def available() -> dict[str, str]:
    """Every registered name with its kind and requirement, e.g. ``{"krum": "aggregator, n >= 2f + 3"}``
    (aliases not included; for help texts)."""
    return {name: AGGREGATORS.lookup(name).help for name in AGGREGATORS.names()}


def _parse_stage(part: Part, spec: str) -> Stage:
    """One ``NAME[:key=value,...]`` part of an aggregator spec as a :class:`Stage`; raises
    :class:`~isthmus.spec.SpecError` naming the spec for an unknown name or option or a bad
    value."""
    entry, config = AGGREGATORS.resolve(part, spec=spec)
    assert entry.build is not None  # every entry builds its stage
    return entry.build(config)


def _to_stage(part: StageLike, options: Mapping[str, Any]) -> Stage:
    if isinstance(part, Stage):
        if options:
            return make_stage(part.rule, {**_options_of(part), **options})
        return part
    if isinstance(part, str):
        if "+" in part:
            raise ValueError(f"{part!r} is a pipeline; use make_aggregator() for specs with '+'")
        (one,) = parse(part, what="aggregator spec")
        stage = _parse_stage(one, part)
        return make_stage(stage.rule, {**_options_of(stage), **options}) if options else stage
    if callable(part) and part in _FUNCTIONS:
        return make_stage(_FUNCTIONS[part], dict(options))
    raise TypeError(
        f"cannot build an aggregation stage from {part!r}; pass a name such as 'krum', "
        f"one of the functions of isthmus.aggregate, or a Stage"
    )


def _options_of(stage: Stage) -> dict[str, Any]:
    return {fld.name: getattr(stage.config, fld.name) for fld in dataclasses.fields(stage.config)}


class Aggregator:
    """A pipeline of pre-aggregators followed by one aggregation rule.

    ``Aggregator("krum", pre=["nnm"])``, ``Aggregator(multi_krum, m=3)`` and
    ``make_aggregator("nnm+multi_krum:m=3")`` are the usual ways to build one; ``**options`` go to
    the final rule. Raises ``ValueError`` for unknown names or options, for a pre-aggregator in
    last place or an aggregator in ``pre``.
    """

    def __init__(self, rule: StageLike, *, pre: Sequence[StageLike] = (), **options: Any) -> None:
        stages = [_to_stage(p, {}) for p in pre] + [_to_stage(rule, options)]
        self._stages = _checked(stages)

    @classmethod
    def from_stages(cls, stages: Sequence[Stage]) -> Aggregator:
        """Build from already validated stages (pre-aggregators first, the rule last)."""
        agg = cls.__new__(cls)
        agg._stages = _checked(list(stages))
        return agg

    @property
    def stages(self) -> tuple[Stage, ...]:
        return self._stages

    @property
    def spec(self) -> str:
        """Canonical spec string; ``make_aggregator(agg.spec)`` rebuilds an equal aggregator."""
        return pipeline_spec(self._stages)

    @property
    def uses_start(self) -> bool:
        """True when the final rule starts from the previous aggregate (pass it as ``start``)."""
        final = self._stages[-1].rule
        return isinstance(final, GramRule) and final.uses_start

    def with_options(self, **options: Any) -> Aggregator:
        """A copy whose final rule has ``options`` replaced. Raises ``ValueError`` for unknown ones."""
        *pre, final = self._stages
        return Aggregator.from_stages([*pre, _to_stage(final, options)])

    def aggregate(
        self, vectors: Sequence[torch.Tensor], f: int, *, start: torch.Tensor | None = None
    ) -> AggregationResult:
        """Reference run in this process; see :func:`~isthmus.reduce.aggregate.aggregator.run_reference`
        for the non-finite policy and errors."""
        return run_reference(self._stages, vectors, f, start=start)

    def __call__(
        self, vectors: Sequence[torch.Tensor], f: int, *, start: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Same as :meth:`aggregate` but return only the aggregate."""
        return self.aggregate(vectors, f, start=start).vector

    def distributed(
        self, group: Group, vector: torch.Tensor, f: int, *, start: torch.Tensor | None = None
    ) -> AggregationResult:
        """Sharded run over ``group`` (one vector per peer, every peer calls it); see
        :func:`~isthmus.reduce.aggregate.sharded.run_sharded` for costs, guarantees and errors."""
        return run_sharded(group, vector, self._stages, f, start=start)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Aggregator) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash(self.spec)

    def __repr__(self) -> str:
        return f"make_aggregator({self.spec!r})"


def _checked(stages: list[Stage]) -> tuple[Stage, ...]:
    if not stages:
        raise ValueError("an aggregator pipeline needs at least one rule")
    *pre, final = stages
    if isinstance(final.rule, PreAggregator):
        raise ValueError(
            f"{final.rule.name} is a pre-aggregator and cannot come last; "
            f"follow it with an aggregator, e.g. '{final.rule.name}+krum'"
        )
    for st in pre:
        if not isinstance(st.rule, PreAggregator):
            raise ValueError(
                f"{st.rule.name} is an aggregator and can only come last; pre-aggregators are "
                f"{', '.join(r.name for r in _PRE_AGGREGATORS)}"
            )
    return tuple(stages)


def make_aggregator(spec: str | Aggregator) -> Aggregator:
    """Parse a spec such as ``"nnm+multi_krum:m=3"`` (see the module docstring).

    Raises ``ValueError`` naming the problem for an unknown name (with a suggestion), an unknown
    or malformed option, or a misplaced pre-aggregator.
    """
    if isinstance(spec, Aggregator):
        return spec
    return Aggregator.from_stages(
        [_parse_stage(p, spec) for p in parse(spec, what="aggregator spec")]
    )


def compose(*parts: StageLike | Aggregator) -> Aggregator:
    """Chain pre-aggregators and a final rule: ``compose(nnm, krum)``, ``compose("clip:c=5", "cc")``.

    An :class:`Aggregator` part contributes all of its stages. Raises ``ValueError`` like
    :class:`Aggregator`.
    """
    stages: list[Stage] = []
    for part in parts:
        if isinstance(part, Aggregator):
            stages.extend(part.stages)
        elif isinstance(part, str) and "+" in part:
            stages.extend(make_aggregator(part).stages)
        else:
            stages.append(_to_stage(part, {}))
    return Aggregator.from_stages(stages)


def distributed_aggregate(
    group: Group,
    vector: torch.Tensor,
    rule: str | Aggregator | Callable[..., Any],
    f: int,
    *,
    start: torch.Tensor | None = None,
    **options: Any,
) -> torch.Tensor:
    """Aggregate this peer's ``vector`` with every other peer's, sharded (no central server).

    ``rule`` is a spec (``"nnm+krum"``), an :class:`Aggregator` or a public rule function;
    ``options`` replace the final rule's options. Every peer of ``group`` must call this together
    with the same rule, ``f`` and vector length. Returns the aggregate, bit-identical on every
    peer; use :meth:`Aggregator.distributed` to also get the report. Raises
    :class:`~isthmus.reduce.aggregate.aggregator.AggregationError` (on every peer alike) for too few
    usable vectors or disagreeing peers, :class:`~isthmus.comm.group.CollectiveError` when a peer
    fails.
    """
    if isinstance(rule, Aggregator):
        agg = rule
    elif isinstance(rule, str):
        agg = make_aggregator(rule)
    else:
        agg = Aggregator(rule)
    if options:
        agg = agg.with_options(**options)
    return agg.distributed(group, vector, f, start=start).vector
