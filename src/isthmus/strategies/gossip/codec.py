"""Per-message codecs for compressed gossip, built from the compressors of ``reduce.compress``.

A gossip message is one peer's whole model sent to one neighbour, so compressing it needs a
*codec*: ``encode(flat) -> payload`` on the sender and a deterministic
``decode(payload, n) -> flat`` that the sender and every receiver apply to the same bytes (see
:mod:`.math.averaging`, which mixes in the CHOCO difference form so the network-wide mean
survives the compression error).

Only the block quantizers (``uint8``, ``int8``, ``fp8_e4m3``, ``fp8_e5m2``, ``int4``, ``e3m0``;
:mod:`isthmus.reduce.compress.formats`) are stateless codecs of a single vector. The other
compressors reduce a *sum across all peers* and keep state tied to it (error feedback, PowerSGD
warm starts, sketches merged by addition), which has no meaning for a point-to-point message;
:func:`codec_for` refuses them with an error naming the ones that work.
"""

from __future__ import annotations

from typing import Any

import torch

from isthmus.reduce.compress.formats import Packed, QuantFormat
from isthmus.reduce.compress.quantize import QuantizedAllReduce
from isthmus.strategies.gossip.math.averaging import Decode, Encode

__all__ = ["codec_for", "quantizer_codec"]

_QUANTIZERS = ("uint8", "int8", "fp8_e4m3", "fp8_e5m2", "int4", "e3m0")


def quantizer_codec(fmt: QuantFormat) -> tuple[Encode, Decode]:
    """``(encode, decode)`` quantizing a flat vector with ``fmt`` (one uint8 payload: codes then
    per-block scales). The decoded vector is float32; ``encode`` raises
    :class:`~isthmus.reduce.compress.NonFiniteError` for NaN/Inf input."""

    def encode(flat: torch.Tensor) -> torch.Tensor:
        return fmt.quantize(flat.reshape(-1)).data

    def decode(payload: torch.Tensor, n: int) -> torch.Tensor:
        return fmt.dequantize(Packed(data=payload, shape=(n,), numel=n, fmt=fmt))

    return encode, decode


def codec_for(compression: Any) -> tuple[Encode, Decode] | None:
    """The gossip codec for a compression setting: ``None``/``"none"`` gives ``None`` (plain
    messages); a quantizer spec string (``"int8"``, ``"int4:block=64"``) or a
    :class:`~isthmus.reduce.compress.QuantizedAllReduce` gives its quantizer's codec.

    Raises ``ValueError`` for any other compressor (top-k, rand-k, PowerSGD, sign, sketch) or an
    unknown spec, naming the quantizers that work.
    """
    if compression is None or compression == "none" or compression == "":
        return None
    if isinstance(compression, QuantizedAllReduce):
        return quantizer_codec(compression.fmt)
    if isinstance(compression, str):
        from isthmus.reduce.compress import make_compressor

        compression = make_compressor(compression)
        if isinstance(compression, QuantizedAllReduce):
            return quantizer_codec(compression.fmt)
    name = getattr(compression, "name", compression)
    raise ValueError(
        f"compression {name!r} cannot compress gossip messages: only the quantizers "
        f"({', '.join(_QUANTIZERS)}) encode one model for one neighbour; the others compress a "
        f"sum over all peers"
    )
