"""Compressor specs: the registries behind ``--compression`` and :func:`make_compressor`.

A compressor spec follows the one grammar of :mod:`isthmus.spec`::

    spec     := base [ "+" feedback ]
    base     := NAME [ ":" args ]
    feedback := ("ef" | "ef21" | "econtrol") [ ":" args ]     (topk and randk only)

Each entry of :data:`COMPRESSORS` is a compressor family with its options dataclass, each entry
of :data:`ERROR_FEEDBACKS` a feedback kind; values are coerced through those dataclasses' type
hints, so ``int8:block=64``, a scenario's ``compression = "int8:block=64"`` and the Python API
are checked by the same code.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from isthmus.spec import Entry, Part, Registry, SpecError, parse

from .compressor import Compressor, NoCompression
from .formats import make_format
from .powersgd import PowerSGD, PowerSGDConfig
from .quantize import QuantConfig, QuantizedAllReduce
from .sign import SignConfig, SignEF
from .sketch import SketchConfig, SketchReducer
from .sparse import (
    FEEDBACKS,
    EControlConfig,
    RandKConfig,
    SparseCompressor,
    SparseConfig,
    TopKConfig,
)

T = TypeVar("T")

__all__ = [
    "COMPRESSORS",
    "COMPRESSOR_NAMES",
    "ERROR_FEEDBACKS",
    "Feedback",
    "make_compressor",
    "payload_bytes",
]


@dataclass(frozen=True)
class Feedback:
    """An error feedback chosen by a ``+feedback`` part: its kind and EControl's ``eta``."""

    kind: str = "none"
    eta: float | None = None


def _quantized(name: str, config: QuantConfig) -> Compressor:
    return QuantizedAllReduce(make_format(name, block=config.block))


def _sparse(kind: str, config: TopKConfig, *, feedback: Feedback | None = None) -> Compressor:
    fb = feedback or Feedback()
    assert config.ratio is not None  # TopKConfig refuses a spec without one
    seed = config.seed if isinstance(config, RandKConfig) else 0
    return SparseCompressor(
        SparseConfig(kind=kind, ratio=config.ratio, feedback=fb.kind, eta=fb.eta, seed=seed)
    )


COMPRESSORS: Registry[Compressor] = Registry("compression")
"""Every compressor family by spec name; ``make_compressor`` builds from it."""

COMPRESSORS.add("none", build=NoCompression, help="plain fp32 all-reduce")
for _name in ("uint8", "int8", "fp8_e4m3", "fp8_e5m2", "int4", "e3m0"):
    COMPRESSORS.add(
        _name,
        config=QuantConfig,
        build=functools.partial(_quantized, _name),
        help="quantized all-reduce with bit parity",
    )
for _name, _config, _which in (
    ("topk", TopKConfig, "the largest"),
    ("randk", RandKConfig, "a seeded random"),
):
    COMPRESSORS.add(
        _name,
        config=_config,
        build=functools.partial(_sparse, _name),
        positional=("ratio",),
        help=f"keep {_which} fraction R of the entries; feedback +ef, +ef21, +econtrol",
    )
COMPRESSORS.add(
    "powersgd",
    config=PowerSGDConfig,
    build=PowerSGD,
    # the spec's short names for PowerSGDConfig's fields (they also appear in its canonical name)
    option_aliases={
        "min_rate": "min_compression_rate",
        "warm": "warm_start",
        "ef": "error_feedback",
        "eps": "orthogonalization_epsilon",
        "seeds": "seed_scheme",
    },
    help="rank-r low-rank approximation with error feedback",
)
COMPRESSORS.add("sign", config=SignConfig, build=SignEF, help="1-bit signs with error feedback")
COMPRESSORS.add(
    "sketch",
    config=SketchConfig,
    build=SketchReducer,
    positional=("k",),
    help="count sketch returning a fraction K of the coordinates",
)

#: every base name :func:`make_compressor` accepts
COMPRESSOR_NAMES = tuple(COMPRESSORS.names())

ERROR_FEEDBACKS: Registry[Feedback] = Registry("feedback")
"""The ``+feedback`` kinds of the sparsifiers (see :mod:`.sparse` for the math)."""


