"""Robust aggregators, single process: each rule's defining property, the non-finite policy,
input checks and the spec parser."""

import logging
import math

import pytest
import torch

from isthmus import aggregate as agg
from isthmus.reduce.aggregate import attacks
from isthmus.reduce.aggregate.aggregator import AggregationError

ALL_RULES = [
    "mean",
    "median",
    "trimmed_mean",
    "meamed",
    "krum",
    "multi_krum",
    "geometric_median",
    "centered_clipping",
    "flag",
    "nnm+krum",
    "bucketing:s=2+median",
    "clip+geometric_median",
]


def honest_vectors(n: int, d: int, seed: int, center: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(d, generator=g) + center for _ in range(n)]


# -- coordinate-wise rules ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "forge", [attacks.sign_flip, attacks.inner_product_manipulation, attacks.a_little_is_enough]
)
def test_median_stays_within_honest_range_per_coordinate(forge):
    honest = honest_vectors(5, 300, seed=1)
    byz = [v * 1e6 for v in forge(honest, 2)]  # scaled up so any leak would show
    vs = attacks.inject(honest, byz, positions=[0, 3])
    H = torch.stack(honest)
    for rule in (agg.median, agg.trimmed_mean, agg.meamed):
        out = rule(vs, 2)
        assert torch.all(out >= H.min(dim=0).values - 1e-6), rule.__name__
        assert torch.all(out <= H.max(dim=0).values + 1e-6), rule.__name__


def test_median_of_even_count_is_the_midpoint():
    vs = [
        torch.tensor([1.0, -4.0]),
        torch.tensor([4.0, 0.0]),
        torch.tensor([2.0, 8.0]),
        torch.tensor([3.0, 2.0]),
    ]
    assert agg.median(vs, 1).tolist() == [2.5, 1.0]


def test_trimmed_mean_drops_exactly_the_f_extremes_per_coordinate():
    vs = [
        torch.tensor([1.0, 100.0]),
        torch.tensor([2.0, -50.0]),
        torch.tensor([3.0, 7.0]),
        torch.tensor([1e9, 5.0]),
        torch.tensor([-1e9, 6.0]),
    ]
    # coordinate 0: drop -1e9 and 1e9 -> mean(1, 2, 3); coordinate 1: drop -50 and 100 -> mean(5, 6, 7)
    assert agg.trimmed_mean(vs, 1).tolist() == [2.0, 6.0]
    assert agg.trimmed_mean(vs, 0).tolist() == pytest.approx(agg.mean(vs).tolist())


def test_meamed_averages_the_values_closest_to_the_median():
    vs = [
        torch.tensor([0.0]),
        torch.tensor([1.0]),
        torch.tensor([2.0]),
        torch.tensor([10.0]),
        torch.tensor([2.5]),
    ]
    # median 2; the 3 closest are 2, 2.5, 1
    assert agg.meamed(vs, 2).tolist() == [pytest.approx(5.5 / 3)]


# -- Krum --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "forge", [attacks.sign_flip, attacks.inner_product_manipulation, attacks.a_little_is_enough]
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_krum_picks_an_honest_vector_n7_f2(forge, seed):
    # ALIE with tau=1.5 sits ~sqrt(3) sigma from each honest vector against sqrt(2) sigma between
    # honest ones; the dimension is high enough for that gap to beat the sampling noise
    honest = honest_vectors(5, 20000, seed=seed)
    byz = forge(honest, 2)
    vs = attacks.inject(honest, byz, positions=[1, 4])
    res = agg.make_aggregator("krum").aggregate(vs, 2)
    assert res.report.selected is not None and res.report.selected[0] not in (1, 4)
    assert any(torch.equal(res.vector, h) for h in honest)
    mk = agg.make_aggregator("multi_krum:m=3").aggregate(vs, 2)
    assert mk.report.selected is not None and not set(mk.report.selected) & {1, 4}


def test_alie_at_the_papers_z_max_does_fool_krum():
    # the attack's point (Baruch et al.): a shift of z_max ~ 0.57 sigma for n=7, f=2 makes the two
    # identical forged vectors the most central pair. This pins the known weakness down.
    honest = honest_vectors(5, 20000, seed=0)
    byz = attacks.a_little_is_enough(honest, 2, tau=None)
    vs = attacks.inject(honest, byz, positions=[1, 4])
    assert agg.make_aggregator("krum").aggregate(vs, 2).report.selected[0] in (1, 4)


def test_krum_needs_2f_plus_3_vectors():
    with pytest.raises(AggregationError, match=r"n >= 2f \+ 3.*got 6"):
        agg.krum(honest_vectors(6, 4, seed=0), 2)


