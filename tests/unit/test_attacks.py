"""Byzantine attacks: the formulas, seeding, the label flip and the factory."""

import math
from statistics import NormalDist

import pytest
import torch

from isthmus.reduce.aggregate import attacks

HONEST = [
    torch.tensor([1.0, 2.0, -3.0]),
    torch.tensor([3.0, 2.0, -1.0]),
    torch.tensor([2.0, 5.0, -2.0]),
]
MEAN = torch.tensor([2.0, 3.0, -2.0])


def test_sign_flip_and_ipm_are_scaled_negated_means():
    sf = attacks.sign_flip(HONEST, 2)
    assert len(sf) == 2 and all(torch.allclose(v, -MEAN) for v in sf)
    assert torch.allclose(attacks.sign_flip(HONEST, 1, scale=3.0)[0], -3 * MEAN)
    assert torch.allclose(attacks.inner_product_manipulation(HONEST, 1)[0], -2 * MEAN)
    assert torch.allclose(attacks.inner_product_manipulation(HONEST, 1, tau=0.1)[0], -0.1 * MEAN)
    assert attacks.sign_flip(HONEST, 0) == []


def test_alie_is_mean_plus_tau_unbiased_std():
    sigma = torch.tensor([1.0, math.sqrt(3.0), 1.0])  # sample std, n - 1 in the denominator
    out = attacks.a_little_is_enough(HONEST, 3)
    assert len(out) == 3
    assert torch.allclose(out[0], MEAN + 1.5 * sigma)
    assert torch.allclose(attacks.a_little_is_enough(HONEST, 1, tau=-1.0)[0], MEAN - sigma)


def test_alie_z_max_follows_the_paper_formula():
    # n=50, f=24: s = floor(26) - 24 = 2, z = Phi^-1(48/50)
    assert attacks.alie_z_max(50, 24) == pytest.approx(NormalDist().inv_cdf(0.96))
    # n=7, f=2: s = floor(4.5) - 2 = 2, z = Phi^-1(5/7)
    z = attacks.alie_z_max(7, 2)
    assert z == pytest.approx(NormalDist().inv_cdf(5 / 7))
    out = attacks.a_little_is_enough([*HONEST, HONEST[0], HONEST[1]], 2, tau=None)[0]
    H = torch.stack([*HONEST, HONEST[0], HONEST[1]])
    assert torch.allclose(out, H.mean(0) + z * H.std(0))
    with pytest.raises(ValueError, match="at least 2 honest"):
        attacks.a_little_is_enough(HONEST[:1], 1)


def test_gaussian_noise_is_seeded_and_has_the_requested_moments():
    honest = [torch.zeros(20000), torch.zeros(20000)]
    a = attacks.gaussian_noise(honest, 2, mu=3.0, sigma=2.0, seed=5)
    b = attacks.gaussian_noise(honest, 2, mu=3.0, sigma=2.0, seed=5)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a[0], a[1])  # independent draws
    assert float(a[0].mean()) == pytest.approx(3.0, abs=0.05)
    assert float(a[0].std()) == pytest.approx(2.0, abs=0.05)
    with pytest.raises(ValueError, match="sigma must be >= 0"):
        attacks.gaussian_noise(honest, 1, sigma=-1.0)


def test_non_finite_everywhere_or_at_a_few_seeded_coordinates():
    (nan,) = attacks.non_finite(HONEST, 1)
    assert torch.isnan(nan).all()
    (inf,) = attacks.non_finite(HONEST, 1, value=-math.inf)
    assert torch.isneginf(inf).all()
    (sparse,) = attacks.non_finite(HONEST, 1, coordinates=1, seed=2)
    assert int(torch.isnan(sparse).sum()) == 1
    finite = torch.isfinite(sparse)
    assert torch.equal(sparse[finite], MEAN[finite])
    with pytest.raises(ValueError, match="NaN or"):
        attacks.non_finite(HONEST, 1, value=1.0)
    with pytest.raises(ValueError, match=r"coordinates must be in \[1, 3\]"):
        attacks.non_finite(HONEST, 1, coordinates=4)


def test_flip_labels_maps_bytes_to_255_minus_y_and_is_an_involution():
    y = torch.tensor([0, 1, 65, 255], dtype=torch.uint8)
    flipped = attacks.flip_labels(y)
    assert flipped.tolist() == [255, 254, 190, 0] and flipped.dtype == torch.uint8
    assert torch.equal(attacks.flip_labels(flipped), y)
    assert attacks.flip_labels(torch.tensor([0, 9]), num_classes=10).tolist() == [9, 0]
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 10\)"):
        attacks.flip_labels(torch.tensor([0, 10]), num_classes=10)
    with pytest.raises(ValueError, match="integer tensor"):
        attacks.flip_labels(torch.tensor([0.5]))