def _feedback(kind: str, config: EControlConfig | None = None) -> Feedback:
    return Feedback(kind, config.eta if config is not None else None)


for _kind in FEEDBACKS:
    if _kind != "none":  # "none" is the absence of a "+feedback" part, not a spec
        ERROR_FEEDBACKS.add(
            _kind,
            config=EControlConfig if _kind == "econtrol" else None,
            build=functools.partial(_feedback, _kind),
        )

_WITH_FEEDBACK = ("topk", "randk")


def _resolve_and_build(registry: Registry[T], part: Part, spec: str, **context: Any) -> T:
    """Build one part of ``spec`` (errors name the whole spec); a value the component refuses
    becomes a :class:`SpecError` too."""
    entry: Entry[T]
    entry, config = registry.resolve(part, spec=spec)
    assert entry.build is not None  # every entry of these registries has a builder
    try:
        if entry.config_cls is None:
            return entry.build(**context)
        return entry.build(config, **context)
    except SpecError:
        raise
    except ValueError as e:  # a value the family itself refuses (a ratio above 1, an odd block)
        raise SpecError(str(e), spec=spec) from None


def make_compressor(spec: str) -> Compressor:
    """Build a compressor from a spec string (grammar in the module docstring; whitespace is
    ignored, names and keys are case-insensitive).

    Names and options (defaults in brackets):

    * ``none``: plain all-reduce.
    * ``uint8``, ``int8``, ``fp8_e4m3``, ``fp8_e5m2``, ``int4``, ``e3m0``: quantized all-reduce
      with bit parity; option ``block=N`` [128] (values per scale).
    * ``topk:R``, ``randk:R``: keep a fraction R in (0, 1] of the entries (``ratio=R`` works too);
      randk also takes ``seed=S`` [0]. Feedback: ``+ef`` (EF14), ``+ef21``,
      ``+econtrol[:eta=E]`` [eta = R].
    * ``powersgd``: options ``rank`` [1], ``min_rate`` [2], ``warm`` [1], ``ef`` [1],
      ``eps`` [0], ``seed`` [0], ``seeds`` = key|torch [key].
    * ``sign``: 1-bit with error feedback; option ``server_error`` [1].
    * ``sketch[:K]``: count sketch returning a fraction K [0.01] of coordinates (``k=K``);
      options ``rows`` [5], ``width`` [0.1] (columns as a fraction of the size),
      ``momentum`` [0], ``seed`` [0].

    Examples: ``"int4:block=64"``, ``"topk:0.01+ef21"``, ``"randk:0.05+econtrol:eta=0.02"``,
    ``"powersgd:rank=2"``, ``"sketch:0.01,rows=3,width=0.05"``. ``make_compressor(c.name)``
    rebuilds an equivalent compressor ``c``.

    Raises :class:`~isthmus.spec.SpecError` (a ValueError) naming the spec and the problem: an
    unknown name or option (with the closest valid one), a value of the wrong type, a feedback
    on a family without one, or a value the compressor refuses.
    """
    base, *rest = parse(spec, what="compression spec")
    if not rest:
        return _resolve_and_build(COMPRESSORS, base, spec)
    name = COMPRESSORS.lookup(base.name, spec=spec).name
    if name not in _WITH_FEEDBACK:
        raise SpecError(
            f"error feedback ('+{rest[0].text}') applies to topk and randk only; {name!r} has "
            f"none (sign and sketch keep their own error, powersgd has ef=1)",
            spec=spec,
        )
    if len(rest) > 1:
        raise SpecError("a sparsifier takes one error feedback, not several", spec=spec)
    feedback = _resolve_and_build(ERROR_FEEDBACKS, rest[0], spec)
    return _resolve_and_build(COMPRESSORS, base, spec, feedback=feedback)


def payload_bytes(spec: str, shape: int | Sequence[int], world: int) -> int:
    """Bytes one peer sends for one reduce of a tensor of ``shape`` (or numel) over ``world``
    peers with compressor ``spec``: ``make_compressor(spec).predict_bytes(shape, world)``."""
    return make_compressor(spec).predict_bytes(shape, world)
