"""Compressors: reduce a tensor's sum over a :class:`~isthmus.comm.group.Group` in fewer bytes.

Every compressor implements :class:`Compressor` (see :mod:`.base`): ``reduce_sum`` returns the
sum over peers with identical bits everywhere, ``commit``/``rollback`` make or discard the state
changes of a round, ``predict_bytes`` tells what one reduce sends. Build one from a spec string
with :func:`make_compressor` (the CLI's ``--compression``).
"""

from __future__ import annotations

from collections.abc import Sequence

from .base import (
    Compressor,
    NoCompression,
    NonFiniteError,
    StagedState,
    all_finite,
    check_finite,
)
from .formats import QuantFormat, make_format
from .powersgd import PowerSGD, PowerSGDConfig
from .quantize import QuantizedAllReduce
from .sign import SignConfig, SignEF
from .sketch import SketchConfig, SketchReducer
from .sparse import FEEDBACKS, SparseCompressor, SparseConfig

__all__ = [
    "COMPRESSOR_NAMES",
    "Compressor",
    "NoCompression",
    "NonFiniteError",
    "PowerSGD",
    "PowerSGDConfig",
    "QuantFormat",
    "QuantizedAllReduce",
    "SignConfig",
    "SignEF",
    "SketchConfig",
    "SketchReducer",
    "SparseCompressor",
    "SparseConfig",
    "StagedState",
    "all_finite",
    "check_finite",
    "make_compressor",
    "make_format",
    "payload_bytes",
]

_QUANT = ("uint8", "int8", "fp8_e4m3", "fp8_e5m2", "int4", "e3m0")

#: every base name :func:`make_compressor` accepts
COMPRESSOR_NAMES = ("none", *_QUANT, "topk", "randk", "powersgd", "sign", "sketch")


def payload_bytes(spec: str, shape: int | Sequence[int], world: int) -> int:
    """Bytes one peer sends for one reduce of a tensor of ``shape`` (or numel) over ``world``
    peers with compressor ``spec``: ``make_compressor(spec).predict_bytes(shape, world)``."""
    return make_compressor(spec).predict_bytes(shape, world)


def _split_args(text: str, where: str) -> tuple[list[str], dict[str, str]]:
    positional: list[str] = []
    named: dict[str, str] = {}
    if not text:
        return positional, named
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            raise ValueError(f"empty argument in {where!r}")
        if "=" in item:
            k, _, v = item.partition("=")
            k, v = k.strip(), v.strip()
            if k in named:
                raise ValueError(f"argument {k!r} given twice in {where!r}")
            named[k] = v
        else:
            if named:
                raise ValueError(f"positional argument {item!r} after named ones in {where!r}")
            positional.append(item)
    return positional, named


def _check_names(named: dict[str, str], allowed: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(named) - set(allowed))
    if unknown:
        ok = ", ".join(allowed) if allowed else "none"
        raise ValueError(f"unknown option(s) {', '.join(unknown)} for {where!r}; valid: {ok}")


def _num(value: str, what: str, kind: type = float) -> float:
    try:
        return kind(value)
    except ValueError:
        want = "an integer" if kind is int else "a number"
        raise ValueError(f"{what} must be {want}, got {value!r}") from None


def _flag(value: str, what: str) -> bool:
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{what} must be 0 or 1, got {value!r}")