def test_multi_krum_m_is_clamped_and_noted():
    vs = honest_vectors(5, 8, seed=3)
    res = agg.Aggregator(agg.multi_krum, m=9).aggregate(vs, 1)
    assert len(res.report.selected) == 5 and "clamped" in res.report.notes[0]
    assert torch.allclose(res.vector, agg.mean(vs), atol=1e-6)


# -- geometric median, centered clipping, flag ------------------------------------------------


def test_geometric_median_resists_one_huge_outlier():
    honest = honest_vectors(6, 50, seed=4, center=3.0)
    vs = [*honest, torch.full((50,), 1e8)]
    H = torch.stack(honest)
    gm = agg.geometric_median(vs, 1)
    spread = torch.linalg.vector_norm(H - H.mean(dim=0), dim=1).max()
    assert torch.linalg.vector_norm(gm - H.mean(dim=0)) < spread
    assert torch.linalg.vector_norm(agg.mean(vs) - H.mean(dim=0)) > 1e6


def test_geometric_median_of_collinear_points_is_the_middle_one():
    vs = [torch.tensor([0.0, 0.0]), torch.tensor([1.0, 0.0]), torch.tensor([100.0, 0.0])]
    out = agg.geometric_median(vs, 1, nu=1e-6, max_iter=1000, tol=0.0)
    assert out.tolist() == pytest.approx([1.0, 0.0], abs=1e-3)


@pytest.mark.parametrize("iterations", [1, 3])
def test_centered_clipping_bounds_one_vectors_influence(iterations):
    honest = honest_vectors(6, 40, seed=5)
    start = torch.stack(honest).mean(dim=0) + 0.1
    tau, n = 2.0, 7
    clean = agg.centered_clipping(
        [*honest, honest[0]], 1, start=start, tau=tau, iterations=iterations
    )
    for scale in (1e3, 1e9):
        evil = agg.centered_clipping(
            [*honest, torch.full((40,), scale)], 1, start=start, tau=tau, iterations=iterations
        )
        # v -> mean_i proj_{B(v, tau)}(x_i) is 1-Lipschitz in v and swapping one input moves the
        # mean of projections by at most 2 tau / n, so L iterations differ by at most 2 L tau / n
        assert torch.linalg.vector_norm(evil - clean) <= 2 * tau / n * iterations + 1e-4
        assert torch.isfinite(evil).all()
    # with a radius larger than every distance, one iteration from zero is the plain mean
    assert torch.allclose(agg.centered_clipping(honest, 0, tau=1e6), agg.mean(honest), atol=1e-6)


