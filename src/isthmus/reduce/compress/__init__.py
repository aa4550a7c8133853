"""Compressors: reduce a tensor's sum over a :class:`~isthmus.comm.group.Group` in fewer bytes.

Every compressor implements :class:`Compressor` (see :mod:`.compressor`): ``reduce_sum``
returns the sum over peers with identical bits everywhere, ``commit``/``rollback`` make or
discard the state changes of a round, ``predict_bytes`` tells what one reduce sends. Build one
from a spec string with :func:`make_compressor` (the CLI's ``--compression``); the families and
their options are the entries of :data:`COMPRESSORS` (see :mod:`.registry`).

compress belongs to reduce's layer: it may import comm (its ``Group``) and the floor. Never
imports checkpoint, runconfig, strategies, lab, integrations, run or cli (docs/ARCHITECTURE.md, "Layers";
tools/structure.py checks it).
"""

from __future__ import annotations

from .compressor import (
    Compressor,
    NoCompression,
    NonFiniteError,
    StagedState,
    all_finite,
    check_finite,
)
from .formats import QuantFormat, make_format
from .powersgd import PowerSGD, PowerSGDConfig
from .quantize import QuantConfig, QuantizedAllReduce
from .registry import (
    COMPRESSOR_NAMES,
    COMPRESSORS,
    ERROR_FEEDBACKS,
    make_compressor,
    payload_bytes,
)
from .sign import SignConfig, SignEF
from .sketch import SketchConfig, SketchReducer
from .sparse import EControlConfig, RandKConfig, SparseCompressor, SparseConfig, TopKConfig

__all__ = [
    "COMPRESSORS",
    "COMPRESSOR_NAMES",
    "ERROR_FEEDBACKS",
    "Compressor",
    "EControlConfig",
    "NoCompression",
    "NonFiniteError",
    "PowerSGD",
    "PowerSGDConfig",
    "QuantConfig",
    "QuantFormat",
    "QuantizedAllReduce",
    "RandKConfig",
    "SignConfig",
    "SignEF",
    "SketchConfig",
    "SketchReducer",
    "SparseCompressor",
    "SparseConfig",
    "StagedState",
    "TopKConfig",
    "all_finite",
    "check_finite",
    "make_compressor",
    "make_format",
    "payload_bytes",
]
