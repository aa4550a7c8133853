"""Gossip over real in-process Gloo groups: equals the pure reference bit for bit, converges to the
exact mean, keeps the mean under compression; the global average is bitwise identical everywhere."""

from __future__ import annotations

import pytest
import torch

from isthmus.strategies.gossip.codec import codec_for
from isthmus.strategies.gossip.exchange import (
    global_average,
    gossip,
    gossip_step,
    send_copies,
    variance_corrected_gossip_step,
)
from isthmus.strategies.gossip.math.averaging import (
    gossip_reference,
    variance_corrected_gossip_reference,
)
from isthmus.strategies.gossip.math.sequence import OnePeerExponential, RandomMatching
from isthmus.strategies.gossip.math.topology import make_topology
from isthmus.strategies.gossip.math.variance import segment_variances
from isthmus.testing import local_groups, run_parallel

TRANSPORTS = ["p2p", "all_to_all"]


def _vectors(n: int, size: int = 257, dtype=torch.float32, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, generator=g) * (i + 1) + i).to(dtype) for i in range(n)]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    ("name", "n"), [("ring", 4), ("exponential", 5), ("barabasi_albert", 6), ("torus", 6)]
)
def test_one_step_equals_the_pure_reference_bit_for_bit(transport, name, n):
    top = make_topology(name, n, seed=2)
    xs = _vectors(n)
    groups = local_groups(n)
    out = run_parallel(
        groups, lambda g: gossip_step(g, xs[g.rank], top, exchange=7, transport=transport)
    )
    ref = gossip_reference(xs, top)
    for rank in range(n):
        assert torch.equal(out[rank], ref[rank]), rank
        # each neighbour gets one copy of the vector; Group counts the bytes
        assert groups[rank].stats.bytes_sent == top.degree(rank) * xs[rank].numel() * 4


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(("name", "n"), [("ring", 5), ("exponential", 6), ("barabasi_albert", 6)])
def test_repeated_gossip_converges_to_the_exact_mean(transport, name, n):
    # second eigenvalues 0.54, 0.20 and 0.67: 60 steps shrink a spread of ~10 below 1e-9
    top = make_topology(name, n, seed=1)
    xs = _vectors(n, size=64, dtype=torch.float64)
    mean = torch.stack(xs).mean(0)

    def body(g):
        x = xs[g.rank]
        for r in range(15):
            x = gossip(g, x, top, round=r, iterations=4, transport=transport)
        return x

    out = run_parallel(local_groups(n), body)
    for x in out:
        assert torch.allclose(x, mean, rtol=0, atol=1e-9)
    # the mean itself is preserved by every step, up to rounding
    assert torch.allclose(torch.stack(out).mean(0), mean, rtol=0, atol=1e-12)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_one_peer_exponential_averages_exactly_in_log2_n_steps(transport):
    n = 4
    seq = OnePeerExponential(n)
    xs = _vectors(n, size=33, dtype=torch.float64)
    out = run_parallel(
        local_groups(n),
        lambda g: gossip(g, xs[g.rank], seq, round=0, iterations=seq.period, transport=transport),
    )
    assert all(torch.equal(out[0], x) for x in out)  # pairs average to the same bits
    assert torch.allclose(out[0], torch.stack(xs).mean(0), rtol=0, atol=1e-12)


def test_ranks_without_partners_still_take_part_in_all_to_all():
    n = 5  # odd: one rank sits out of every random matching
    seq = RandomMatching(n, seed=4)
    xs = _vectors(n, size=16, dtype=torch.float64)
    out = run_parallel(
        local_groups(n), lambda g: gossip(g, xs[g.rank], seq, round=3, transport="all_to_all")
    )
    ref = gossip_reference(xs, seq.at(3))
    assert all(torch.equal(a, b) for a, b in zip(out, ref, strict=True))
    idle = [i for i in range(n) if seq.at(3).degree(i) == 0]
    assert len(idle) == 1 and torch.equal(out[idle[0]], xs[idle[0]])


def _fp16_codec():
    return (lambda x: x.to(torch.float16)), (lambda p, n: p.to(torch.float64))