def test_inject_places_forged_vectors():
    forged = [torch.full((3,), 9.0), torch.full((3,), 8.0)]
    mixed = attacks.inject(HONEST, forged, positions=[2, 0])
    assert [float(v[0]) for v in mixed] == [8.0, 1.0, 9.0, 3.0, 2.0]
    assert attacks.inject(HONEST, forged)[3] is forged[0]
    with pytest.raises(ValueError, match="distinct indices"):
        attacks.inject(HONEST, forged, positions=[1, 1])
    with pytest.raises(ValueError, match="distinct indices"):
        attacks.inject(HONEST, forged, positions=[0, 5])


def test_make_attack_builds_every_named_attack():
    assert set(attacks.available_attacks()) == {
        "sign_flip",
        "ipm",
        "alie",
        "gaussian",
        "nan",
        "inf",
        "neg_inf",
        "label_flip",
    }
    ipm = attacks.make_attack("inner_product_manipulation:tau=0.5")
    assert ipm.name == "ipm" and ipm.spec == "ipm:tau=0.5" and ipm.level == "vector"
    assert torch.allclose(ipm.forge(HONEST, 1)[0], -0.5 * MEAN)
    assert attacks.make_attack("alie:tau=none").options == {"tau": None}
    assert torch.isposinf(attacks.make_attack("inf").forge(HONEST, 1)[0]).all()
    nan3 = attacks.make_attack("nan:coordinates=2,seed=1").forge(HONEST, 2)
    assert [int(torch.isnan(v).sum()) for v in nan3] == [2, 2]
    flip = attacks.make_attack("label_flip:num_classes=4")
    assert flip.level == "data" and flip.corrupt_targets(torch.tensor([0, 3])).tolist() == [3, 0]
    with pytest.raises(TypeError, match="data-level"):
        flip.forge(HONEST, 1)
    with pytest.raises(TypeError, match="vector-level"):
        ipm.corrupt_targets(torch.tensor([1]))


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("flipflop", "unknown attack 'flipflop'"),
        ("ipm:scale=2", "unknown option 'scale' for ipm; valid: center, tau"),
        ("alie:tau=abc", "tau: 'alie:tau=abc': must be a number"),
        ("sign_flip:scale", "write 'scale' as KEY=VALUE"),
        ("alei:tau=1", r"unknown attack 'alei' \(did you mean 'alie'\?\)"),
        ("gaussian:sigam=1", r"did you mean 'sigma'\?"),
        ("gaussian:sigma=-1", "sigma must be >= 0"),
    ],
)
def test_make_attack_rejects_bad_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        attacks.make_attack(spec)


# -- PeerAttack: what a byzantine peer of a distributed run can do --------------------------------

OWN = torch.tensor([1.0, -2.0, 4.0])
AGG = torch.tensor([0.5, -1.0, 2.0])


def test_peer_attack_uses_its_own_update_before_it_has_seen_an_aggregate():
    sf = attacks.PeerAttack("sign_flip:scale=3")
    assert torch.allclose(sf.forge(OWN, round=0, world=4, f=1), -3 * OWN)
    # no spread known yet: ALIE sends the honest-looking estimate of the mean
    alie = attacks.PeerAttack("alie")
    assert torch.allclose(alie.forge(OWN, round=0, world=4, f=1), OWN)
    # center=aggregate falls back to its own update until an aggregate was committed
    agg = attacks.PeerAttack("ipm:center=aggregate")
    assert torch.allclose(agg.forge(OWN, round=0, world=4, f=1), -2 * OWN)


