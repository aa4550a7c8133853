"""The log of zeroth-order rounds, their replay, and the choice between replay and state transfer.

A committed ``zo`` round is fully described by its number, its world size and the codes every
member sent (``world * ceil(bits * perturbations / 8)`` bytes): with the run's seed, lr and weight
decay, :func:`apply_round` turns them into the same update on any copy of the state that was at
that round's revision. So a peer that missed rounds ``since .. upto - 1`` and still holds the
state of revision ``since`` (its own last one, a checkpoint's, or a fresh joiner's initial model)
can catch up from a log of a few bytes per round instead of the whole state.

The cost of each way (:func:`replay_is_cheaper`): a transfer moves the tensors' bytes; a replay
moves the log's bytes and then regenerates one ``z`` over the whole model per nonzero estimate,
which takes about as long as applying it did on the source. Pure: nothing here touches the
network.

Log format on the wire (:func:`encode_rounds`): for each round, int64 round number, int32 world
size (both little-endian), then its ``world * row_bytes`` code bytes.
"""

from __future__ import annotations

import collections
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from isthmus.strategies.zo.math import ScalarCodec, Span, apply_update, perturbation_seed

__all__ = [
    "LoggedRound",
    "RoundLog",
    "apply_round",
    "decode_rounds",
    "encode_rounds",
    "nonzero_estimates",
    "replay_is_cheaper",
]

_HEAD = struct.Struct("<qi")


@dataclass(frozen=True)
class LoggedRound:
    """One committed round: its number, its world size and the all-gathered codes (``world``
    rows of ``row_bytes`` each, in rank order)."""

    round: int
    world: int
    codes: bytes


class RoundLog:
    """The last ``capacity`` committed rounds, contiguous (a gap clears what came before it: a
    replay needs every round of its span)."""

    def __init__(self, capacity: int) -> None:
        self._rounds: collections.deque[LoggedRound] = collections.deque(maxlen=capacity)

    def append(self, entry: LoggedRound) -> None:
        if self._rounds and self._rounds[-1].round != entry.round - 1:
            self._rounds.clear()
        self._rounds.append(entry)

    def span(self, since: int, upto: int) -> list[LoggedRound] | None:
        """Rounds ``since`` to ``upto - 1``, or None when the log does not hold all of them (or
        the span is empty)."""
        if not self._rounds or since >= upto:
            return None
        first, last = self._rounds[0].round, self._rounds[-1].round
        if since < first or upto - 1 > last:
            return None
        start = since - first
        return [self._rounds[i] for i in range(start, start + upto - since)]

    def __len__(self) -> int:
        return len(self._rounds)

    def __iter__(self) -> Iterator[LoggedRound]:
        return iter(self._rounds)


def encode_rounds(rounds: Sequence[LoggedRound]) -> bytes:
    """The rounds in the wire format (see the module docstring)."""
    return b"".join(_HEAD.pack(r.round, r.world) + r.codes for r in rounds)


def decode_rounds(raw: bytes, row_bytes: int) -> list[LoggedRound]:
    """Inverse of :func:`encode_rounds` for rows of ``row_bytes``. Raises ValueError for a
    truncated log or a world size below 1."""
    out: list[LoggedRound] = []
    pos = 0
    while pos < len(raw):
        if pos + _HEAD.size > len(raw):
            raise ValueError(f"round log truncated at byte {pos} of {len(raw)}")
        number, world = _HEAD.unpack_from(raw, pos)
        pos += _HEAD.size
        if world < 1:
            raise ValueError(f"round {number} of the log has world size {world}")
        end = pos + world * row_bytes
        if end > len(raw):
            raise ValueError(f"round {number} of the log is truncated")
        out.append(LoggedRound(number, world, raw[pos:end]))
        pos = end
    return out


def _rows(entry: LoggedRound, codec: ScalarCodec, per: int) -> list[list[int]]:
    row = codec.payload_bytes(per)
    if len(entry.codes) != entry.world * row:
        raise ValueError(
            f"round {entry.round}: {len(entry.codes)} code bytes for world {entry.world}, "
            f"expected {entry.world * row}"
        )
    flat = torch.tensor(list(entry.codes), dtype=torch.uint8)
    return [codec.unpack(flat[r * row : (r + 1) * row], per) for r in range(entry.world)]


def nonzero_estimates(rounds: Sequence[LoggedRound], codec: ScalarCodec, per: int) -> int:
    """How many ``z`` a replay of ``rounds`` regenerates (present, nonzero estimates)."""
    n = 0
    for entry in rounds:
        for row in _rows(entry, codec, per):
            for c in row:
                g = codec.decode(c)
                n += g is not None and g != 0.0
    return n


def apply_round(
    params: Sequence[torch.Tensor],
    keep: Sequence[int],
    entry: LoggedRound,
    codec: ScalarCodec,
    *,
    per: int,
    seed: int,
    lr: float,
    weight_decay: float,
    spans: Sequence[Span | None] | None = None,
) -> tuple[int, int]:
    """Apply one committed round to ``params`` in place (the live step and a replay both call
    this, so both do the same arithmetic; ``spans``: parameters that are shards, see
    :func:`~isthmus.strategies.zo.math.perturbation`). Returns (estimates applied, estimates in the round).
    Raises ValueError for codes of the wrong length or out of range."""
    rows = _rows(entry, codec, per)
    seeds = [
        perturbation_seed(seed, entry.round, rank, k)
        for rank in range(entry.world)
        for k in range(per)
    ]
    estimates = [codec.decode(c) for row in rows for c in row]
    n = apply_update(params, keep, seeds, estimates, lr=lr, weight_decay=weight_decay, spans=spans)
    return n, len(estimates)


def replay_is_cheaper(
    *,
    transfer_bytes: int,
    log_bytes: int,
    estimates: int,
    seconds_per_estimate: float,
    link_bytes_per_s: float,
) -> bool:
    """Whether replaying beats a state transfer: ``log_bytes / rate + estimates * seconds`` (send
    the log, regenerate every ``z``) against ``transfer_bytes / rate`` (send the tensors)."""
    replay_s = log_bytes / link_bytes_per_s + estimates * seconds_per_estimate
    return replay_s < transfer_bytes / link_bytes_per_s