def _sparse_codec():
    """Keeps the entries above the vector's median magnitude: a different length per rank, which
    exercises the size header."""

    def encode(x: torch.Tensor) -> torch.Tensor:
        idx = torch.nonzero(x.abs() > x.abs().median()).reshape(-1)
        return torch.cat([idx.to(torch.float64), x[idx].to(torch.float64)])

    def decode(p: torch.Tensor, n: int) -> torch.Tensor:
        k = p.numel() // 2
        out = torch.zeros(n, dtype=torch.float64)
        out[p[:k].long()] = p[k:]
        return out

    return encode, decode


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("codec", [_fp16_codec, _sparse_codec])
def test_compressed_gossip_matches_reference_and_preserves_the_mean(transport, codec):
    n = 5
    top = make_topology("ring", n)
    encode, decode = codec()
    xs = _vectors(n, size=40, dtype=torch.float64, seed=3)
    out = run_parallel(
        local_groups(n),
        lambda g: gossip_step(
            g,
            xs[g.rank],
            top,
            exchange=0,
            encode=encode,
            decode=decode,
            gamma=0.8,
            transport=transport,
        ),
    )
    ref = gossip_reference(xs, top, encode=encode, decode=decode, gamma=0.8)
    assert all(torch.equal(a, b) for a, b in zip(out, ref, strict=True))
    assert torch.allclose(torch.stack(out).mean(0), torch.stack(xs).mean(0), rtol=0, atol=1e-12)
    spread_before = torch.stack(xs).std(0).mean()
    assert torch.stack(out).std(0).mean() < spread_before


def test_global_average_is_bitwise_identical_on_every_rank():
    for world in (3, 4, 5):
        g = torch.Generator().manual_seed(world)
        # magnitudes spread over many decades so that summation order would change the bits
        xs = [
            torch.randn(10_001, generator=g) * 10.0 ** torch.randint(-4, 5, (10_001,), generator=g)
            for _ in range(world)
        ]
        out = run_parallel(
            local_groups(world), lambda grp, xs=xs: global_average(grp, xs[grp.rank])
        )
        assert all(torch.equal(out[0], o) for o in out)
        assert out[0].dtype == torch.float32
        stacked = torch.stack(xs).double()
        # float32 summation error scales with the largest term, not with the (smaller) result
        bound = world * 2.0**-23 * stacked.abs().max(0).values
        assert ((out[0].double() - stacked.mean(0)).abs() <= bound).all()
    (solo,) = local_groups(1)
    assert torch.equal(global_average(solo, torch.arange(3.0)), torch.arange(3.0))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_non_finite_vectors_are_never_sent(transport):
    n = 3
    xs = _vectors(n)
    xs[2][5] = float("nan")
    top = make_topology("ring", n)
    # short timeouts: the other ranks' operations stay pending inside Gloo until they time out,
    # and the groups cannot be destroyed before that. The first groups are held to the end: a
    # group destroyed with an operation pending blocks in its destructor, and the garbage
    # collector did that once while the second groups were meeting (their 1 s rendezvous timed
    # out)
    first = local_groups(n, timeout_s=1.0)
    with pytest.raises(ValueError, match="rank 2's vector contains NaN"):
        run_parallel(
            first, lambda g: gossip_step(g, xs[g.rank], top, exchange=0, transport=transport)
        )
    if transport == "p2p":
        return
    # 5 s, not 1: these groups meet while the first groups' pending operations still time out,
    # and on a loaded machine (make test's workers) three threads' rendezvous took over a second
    second = local_groups(n, timeout_s=5.0)
    with pytest.raises(ValueError, match="rank 2's vector contains NaN"):
        run_parallel(second, lambda g: global_average(g, xs[g.rank]))
    del first, second


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_codec_that_overflows_is_caught_by_sender_and_receivers(transport):
    n = 3
    top = make_topology("ring", n)
    xs = _vectors(n, dtype=torch.float64)
    xs[1] = xs[1] * 1e6  # beyond float16's range: only rank 1's payload holds Inf

    def encode(x):
        return x.to(torch.float16)

    def decode(p, size):
        return p.to(torch.float64)

    def body(g):
        try:
            gossip_step(
                g, xs[g.rank], top, exchange=0, encode=encode, decode=decode, transport=transport
            )
        except ValueError as e:
            return str(e)
        return "no error"

    msgs = run_parallel(local_groups(n), body)
    assert msgs[1].startswith("rank 1: decode(encode(vec)) contains NaN or Inf")
    assert msgs[0].startswith("vector received from rank 1 contains NaN or Inf")
    assert msgs[2].startswith("vector received from rank 1 contains NaN or Inf")


