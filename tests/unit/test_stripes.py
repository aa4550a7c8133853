"""Striping's spans (comm/stripes.py), in one process."""

from __future__ import annotations

import itertools

import pytest

from isthmus.comm.stripes import MIN_STRIPE_BYTES, spans


def test_spans_cover_in_order_and_respect_the_minimum():
    for numel, k in [(0, 4), (1, 8), (10_000, 3), (1 << 20, 16), (1 << 20, 1), (12_345, 7)]:
        cuts = spans(numel, 4, k)
        assert cuts[0][0] == 0 and cuts[-1][1] == numel
        assert all(a[1] == b[0] for a, b in itertools.pairwise(cuts))
        assert 1 <= len(cuts) <= k
        lengths = [hi - lo for lo, hi in cuts]
        assert max(lengths) - min(lengths) <= 1
        if len(cuts) > 1:
            assert min(lengths) * 4 >= MIN_STRIPE_BYTES
    assert len(spans(1 << 20, 4, 16)) == 16  # 4 MiB: every stripe is used
    assert len(spans(MIN_STRIPE_BYTES // 4 * 3, 4, 16)) == 3  # short: fewer spans
    with pytest.raises(ValueError):
        spans(10, 4, 0)