def test_flag_recovers_the_honest_direction_against_orthogonal_and_huge_outliers():
    g = torch.Generator().manual_seed(6)
    u = torch.randn(200, generator=g)
    u /= u.norm()
    honest = [u + 0.05 * torch.randn(200, generator=g) for _ in range(7)]
    byz = [1e6 * torch.randn(200, generator=g) for _ in range(2)]
    out = agg.flag([*honest, *byz], 2)
    target = torch.stack(honest).mean(dim=0)

    def cos(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(a @ b / (a.norm() * b.norm()))

    assert cos(out, target) > 0.99
    assert abs(cos(agg.mean([*honest, *byz]), target)) < 0.5  # the plain mean is lost
    assert 5.0 < float(out.norm()) <= 9.0  # built from unit vectors: at most n / r


def test_flag_regularised_and_higher_rank_stay_finite_and_close_to_the_span():
    vs = honest_vectors(6, 30, seed=7)
    for r, lam in ((1, 0.5), (3, 0.0), (3, 1.0)):
        out = agg.flag(vs, 1, r=r, lam=lam)
        assert torch.isfinite(out).all()
        X = torch.stack(vs).T.double()
        residual = out.double() - X @ torch.linalg.lstsq(X, out.double()).solution
        assert residual.norm() < 1e-4 * max(1.0, float(out.norm()))


# -- pre-aggregators ---------------------------------------------------------------------------


def test_nnm_averages_nearest_neighbours_and_blunts_an_outlier():
    vs = [torch.tensor([0.0]), torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([100.0])]
    out = agg.nnm(vs, 1)  # each vector -> mean of its 3 nearest (itself included)
    assert [v.item() for v in out] == pytest.approx([1.0, 1.0, 1.0, 103.0 / 3])


def test_bucketing_is_seeded_and_averages_buckets():
    vs = [torch.tensor([float(i)]) for i in range(7)]
    a = agg.bucketing(vs, 1, s=2, seed=3)
    assert len(a) == 4
    assert [v.item() for v in a] == [v.item() for v in agg.bucketing(vs, 1, s=2, seed=3)]
    assert [v.item() for v in a] != [v.item() for v in agg.bucketing(vs, 1, s=2, seed=4)]
    assert sum(v.item() * (2 if k < 3 else 1) for k, v in enumerate(a)) == pytest.approx(21.0)


def test_clip_caps_norms_at_c_or_the_median_norm():
    vs = [torch.tensor([3.0, 4.0]), torch.tensor([0.6, 0.8]), torch.tensor([30.0, 40.0])]
    out = agg.clip(vs, 0, c=2.0)
    assert [round(float(v.norm()), 5) for v in out] == [2.0, 1.0, 2.0]
    out = agg.clip(vs, 0)  # median norm = 5
    assert [round(float(v.norm()), 5) for v in out] == [5.0, 1.0, 5.0]
    assert torch.allclose(out[2], torch.tensor([3.0, 4.0]))


def test_pipelines_compose_pre_aggregators():
    vs = honest_vectors(7, 16, seed=8)
    nk = agg.make_aggregator("nnm+krum").aggregate(vs, 2)
    assert torch.allclose(nk.vector, agg.krum(agg.nnm(vs, 2), 2))
    assert nk.report.selected is not None
    assert agg.compose(agg.nnm, agg.krum) == agg.make_aggregator("nnm+krum")
    assert agg.Aggregator("krum", pre=["nnm"]) == agg.make_aggregator("nnm+krum")
    b = agg.make_aggregator("bucketing:s=2,seed=5+median")
    assert torch.equal(b(vs, 1), agg.median(agg.bucketing(vs, 1, s=2, seed=5), 1))
    with pytest.raises(AggregationError, match="bucketing left 4"):
        b(vs, 2)  # 4 buckets are too few for f=2


# -- non-finite policy -------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ALL_RULES)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_one_non_finite_vector_is_excluded_by_every_rule(spec, bad, caplog):
    vs = honest_vectors(8, 12, seed=9)
    vs[5] = vs[5].clone()
    vs[5][7] = bad  # a single poisoned coordinate
    a = agg.make_aggregator(spec)
    with caplog.at_level(logging.WARNING, logger="isthmus.aggregate"):
        res = a.aggregate(vs, 2)
    assert torch.isfinite(res.vector).all()
    assert res.report.excluded == {5: "contains NaN" if math.isnan(bad) else "contains Inf"}
    assert res.report.f_effective == 1 and res.report.used == (0, 1, 2, 3, 4, 6, 7)
    assert "excluded 1 vector" in caplog.text
    # the same as aggregating the finite ones with the reduced budget
    rest = [v for i, v in enumerate(vs) if i != 5]
    assert torch.allclose(res.vector, a(rest, 1), atol=1e-6)


def test_all_non_finite_raises_and_names_the_reasons():
    vs = [torch.full((3,), math.nan), torch.tensor([1.0, math.inf, 0.0])]
    with pytest.raises(
        AggregationError, match=r"all 2 vectors were excluded.*0: contains NaN.*1: contains Inf"
    ):
        agg.mean(vs)


def test_exclusions_count_against_f_and_too_few_left_raises():
    vs = honest_vectors(5, 4, seed=10)
    vs[0] = torch.full((4,), math.nan)
    res = agg.make_aggregator("median").aggregate(vs, 2)  # 4 left, f_effective 1: 4 > 2
    assert res.report.f_effective == 1 and torch.isfinite(res.vector).all()
    vs[1] = vs[2] = torch.full((4,), math.inf)
    # krum with n=5, f=1 is fine, but 3 exclusions leave 2 vectors where f_effective=0 needs 3
    with pytest.raises(
        AggregationError, match=r"only 2 of 5 remain after excluding.*0: contains NaN"
    ):
        agg.krum(vs, 1)


def test_overflowing_aggregate_raises_instead_of_returning_inf():
    vs = [torch.full((2,), 3e38), torch.full((2,), 3e38)]
    with pytest.raises(AggregationError, match="overflowed"):
        agg.mean(vs)


def test_huge_float64_vector_whose_norm_overflows_is_excluded():
    vs = [
        torch.ones(3, dtype=torch.float64),
        torch.full((3,), 1e300, dtype=torch.float64),
        2 * torch.ones(3, dtype=torch.float64),
    ]
    res = agg.make_aggregator("mean").aggregate(vs, 1)
    assert res.report.excluded == {1: "squared norm overflows float64"}
    assert res.vector.tolist() == [1.5, 1.5, 1.5]


# -- input checks, options, registry -----------------------------------------------------------


@pytest.mark.parametrize(
    ("vectors", "match"),
    [
        ([], "no vectors"),
        ([torch.ones(2, 2)], "1-D"),
        ([torch.ones(3), torch.ones(4)], "all must match"),
        ([torch.ones(3, dtype=torch.int64)], "floating-point"),
        ([torch.ones(3), torch.ones(3, dtype=torch.float64)], "all must match"),
        (torch.ones(3, 3), "list of 1-D"),
    ],
)
def test_malformed_inputs_are_rejected(vectors, match):
    with pytest.raises(AggregationError, match=match):
        agg.median(vectors, 0)


def test_bad_f_and_bad_start_are_rejected():
    vs = honest_vectors(3, 4, seed=11)
    with pytest.raises(ValueError, match=r"f .* must be an int >= 0"):
        agg.median(vs, -1)
    with pytest.raises(AggregationError, match=r"start .* contains NaN"):
        agg.centered_clipping(vs, 1, start=torch.full((4,), math.nan))
    with pytest.raises(AggregationError, match="length 4"):
        agg.centered_clipping(vs, 1, start=torch.ones(5))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: agg.geometric_median([torch.ones(2)], 0, nu=-1), "nu must be a finite number > 0"),
        (lambda: agg.centered_clipping([torch.ones(2)], 0, tau=0), "tau must be"),
        (
            lambda: agg.centered_clipping([torch.ones(2)], 0, iterations=0),
            "iterations must be an int >= 1",
        ),
        (lambda: agg.multi_krum([torch.ones(2)], 0, m=0), "m must be an int >= 1"),
        (lambda: agg.flag([torch.ones(2)], 0, r=0), "r must be an int >= 1"),
        (lambda: agg.bucketing([torch.ones(2)], 0, s=0), "s must be an int >= 1"),
        (lambda: agg.clip([torch.ones(2)], 0, c=math.inf), "c must be a finite number"),
    ],
)
def test_invalid_options_say_what_to_do(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_make_aggregator_parses_specs_and_round_trips():
    a = agg.make_aggregator(" NNM + Multi-Krum:m=3 ")
    assert a.spec == "nnm+multi_krum:m=3"
    assert agg.make_aggregator(a.spec) == a
    assert agg.make_aggregator("cc:tau=10").spec == "centered_clipping:tau=10.0"
    assert agg.make_aggregator("cc:tau=10").uses_start
    assert agg.make_aggregator("flag:r=2,lambda=0.5").stages[-1].config.lam == 0.5
    assert agg.make_aggregator("gm").spec == "geometric_median"
    assert agg.make_aggregator("multi_krum:m=none").spec == "multi_krum"
    assert agg.make_aggregator("krum").with_options().spec == "krum"
    assert agg.make_aggregator("multi_krum").with_options(m=2).spec == "multi_krum:m=2"
    assert set(agg.available()) >= {"mean", "krum", "flag", "nnm", "bucketing", "clip"}


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("krumm", r"unknown aggregator 'krumm' \(did you mean 'krum'\?\)"),
        ("", "non-empty"),
        ("median:f=2", "unknown option 'f' for median; valid: none"),
        ("cc:tau", "write 'tau' as KEY=VALUE"),
        ("cc:tau=abc", "tau: 'cc:tau=abc': must be a number"),
        ("multi_krum:m=2.5", "m: .* must be an integer"),
        ("flag:lamda=1", r"unknown option 'lamda' for flag \(did you mean 'lambda'\?\)"),
        ("mkrum:n=2", "unknown option 'n' for multi_krum; valid: m$"),
        ("cc:tau=1,tau=2", "given twice"),
        ("nnm", "pre-aggregator and cannot come last"),
        ("krum+median", "can only come last"),
        ("nnm+", "empty part in aggregator spec"),
    ],
)
def test_make_aggregator_rejects_bad_specs_clearly(spec, match):
    with pytest.raises(ValueError, match=match):
        agg.make_aggregator(spec)


def test_compose_accepts_functions_names_and_aggregators():
    vs = honest_vectors(7, 6, seed=12)
    c = agg.compose(agg.clip, "nnm", agg.make_aggregator("multi_krum:m=2"))
    assert c.spec == "clip+nnm+multi_krum:m=2"
    assert torch.allclose(c(vs, 1), agg.multi_krum(agg.nnm(agg.clip(vs, 1), 1), 1, m=2))
    with pytest.raises(TypeError, match="cannot build an aggregation stage"):
        agg.compose(print, agg.krum)


def test_aggregator_registry_entries_are_the_rules_options():
    from isthmus.reduce.aggregate import AGGREGATORS

    entry, config = AGGREGATORS.resolve("CC:tau=2")
    assert entry.name == "centered_clipping" and entry.config_cls is agg.CenteredClippingOptions
    assert config == agg.CenteredClippingOptions(tau=2.0)
    assert AGGREGATORS.resolve("flag:lambda=0.5")[1].lam == 0.5
    assert set(agg.available()) == set(AGGREGATORS.names())
    assert agg.available()["nnm"].startswith("pre-aggregator")
