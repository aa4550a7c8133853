"""Striping collectives over K real in-process Gloo groups: every peer ends with the same bits for
plain and quantized all-reduce, and peers with different connection counts are refused."""

from __future__ import annotations

import pytest
import torch

from isthmus.reduce.compress.formats import make_format
from isthmus.reduce.compress.quantize import quantized_all_reduce, quantized_all_reduce_reference
from isthmus.testing import local_groups, run_parallel


def _inputs(world: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    # mixed magnitudes, so that a different summation order would show in the bits
    return [torch.randn(n, generator=g) * torch.logspace(-3, 3, n) for _ in range(world)]


def _all_reduce(world: int, k: int, xs: list[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
    groups = local_groups(world, connections=k)
    assert all(len(g.pgs) == k for g in groups)

    def body(g):
        t = xs[g.rank].clone()
        g.all_reduce(t, "sum")
        gathered = g.all_gather_flat(xs[g.rank][:50_000])
        ex = g.exchange(xs[g.rank][: 30_000 * world])
        return t, gathered, ex, g.stats.bytes_sent

    return run_parallel(groups, body)


def test_striped_all_reduce_gather_exchange_same_bits_on_every_peer():
    world, n = 3, 300_000  # 1.2 MB: 16 stripes of 75 KB
    xs = _inputs(world, n)
    one = _all_reduce(world, 1, xs)
    many = _all_reduce(world, 16, xs)
    for out in (one, many):
        for t, gathered, _ex, _ in out[1:]:
            assert torch.equal(t, out[0][0])  # parity: every peer has the same bits
            assert torch.equal(gathered, out[0][1])
    # the moves without arithmetic are exact and the same as over one connection
    assert torch.equal(many[0][1], torch.cat([x[:50_000] for x in xs]))
    for r in range(world):
        assert torch.equal(many[r][2], one[r][2])
        assert torch.equal(
            many[r][2].view(world, -1)[0], xs[0][: 30_000 * world].view(world, -1)[r]
        )
        assert many[r][3] == one[r][3]  # the same bytes are accounted
    # the sum is right; whether its bits equal one connection's depends on Gloo's ring segments
    assert torch.allclose(many[0][0], sum(xs), rtol=1e-5, atol=1e-3)


def test_striped_all_reduce_differs_from_one_connection_by_rounding_only():
    """Gloo reduces each span as a buffer of its own, so its ring sums some elements in another
    order than over one connection (measured: the bits differ); the difference stays within the
    rounding of a sum of three terms. Peers must therefore all use the same ``connections``."""
    world, n = 3, 300_000
    xs = _inputs(world, n)
    one, many = _all_reduce(world, 1, xs), _all_reduce(world, 4, xs)
    bound = 2 * torch.finfo(torch.float32).eps * sum(x.abs() for x in xs)
    assert bool(((one[0][0] - many[0][0]).abs() <= bound).all())


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_striped_quantized_all_reduce_matches_reference_bits(name):
    world, n = 3, 200_000
    fmt = make_format(name, block=64)
    xs = _inputs(world, n)
    expected = quantized_all_reduce_reference(xs, fmt)
    groups = local_groups(world, connections=4)
    out = run_parallel(groups, lambda g: quantized_all_reduce(g, xs[g.rank], fmt))
    for y in out:
        assert torch.equal(y, expected)


def test_peers_with_different_connections_are_refused_naming_the_setting():
    import functools
    import uuid
    from concurrent.futures import ThreadPoolExecutor

    import torch.distributed as dist

    from isthmus.comm.group import build_process_group
    from isthmus.comm.stripes import connect_stripes

    store = dist.PrefixStore(f"t/{uuid.uuid4().hex}/", dist.HashStore())

    def build(rank: int):
        connect = functools.partial(
            build_process_group, rank=rank, world=2, timeout_s=10, hostname="127.0.0.1"
        )
        try:
            return connect_stripes(connect, store, 1 + 2 * rank)  # 1 and 3
        except ValueError as e:
            return e

    with ThreadPoolExecutor(2) as ex:
        out = list(ex.map(build, range(2)))
    assert all(isinstance(e, ValueError) and "connections" in str(e) for e in out)


def test_peers_of_two_protocol_versions_are_refused_naming_both():
    import functools
    import uuid
    from concurrent.futures import ThreadPoolExecutor

    import torch.distributed as dist

    from isthmus.comm.group import build_process_group
    from isthmus.comm.stripes import connect_stripes
    from isthmus.coordinator.wire import PROTOCOL_VERSION, ProtocolMismatch

    store = dist.PrefixStore(f"t/{uuid.uuid4().hex}/", dist.HashStore())
    versions = [PROTOCOL_VERSION, PROTOCOL_VERSION + 1]

    def build(rank: int):
        connect = functools.partial(
            build_process_group, rank=rank, world=2, timeout_s=10, hostname="127.0.0.1"
        )
        try:
            return connect_stripes(connect, store, 2, wishes=[1, 0], protocol=versions[rank])
        except ProtocolMismatch as e:
            return e

    with ThreadPoolExecutor(2) as ex:
        out = list(ex.map(build, range(2)))
    old, new = versions
    assert str(out[0]) == (
        f"a member of this epoch speaks isthmus protocol {new}, this peer speaks {old}; "
        "upgrade one of them"
    )
    assert f"protocol {old}, this peer speaks {new}" in str(out[1])


def test_the_handshake_agrees_on_the_largest_wishes():
    import functools
    import uuid
    from concurrent.futures import ThreadPoolExecutor

    import torch.distributed as dist

    from isthmus.comm.group import build_process_group
    from isthmus.comm.stripes import connect_stripes

    store = dist.PrefixStore(f"t/{uuid.uuid4().hex}/", dist.HashStore())
    wishes = [[1, 0], [0, 3]]

    def build(rank: int):
        connect = functools.partial(
            build_process_group, rank=rank, world=2, timeout_s=10, hostname="127.0.0.1"
        )
        _pg, stripes, agreed = connect_stripes(connect, store, 2, wishes=wishes[rank])
        return len(stripes), agreed

    with ThreadPoolExecutor(2) as ex:
        assert list(ex.map(build, range(2))) == [(1, [1, 3]), (1, [1, 3])]
