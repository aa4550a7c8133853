"""Token buckets and the coordinator's limits (pure: the clock is passed in)."""

from __future__ import annotations

import pytest

from isthmus.coordinator.limits import Buckets, Limits, TokenBucket


def test_a_bucket_allows_its_burst_then_its_rate() -> None:
    b = TokenBucket(rate=2.0, burst=3.0, now=0.0)
    assert [b.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert not b.take(0.4)  # 0.8 of a token
    assert b.take(0.5)
    assert not b.take(0.5)
    assert [b.take(100.0) for _ in range(4)] == [True, True, True, False], "refills to burst"


def test_buckets_are_per_key_and_bounded_in_number() -> None:
    bs = Buckets(rate=1.0, burst=1.0, max_keys=3)
    assert bs.take("flooder", 0.0) and not bs.take("flooder", 0.0)
    assert bs.take("peer", 0.0), "one key's flood leaves the others alone"
    for i in range(100):
        bs.take(f"spoof{i}", 0.0)
    assert len(bs) == 3


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"limits\.max_body_bytes"):
        Limits(max_body_bytes=0)