def test_peer_attack_learns_mean_and_spread_from_committed_aggregates():
    alie = attacks.PeerAttack("alie:tau=2")
    alie.forge(OWN, round=0, world=4, f=1)
    alie.observe(AGG)
    sigma = (OWN - AGG).abs()
    own2 = torch.tensor([2.0, 0.0, 1.0])
    assert torch.allclose(alie.forge(own2, round=1, world=4, f=1), own2 + 2 * sigma, atol=1e-6)
    # exponential moving average of the squared deviations (weight 0.9 on the past)
    alie.observe(AGG)
    ema = 0.9 * (OWN - AGG) ** 2 + 0.1 * (own2 - AGG) ** 2
    assert torch.allclose(alie.sq_dev, ema) and alie.observed == 2
    # center=aggregate: the mean estimate is the last committed aggregate, the same on every peer
    col = attacks.PeerAttack("alie:tau=1,center=aggregate")
    col.forge(OWN, round=0, world=4, f=1)
    col.observe(AGG)
    assert torch.allclose(col.forge(own2, round=1, world=4, f=1), AGG + sigma, atol=1e-6)
    # a round that applied nothing teaches nothing
    col.forge(own2, round=2, world=4, f=1)
    col.observe(None)
    assert col.observed == 1 and torch.equal(col.last_aggregate, AGG)


def test_peer_attack_alie_z_max_uses_the_rounds_world_and_f():
    a = attacks.PeerAttack("alie:tau=none")
    a.forge(OWN, round=0, world=7, f=2)
    a.observe(AGG)
    out = a.forge(OWN, round=1, world=7, f=2)
    z = attacks.alie_z_max(7, 2)
    assert torch.allclose(out, OWN + z * (OWN - AGG).abs(), atol=1e-6)


def test_peer_attack_seeded_attacks_draw_afresh_each_round_and_nan_is_non_finite():
    g = attacks.PeerAttack("gaussian:sigma=2,seed=3")
    a0 = g.forge(torch.zeros(1000), round=0, world=4, f=1)
    a1 = g.forge(torch.zeros(1000), round=1, world=4, f=1)
    assert not torch.equal(a0, a1)
    assert torch.equal(
        a0,
        attacks.PeerAttack("gaussian:sigma=2,seed=3").forge(
            torch.zeros(1000), round=0, world=4, f=1
        ),
    )
    assert torch.isnan(attacks.PeerAttack("nan").forge(OWN, round=0, world=4, f=1)).all()
    assert torch.isposinf(attacks.PeerAttack("inf").forge(OWN, round=0, world=4, f=1)).all()
    sparse = attacks.PeerAttack("nan:coordinates=1").forge(OWN, round=5, world=4, f=1)
    assert int(torch.isnan(sparse).sum()) == 1
    # specs without a seed draw afresh each round too (a fixed draw is a much weaker attack)
    plain = attacks.PeerAttack("gaussian:sigma=2")
    z = torch.zeros(1000)
    assert not torch.equal(
        plain.forge(z, round=0, world=4, f=1), plain.forge(z, round=1, world=4, f=1)
    )
    where = attacks.PeerAttack("nan:coordinates=1")
    hit = {int(torch.isnan(where.forge(z, round=r, world=4, f=1)).nonzero()) for r in range(8)}
    assert len(hit) > 1, "the same coordinate every round"


def test_peer_attack_stays_honest_while_inactive_but_keeps_learning():
    on = [False]
    a = attacks.PeerAttack("sign_flip", active=lambda: on[0])
    assert torch.equal(a.forge(OWN, round=0, world=4, f=1), OWN)
    a.observe(AGG)
    assert a.observed == 1
    on[0] = True
    assert torch.allclose(a.forge(OWN, round=1, world=4, f=1), -OWN)


def test_peer_attack_rejects_data_attacks_and_bad_options():
    with pytest.raises(TypeError, match="data-level"):
        attacks.PeerAttack("label_flip")
    with pytest.raises(ValueError, match="decay"):
        attacks.PeerAttack("sign_flip", decay=1.0)
    with pytest.raises(ValueError, match=r"center: .* must be one of 'own', 'aggregate'"):
        attacks.make_attack("alie:center=oracle")
    with pytest.raises(ValueError, match=r"valid: num_classes$"):
        attacks.make_attack("label_flip:center=own")
    spec = attacks.make_attack("alie:tau=1.0,center=aggregate").spec
    assert spec == "alie:tau=1.0,center=aggregate"
    assert attacks.make_attack(spec).center == "aggregate"


def test_attack_registry_entries_are_the_options_dataclasses():
    entry, config = attacks.ATTACKS.resolve("noise:sigma=2,seed=3")
    assert entry.name == "gaussian" and entry.config_cls is attacks.GaussianOptions
    assert config == attacks.GaussianOptions(sigma=2.0, seed=3)
    assert attacks.make_attack("-inf").name == "neg_inf"
    assert attacks.make_attack("nan").spec == "nan"  # the value comes from the name
    assert attacks.make_attack("ipm").options == {"tau": 2.0}