def make_compressor(spec: str) -> Compressor:
    """Build a compressor from a spec string. Grammar (whitespace ignored, case-insensitive)::

        spec     := base [ "+" feedback ]
        base     := NAME [ ":" args ]
        feedback := ("ef" | "ef21" | "econtrol") [ ":" args ]     (topk and randk only)
        args     := arg { "," arg }        arg := VALUE | KEY "=" VALUE

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

    Raises ValueError naming the problem (unknown name, unknown option, bad value) and listing
    what is valid.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"compression spec must be a non-empty string like 'int8', got {spec!r}")
    text = "".join(spec.split()).lower()
    base, plus, fb_text = text.partition("+")
    name, _, arg_text = base.partition(":")
    if name not in COMPRESSOR_NAMES:
        raise ValueError(
            f"unknown compression {name!r} in {spec!r}; use one of {', '.join(COMPRESSOR_NAMES)}"
        )
    pos, named = _split_args(arg_text, spec)
    if plus and name not in ("topk", "randk"):
        raise ValueError(
            f"error feedback ('+{fb_text}') applies to topk and randk only; {name!r} has none "
            f"(sign and sketch keep their own error, powersgd has ef=1)"
        )

    if name == "none":
        _check_names(named, (), spec)
        if pos:
            raise ValueError(f"'none' takes no arguments, got {spec!r}")
        return NoCompression()

    if name in _QUANT:
        _check_names(named, ("block",), spec)
        if pos:
            raise ValueError(f"{name} takes only block=N, got {spec!r}")
        block = int(_num(named.get("block", "128"), "block", int))
        return QuantizedAllReduce(make_format(name, block=block))

    if name in ("topk", "randk"):
        _check_names(named, ("ratio", "seed") if name == "randk" else ("ratio",), spec)
        if len(pos) > 1 or (pos and "ratio" in named):
            raise ValueError(f"give the ratio once, e.g. '{name}:0.01', got {spec!r}")
        if not pos and "ratio" not in named:
            raise ValueError(f"{name} needs a ratio, e.g. '{name}:0.01'")
        ratio = _num(pos[0] if pos else named["ratio"], f"{name} ratio")
        feedback, eta = "none", None
        if plus:
            fb_name, _, fb_args = fb_text.partition(":")
            if fb_name not in FEEDBACKS or fb_name == "none":
                raise ValueError(
                    f"unknown feedback {fb_name!r} in {spec!r}; use ef, ef21 or econtrol"
                )
            fpos, fnamed = _split_args(fb_args, spec)
            _check_names(fnamed, ("eta",) if fb_name == "econtrol" else (), spec)
            if fpos:
                raise ValueError(f"feedback options are named (eta=...), got {spec!r}")
            feedback = fb_name
            if "eta" in fnamed:
                eta = _num(fnamed["eta"], "eta")
        seed = int(_num(named.get("seed", "0"), "seed", int))
        return SparseCompressor(
            SparseConfig(kind=name, ratio=ratio, feedback=feedback, eta=eta, seed=seed)
        )

    if name == "powersgd":
        _check_names(named, ("rank", "min_rate", "warm", "ef", "eps", "seed", "seeds"), spec)
        if pos:
            raise ValueError(f"powersgd options are named, e.g. 'powersgd:rank=2', got {spec!r}")
        return PowerSGD(
            PowerSGDConfig(
                rank=int(_num(named.get("rank", "1"), "rank", int)),
                min_compression_rate=_num(named.get("min_rate", "2"), "min_rate"),
                warm_start=_flag(named.get("warm", "1"), "warm"),
                error_feedback=_flag(named.get("ef", "1"), "ef"),
                orthogonalization_epsilon=_num(named.get("eps", "0"), "eps"),
                seed=int(_num(named.get("seed", "0"), "seed", int)),
                seed_scheme=named.get("seeds", "key"),
            )
        )

    if name == "sign":
        _check_names(named, ("server_error",), spec)
        if pos:
            raise ValueError(f"sign takes only server_error=0|1, got {spec!r}")
        return SignEF(
            SignConfig(server_error=_flag(named.get("server_error", "1"), "server_error"))
        )

    # sketch
    _check_names(named, ("k", "rows", "width", "momentum", "seed"), spec)
    if len(pos) > 1 or (pos and "k" in named):
        raise ValueError(f"give k once, e.g. 'sketch:0.01', got {spec!r}")
    return SketchReducer(
        SketchConfig(
            k=_num(pos[0] if pos else named.get("k", "0.01"), "sketch k"),
            rows=int(_num(named.get("rows", "5"), "rows", int)),
            width=_num(named.get("width", "0.1"), "width"),
            momentum=_num(named.get("momentum", "0"), "momentum"),
            seed=int(_num(named.get("seed", "0"), "seed", int)),
        )
    )
