"""What islands accept of a strategy's reducer, and where a block quantizer keeps an unsharded
peer's bits (pure: the distributed reductions are tests/integration/test_island_reduce_gloo.py)."""

from __future__ import annotations

import pytest
import torch

from isthmus.reduce.compress.formats import make_format
from isthmus.reduce.reducer import Reducer
from isthmus.strategies.sharded import island_refusal, quantized_span_exact
from isthmus.testing import local_groups
from support.sessions import FakeRound


def test_quantized_span_exact_follows_the_block_grid() -> None:
    fmt = make_format("int8", block=128)
    assert quantized_span_exact(0, 4096, 8192, 2, fmt)  # two rows of 4096 over two ranks
    assert quantized_span_exact(4096, 8192, 8192, 2, fmt)
    assert not quantized_span_exact(0, 4000, 8192, 2, fmt)  # ends inside a block
    assert not quantized_span_exact(0, 128, 8192, 2, fmt)  # one block: its layout shrinks it
    assert quantized_span_exact(0, 10, 10, 2, fmt)  # the whole tensor


def test_what_islands_refuse_names_why() -> None:
    assert island_refusal(Reducer()) == ""
    assert island_refusal(Reducer(compression="int4")) == ""
    assert island_refusal(Reducer(aggregator="trimmed_mean", byzantine_f=1)) == ""
    assert "whole tensors" in island_refusal(Reducer(compression="topk:0.1+ef"))
    assert "whole tensors" in island_refusal(Reducer(compression="powersgd:rank=2"))
    why = island_refusal(Reducer(aggregator="krum", byzantine_f=1))
    assert "krum" in why and "inner products" in why
    assert "clip" in island_refusal(Reducer(aggregator="clip+median", byzantine_f=1))


def test_a_peer_that_contributes_nothing_has_no_weight_for_a_robust_rule_to_refuse() -> None:
    """DiLoCo's catch-up round contributes nothing with weight 0: a robust reducer lets it take
    part (it refuses weights only on a vote that counts)."""
    (g,) = local_groups(1)
    t = torch.tensor([0.1, 0.7])
    reducer = Reducer(aggregator="trimmed_mean", byzantine_f=0)
    assert reducer.mean(FakeRound(g), [("t", t)], contribute=False, weight=0.0) is None
    with pytest.raises(ValueError, match="one vote per peer"):
        reducer.mean(FakeRound(g), [("t", t)], contribute=True, weight=2.0)
