"""Gossip exchange helpers in one process: edge tags, argument errors, the quantizer codec."""

from __future__ import annotations

import pytest
import torch

from isthmus.strategies.gossip.codec import codec_for
from isthmus.strategies.gossip.exchange import (
    MAX_ITERS_PER_ROUND,
    edge_tag,
    gossip,
    gossip_step,
)
from isthmus.strategies.gossip.math.topology import (
    make_topology,
)
from isthmus.testing import local_groups


def test_edge_tags_are_unique_per_exchange_and_edge():
    world = 6
    tags = {
        edge_tag(e, s, d, world, part)
        for e in range(3 * MAX_ITERS_PER_ROUND)
        for s in range(world)
        for d in range(world)
        for part in (0, 1)
        if s != d
    }
    assert len(tags) == 3 * MAX_ITERS_PER_ROUND * world * (world - 1) * 2
    assert all(0 <= t < 2**31 for t in tags)
    assert 0 <= edge_tag(10**12, 5, 4, world, 1) < 2**31
    with pytest.raises(ValueError):
        edge_tag(0, 6, 0, world)


def test_argument_errors():
    (solo,) = local_groups(1)
    top = make_topology("ring", 3)
    with pytest.raises(ValueError, match="topology has 3 ranks but the group has 1"):
        gossip_step(solo, torch.ones(2), top, exchange=0)
    with pytest.raises(ValueError, match="iterations"):
        gossip(solo, torch.ones(2), make_topology("ring", 1), round=0, iterations=0)
    with pytest.raises(ValueError, match="both encode and decode"):
        gossip_step(solo, torch.ones(2), make_topology("ring", 1), exchange=0, encode=lambda x: x)
    with pytest.raises(ValueError, match="floating-point"):
        gossip_step(solo, torch.ones(2, dtype=torch.int64), make_topology("ring", 1), exchange=0)
    assert torch.equal(
        gossip(solo, torch.ones(2, 2), make_topology("ring", 1), round=0), torch.ones(2, 2)
    )


def test_quantizer_codec_round_trip_and_refusals():
    encode, decode = codec_for("int8:block=32")
    x = torch.randn(100, generator=torch.Generator().manual_seed(0))
    payload = encode(x)
    # 128 padded one-byte codes plus four fp32 scales, against 400 bytes of fp32
    assert payload.dtype == torch.uint8 and payload.numel() == 128 + 4 * 4
    y = decode(payload, 100)
    assert y.shape == (100,) and (y - x).abs().max() < x.abs().max() / 127
    assert torch.equal(decode(payload, 100), y)  # deterministic: senders and receivers agree
    assert codec_for(None) is None and codec_for("none") is None
    for spec in ("topk:0.1", "powersgd", "sign"):
        with pytest.raises(ValueError, match="quantizers"):
            codec_for(spec)
