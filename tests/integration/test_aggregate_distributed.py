"""Sharded robust aggregation over real in-process Gloo groups: equal to the single-process
reference, bit-identical on every peer, coordinated non-finite exclusion, one all-reduce of bytes,
and clear errors (never a hang or a crash) when peers disagree."""

import math

import pytest
import torch

from isthmus import aggregate as agg
from isthmus.comm.group import wire_bytes
from isthmus.reduce.aggregate import attacks, sharded
from isthmus.reduce.aggregate.aggregator import AggregationError
from isthmus.testing import local_groups, run_parallel

# (spec, f) valid for 3 and 4 peers
SPECS = [
    ("mean", 1),
    ("median", 1),
    ("trimmed_mean", 1),
    ("meamed", 1),
    ("krum", 0),
    ("multi_krum", 0),
    ("multi_krum:m=2", 0),
    ("geometric_median", 1),
    ("centered_clipping:tau=1,iterations=3", 1),
    ("flag", 1),
    ("flag:r=2,lambda=0.3", 1),
    ("nnm+krum", 0),
    ("nnm+median", 1),
    ("bucketing:s=2,seed=3+mean", 0),
    ("clip+geometric_median", 1),
    ("clip:c=0.5+flag", 1),
]
FORGERS = [
    attacks.make_attack("sign_flip"),
    attacks.make_attack("ipm:tau=2"),
    attacks.make_attack("alie:tau=1.5"),
    attacks.make_attack("gaussian:sigma=30,seed=1"),
]
D = 37  # not a multiple of 3 or 4: shards of unequal length


@pytest.fixture(scope="module")
def groups():
    return {3: local_groups(3), 4: local_groups(4)}


def attacked_inputs(world: int, case: int, d: int = D, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + case)
    honest = [
        (torch.randn(d, generator=g, dtype=torch.float64) + 0.5).to(dtype) for _ in range(world - 1)
    ]
    byz = FORGERS[case % len(FORGERS)].forge(honest, 1)
    return attacks.inject(honest, byz, positions=[case % world])


def run_all(groups, vs, aggregator, f, start=None):
    return run_parallel(groups, lambda g: aggregator.distributed(g, vs[g.rank], f, start=start))


def catching(fn):
    """Wrap a per-rank body so an exception is returned instead of aborting the other ranks."""

    def body(g):
        try:
            return fn(g)
        except Exception as e:
            return e

    return body


def assert_matches_reference(outs, ref):
    first = outs[0]
    for o in outs[1:]:
        assert torch.equal(o.vector, first.vector)  # bit-identical on every peer
        assert o.report == first.report
    scale = max(1.0, float(ref.vector.abs().max()))
    assert torch.allclose(first.vector, ref.vector, rtol=1e-5, atol=1e-5 * scale)
    assert first.report.excluded == ref.report.excluded
    assert first.report.f_effective == ref.report.f_effective
    assert first.report.selected == ref.report.selected


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize(("case", "spec", "f"), [(i, s, f) for i, (s, f) in enumerate(SPECS)])
def test_sharded_equals_reference_under_attack(groups, world, case, spec, f):
    vs = attacked_inputs(world, case)
    a = agg.make_aggregator(spec)
    start = torch.linspace(-1, 1, D) if a.uses_start else None
    outs = run_all(groups[world], vs, a, f, start)
    assert_matches_reference(outs, a.aggregate(vs, f, start=start))


@pytest.mark.parametrize(("case", "spec", "f"), [(i, s, f) for i, (s, f) in enumerate(SPECS)])
def test_nan_from_one_peer_is_excluded_by_every_peer(groups, case, spec, f):
    vs = attacked_inputs(4, case)
    bad = (case + 1) % 4
    vs[bad] = vs[bad].clone()
    vs[bad][D - 1] = math.nan  # a coordinate owned by rank 3, not by the faulty peer
    a = agg.make_aggregator(spec)
    outs = run_all(groups[4], vs, a, f)
    for o in outs:
        assert torch.isfinite(o.vector).all()
        assert o.report.excluded == {bad: "contains NaN"}
    assert_matches_reference(outs, a.aggregate(vs, f))


def test_bulk_bytes_are_one_all_reduce(groups):
    d = 1000
    vs = attacked_inputs(4, 0, d=d)
    before = [dict(g.stats.by_op) for g in groups[4]]
    run_all(groups[4], vs, agg.make_aggregator("krum"), 0)
    for g, b in zip(groups[4], before, strict=True):
        sent = {op: g.stats.by_op.get(op, 0) - b.get(op, 0) for op in ("all_to_all", "all_gather")}
        n, p = 4, 4
        small = wire_bytes("all_gather", 5 * 8, n) + wire_bytes(
            "all_gather", (2 * n + p * p) * 8, n
        )
        bulk = sent["all_to_all"] + sent["all_gather"] - small
        assert bulk == wire_bytes("all_reduce", d * 4, n)  # 1000 divides by 4: no padding
        assert small == 3 * 40 + 3 * 24 * 8