def test_variance_corrected_gossip_equals_reference_and_restores_neighbour_variance():
    n = 6
    top = make_topology("ring", n)
    sizes = [300, 120, 1]
    g = torch.Generator().manual_seed(8)
    # uncorrelated "freshly initialised" models: averaging them shrinks the variance
    xs = [
        torch.cat(
            [
                torch.randn(300, generator=g) * 0.2,
                torch.randn(120, generator=g) * 0.5,
                torch.randn(1, generator=g),
            ]
        )
        for _ in range(n)
    ]
    out = run_parallel(
        local_groups(n),
        lambda grp: variance_corrected_gossip_step(
            grp, xs[grp.rank], top, sizes, exchange=2, eps=0.0, transport="all_to_all"
        ),
    )
    ref = variance_corrected_gossip_reference(xs, top, sizes, eps=0.0)
    assert all(torch.equal(a, b) for a, b in zip(out, ref, strict=True))
    plain = gossip_reference(xs, top)
    for i in range(n):
        target = torch.stack([segment_variances(xs[j], sizes) for j in top.neighbors(i)]).mean(0)
        got = segment_variances(out[i], sizes)
        assert torch.allclose(got[:2], target[:2], rtol=1e-5)
        assert (segment_variances(plain[i], sizes)[:2] < 0.6 * target[:2]).all()
        assert out[i][-1] == plain[i][-1]  # a one-element layer is not rescaled


def test_global_average_leaves_out_non_contributors_and_stays_bitwise_identical():
    n = 4
    xs = _vectors(n, size=33)
    xs[3] = torch.full((33,), float("nan"))  # a stale rank's vector is never read
    out = run_parallel(
        local_groups(n), lambda g: global_average(g, xs[g.rank], contribute=g.rank != 3)
    )
    expect = (xs[0] + xs[1] + xs[2]) / 3
    for o in out:
        assert torch.equal(o, out[0])
        assert torch.allclose(o, expect, atol=1e-5)
    with pytest.raises(ValueError, match="no contributing rank"):
        run_parallel(local_groups(2), lambda g: global_average(g, xs[g.rank], contribute=False))


def test_send_copies_delivers_exact_copies_only_along_the_pairs():
    n = 5
    xs = _vectors(n, size=17)
    pairs = [(0, 3), (0, 4), (2, 1)]
    groups = local_groups(n)
    out = run_parallel(groups, lambda g: send_copies(g, xs[g.rank], pairs, exchange=11))
    assert torch.equal(out[3], xs[0]) and torch.equal(out[4], xs[0])
    assert torch.equal(out[1], xs[2])
    assert out[0] is None and out[2] is None
    assert [g.stats.bytes_sent for g in groups] == [2 * 17 * 4, 0, 17 * 4, 0, 0]
    solo = local_groups(1)[0]
    with pytest.raises(ValueError, match="one copy"):
        send_copies(solo, xs[0], [(1, 0), (2, 0)], exchange=0)
    with pytest.raises(ValueError, match="bad copy pair"):
        send_copies(solo, xs[0], [(0, 0)], exchange=0)


def test_quantized_gossip_through_the_codec_matches_the_reference():
    n = 4
    top = make_topology("ring", n)
    xs = _vectors(n, size=200)
    encode, decode = codec_for("int4")
    out = run_parallel(
        local_groups(n),
        lambda g: gossip_step(g, xs[g.rank], top, exchange=0, encode=encode, decode=decode),
    )
    ref = gossip_reference(xs, top, encode=encode, decode=decode)
    for a, b in zip(out, ref, strict=True):
        assert torch.equal(a, b)
    assert torch.allclose(torch.stack(out).mean(0), torch.stack(xs).mean(0), atol=1e-4)
