"""How a stale ``zo`` peer catches up: :class:`Replayer`, the session's
:class:`~isthmus.comm.state.CatchUp` for a :class:`~isthmus.strategies.zo.ZO` strategy.

A peer that missed rounds replays them from a source's
:class:`~isthmus.strategies.zo.replay.RoundLog` when that costs less than a state transfer (the
choice and the exchange: :mod:`isthmus.strategies.zo.replay`, :mod:`isthmus.comm.transfer`). A
rank of an island is resynced by transfer, shard by shard, and installs no replayer.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from isthmus.strategies.zo.replay import (
    decode_rounds,
    encode_rounds,
    nonzero_estimates,
    replay_is_cheaper,
)

__all__ = ["Replayer"]


class Replayer:
    """:class:`~isthmus.comm.state.CatchUp` for :class:`~isthmus.strategies.zo.ZO`: a stale
    peer replays the rounds it missed from the source's
    :class:`~isthmus.strategies.zo.replay.RoundLog` (the choice and the exchange are described in
    :mod:`isthmus.strategies.zo.replay` and :mod:`isthmus.comm.transfer`). The replay runs on
    copies of the parameters (one extra copy of the model while catching up); the source waits
    for the destination's verdict while it replays (a point-to-point wait: the session's
    ``late_s`` plus the message's bytes at 1 Mbit/s)."""

    _WISH: ClassVar[dict[str, int]] = {"transfer": 0, "replay": 1, "auto": 2}

    def __init__(self, zo: Any) -> None:
        self.zo = zo
        self._covers = frozenset([f"model/{zo.names[i]}" for i in zo.keep] + ["meta/step"])

    def revision(self) -> int:
        assert self.zo.session is not None
        return self.zo.session.revision

    def wish(self) -> int:
        return self._WISH[self.zo.config.catch_up]

    def covers(self) -> frozenset[str]:
        return self._covers

    def offer(self, since: int, upto: int, transfer_bytes: int, wish: int) -> bytes | None:
        zo = self.zo
        rounds = zo.log.span(since, upto)
        if wish == 0 or rounds is None:
            return None
        raw = encode_rounds(rounds)
        if wish == 2 and not replay_is_cheaper(
            transfer_bytes=transfer_bytes,
            log_bytes=len(raw),
            estimates=nonzero_estimates(rounds, zo.codec, zo.config.perturbations),
            seconds_per_estimate=zo.seconds_per_estimate(),
            link_bytes_per_s=zo.config.link_mbps * 1e6 / 8,
        ):
            return None
        return raw

    def replay(self, log: bytes, since: int, upto: int) -> dict[str, torch.Tensor]:
        zo = self.zo
        rounds = decode_rounds(log, zo.codec.payload_bytes(zo.config.perturbations))
        if [r.round for r in rounds] != list(range(since, upto)):
            raise ValueError(f"the log does not hold exactly rounds {since} to {upto - 1}")
        copies = [p.detach().clone() for p in zo.params]
        with torch.no_grad():
            for entry in rounds:
                zo._apply_to(copies, entry)
        out = {f"model/{zo.names[i]}": copies[i] for i in zo.keep}
        out["meta/step"] = zo.global_step + len(rounds)
        return out

    def adopt(self, log: bytes) -> None:
        zo = self.zo
        rounds = decode_rounds(log, zo.codec.payload_bytes(zo.config.perturbations))
        for entry in rounds:
            zo.log.append(entry)
        zo.replays += 1
        zo.replayed_rounds += len(rounds)
        zo.replay_bytes += len(log)