def test_start_vector_and_float64_and_tiny_vectors(groups):
    vs = attacked_inputs(4, 2, dtype=torch.float64)
    a = agg.make_aggregator("cc:tau=0.5,iterations=2")
    start = torch.full((D,), 0.25, dtype=torch.float64)
    assert_matches_reference(run_all(groups[4], vs, a, 1, start), a.aggregate(vs, 1, start=start))
    tiny = attacked_inputs(4, 1, d=2)  # two shards of one coordinate, two empty shards
    for spec in ("median", "geometric_median", "nnm+multi_krum"):
        a = agg.make_aggregator(spec)
        f = 0 if "krum" in spec else 1
        assert_matches_reference(run_all(groups[4], tiny, a, f), a.aggregate(tiny, f))


def test_distributed_aggregate_function_and_world_of_one(groups):
    vs = attacked_inputs(3, 5)
    outs = run_parallel(
        groups[3], lambda g: agg.distributed_aggregate(g, vs[g.rank], "multi_krum", 0, m=2)
    )
    for o in outs:
        assert torch.allclose(o, agg.multi_krum(vs, 0, m=2), atol=1e-6)
    (solo,) = local_groups(1)
    v = torch.randn(5)
    assert torch.equal(agg.distributed_aggregate(solo, v, agg.median, 0), v)
    assert solo.stats.bytes_sent == 0


def test_disagreeing_peers_all_raise_instead_of_hanging_or_crashing():
    gs = local_groups(3, timeout_s=20)
    median = agg.make_aggregator("median")

    def lengths(g):
        return median.distributed(g, torch.ones(5 if g.rank == 0 else 4), 0)

    def specs(g):
        a = median if g.rank == 1 else agg.make_aggregator("mean")
        return a.distributed(g, torch.ones(4), 0)

    def shapes(g):
        return median.distributed(g, torch.ones(2, 2) if g.rank == 1 else torch.ones(4), 0)

    def starts(g):
        cc = agg.make_aggregator("cc")
        return cc.distributed(g, torch.ones(4), 1, start=torch.zeros(4) if g.rank == 2 else None)

    def all_nan(g):
        return median.distributed(g, torch.full((4,), math.nan), 1)

    expectations = [
        (lengths, ["disagree on the vector length"] * 3),
        (specs, ["disagree on the aggregator spec"] * 3),
        (
            shapes,
            ["peer(s) [1] passed an invalid", "shape (2, 2)", "peer(s) [1] passed an invalid"],
        ),
        (starts, ["disagree on the use of a start vector"] * 3),
        (all_nan, ["all 3 vectors were excluded"] * 3),
    ]
    for body, messages in expectations:
        errors = run_parallel(gs, catching(body))
        for err, msg in zip(errors, messages, strict=True):
            assert isinstance(err, AggregationError), (body.__name__, err)
            assert msg in str(err), (body.__name__, str(err))
    # the group is still usable afterwards: nobody was left inside a collective
    vs = attacked_inputs(3, 0)
    outs = run_all(gs, vs, median, 1)
    assert_matches_reference(outs, median.aggregate(vs, 1))


def test_too_few_after_exclusion_raises_on_every_peer(groups):
    vs = attacked_inputs(3, 4)
    vs[2] = torch.full((D,), math.inf)
    errors = run_parallel(
        groups[3], catching(lambda g: agg.make_aggregator("krum").distributed(g, vs[g.rank], 0))
    )
    assert all(
        isinstance(e, AggregationError) and "remain after excluding" in str(e) for e in errors
    )


def test_chunked_float64_work_matches_reference(groups, monkeypatch):
    # force several column chunks per shard (the default chunk is far larger than these vectors)
    monkeypatch.setattr(sharded, "_CHUNK", 4)
    vs = attacked_inputs(4, 6)
    start = torch.linspace(0, 1, D)
    for spec, f in (
        ("krum", 0),
        ("geometric_median", 1),
        ("nnm+median", 1),
        ("cc:tau=0.3", 1),
        ("clip+flag:r=2", 1),
    ):
        a = agg.make_aggregator(spec)
        assert_matches_reference(
            run_all(groups[4], vs, a, f, start), a.aggregate(vs, f, start=start)
        )
