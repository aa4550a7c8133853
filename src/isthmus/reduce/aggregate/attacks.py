"""Byzantine attacks for tests and lab scenarios: pure functions that forge vectors.

Vector-level attacks take the honest vectors of a round (an omniscient attacker, the usual worst
case in the literature) and return ``n_byzantine`` forged vectors; :func:`inject` places them among
the honest ones. The data-level attack :func:`flip_labels` instead corrupts a batch's targets
before an honest computation. :func:`make_attack` builds any of them from a spec for the lab
(``"alie:tau=1.5"``).

Inside a real distributed run a byzantine peer sees no other peer's update, so it cannot be
omniscient. :class:`PeerAttack` mounts the same formulas from what such a peer does know: its own
honest update, the aggregates that were committed (every peer applies them) and the round's world
size and ``f``. It estimates the honest mean and spread from those (see its docstring and
docs/ROBUST.md, "What the lab's attackers know") and feeds the estimates to the pure formula.

* sign flip: ``-scale * mean(honest)``. Allen-Zhu, Ebrahimian, Li, Alistarh, "Byzantine-Resilient
  Non-Convex Stochastic Gradient Descent", ICLR 2021 (arXiv 2012.14368).
* inner-product manipulation: ``-tau * mean(honest)`` with ``tau = 2`` by default (small ``tau``
  hides inside the honest spread, large ``tau`` flips the mean). Xie, Koyejo, Gupta, "Fall of
  Empires: Breaking Byzantine-tolerant SGD by Inner Product Manipulation", UAI 2019
  (arXiv 1903.03936).
* a little is enough (ALIE): ``mu + tau * sigma`` per coordinate, ``mu`` and ``sigma`` the mean and
  (unbiased) standard deviation of the honest vectors, ``tau = 1.5`` by default as in ByzFL.
  With ``tau=None``, ``tau`` is the paper's ``z_max``: ``s = floor(n/2 + 1) - f``,
  ``z_max = Phi^-1((n - s) / n)``. Baruch, Baruch, Goldberg, "A Little Is Enough: Circumventing
  Defenses for Distributed Learning", NeurIPS 2019 (arXiv 1902.06156).
  Some re-implementations subtract (``mu - z sigma``); pass a negative ``tau`` for that.
* gaussian: i.i.d. ``N(mu, sigma^2)`` coordinates, seeded.
* non-finite: vectors holding NaN (or +-Inf) at every coordinate, or at ``coordinates`` seeded
  random positions of an otherwise honest-looking (mean) vector.
* label flip: targets ``y -> num_classes - 1 - y``; for byte-level language models
  (``num_classes = 256``) that is ``y -> 255 - y``. Biggio, Nelson, Laskov, "Poisoning Attacks
  against Support Vector Machines", ICML 2012, is the classic reference for label flipping.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any, Literal, get_args

import torch

from isthmus.reduce.aggregate.aggregator import as_matrix
from isthmus.spec import Registry, format_spec

__all__ = [
    "ATTACKS",
    "ALIEOptions",
    "Attack",
    "GaussianOptions",
    "IPMOptions",
    "InfOptions",
    "LabelFlipOptions",
    "NaNOptions",
    "NegInfOptions",
    "PeerAttack",
    "SignFlipOptions",
    "VectorAttackOptions",
    "a_little_is_enough",
    "alie_z_max",
    "available_attacks",
    "flip_labels",
    "gaussian_noise",
    "inject",
    "inner_product_manipulation",
    "make_attack",
    "non_finite",
    "sign_flip",
]


def _check_count(n_byzantine: int) -> None:
    if isinstance(n_byzantine, bool) or not isinstance(n_byzantine, int) or n_byzantine < 0:
        raise ValueError(f"n_byzantine must be an int >= 0, got {n_byzantine!r}")


def _honest(honest: Sequence[torch.Tensor]) -> torch.Tensor:
    return as_matrix(honest)


def sign_flip(
    honest: Sequence[torch.Tensor], n_byzantine: int, *, scale: float = 1.0
) -> list[torch.Tensor]:
    """``n_byzantine`` copies of ``-scale * mean(honest)``. Raises ``AggregationError`` for
    malformed ``honest``, ``ValueError`` for a negative count."""
    _check_count(n_byzantine)
    mu = _honest(honest).mean(dim=0)
    return [(-scale * mu).clone() for _ in range(n_byzantine)]


def inner_product_manipulation(
    honest: Sequence[torch.Tensor], n_byzantine: int, *, tau: float = 2.0
) -> list[torch.Tensor]:
    """``n_byzantine`` copies of ``-tau * mean(honest)``. Raises like :func:`sign_flip`."""
    _check_count(n_byzantine)
    mu = _honest(honest).mean(dim=0)
    return [(-tau * mu).clone() for _ in range(n_byzantine)]


def alie_z_max(n: int, f: int) -> float:
    """Baruch et al.'s ``z_max`` for ``n`` peers of which ``f`` are byzantine: the largest shift (in
    standard deviations) that still leaves the forged vectors among the "majority"."""
    if n < 1 or f < 0 or f > n:
        raise ValueError(f"alie_z_max needs 0 <= f <= n and n >= 1, got n={n}, f={f}")
    s = max(1, math.floor(n / 2 + 1) - f)
    p = min(max((n - s) / n, 1e-12), 1 - 1e-12)
    return NormalDist().inv_cdf(p)


def a_little_is_enough(
    honest: Sequence[torch.Tensor], n_byzantine: int, *, tau: float | None = 1.5
) -> list[torch.Tensor]:
    """``n_byzantine`` copies of ``mu + tau * sigma`` (coordinate-wise; see the module docstring).

    ``tau=None`` uses :func:`alie_z_max` with ``n = len(honest) + n_byzantine``. Raises
    ``ValueError`` with fewer than two honest vectors (no standard deviation).
    """
    _check_count(n_byzantine)
    X = _honest(honest)
    if X.shape[0] < 2:
        raise ValueError("a_little_is_enough needs at least 2 honest vectors to estimate a spread")
    t = alie_z_max(X.shape[0] + n_byzantine, n_byzantine) if tau is None else float(tau)
    mu = X.mean(dim=0)
    sigma = X.std(dim=0, correction=1)
    return [(mu + t * sigma).clone() for _ in range(n_byzantine)]


def gaussian_noise(
    honest: Sequence[torch.Tensor],
    n_byzantine: int,
    *,
    mu: float = 0.0,
    sigma: float = 1.0,
    seed: int = 0,
) -> list[torch.Tensor]:
    """``n_byzantine`` independent vectors with i.i.d. ``N(mu, sigma^2)`` coordinates (seeded;
    only the shape and dtype of ``honest`` are used). Raises ``ValueError`` for ``sigma < 0``."""
    _check_count(n_byzantine)
    if not sigma >= 0:
        raise ValueError(f"gaussian_noise: sigma must be >= 0, got {sigma!r}")
    X = _honest(honest)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for _ in range(n_byzantine):
        z = torch.randn(X.shape[1], generator=gen, dtype=torch.float64)
        out.append((mu + sigma * z).to(dtype=X.dtype, device=X.device))
    return out


def non_finite(
    honest: Sequence[torch.Tensor],
    n_byzantine: int,
    *,
    value: float = math.nan,
    coordinates: int | None = None,
    seed: int = 0,
) -> list[torch.Tensor]:
    """Vectors holding ``value`` (NaN, Inf or -Inf): everywhere when ``coordinates`` is None,
    else at that many seeded random positions of the honest mean (a subtler fault that only a
    full scan catches). Raises ``ValueError`` if ``value`` is finite or ``coordinates`` out of range."""
    _check_count(n_byzantine)
    if math.isfinite(value):
        raise ValueError(f"non_finite: value must be NaN or +-Inf, got {value!r}")
    X = _honest(honest)
    d = X.shape[1]
    if coordinates is None:
        return [torch.full((d,), value, dtype=X.dtype, device=X.device) for _ in range(n_byzantine)]
    if not 1 <= coordinates <= d:
        raise ValueError(f"non_finite: coordinates must be in [1, {d}], got {coordinates!r}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for _ in range(n_byzantine):
        v = X.mean(dim=0).clone()
        where = torch.randperm(d, generator=gen)[:coordinates].to(X.device)
        v[where] = value
        out.append(v)
    return out


def flip_labels(targets: torch.Tensor, *, num_classes: int = 256) -> torch.Tensor:
    """Label-flipping data attack: return ``num_classes - 1 - targets`` (a new tensor).

    For byte-level language-model targets (``num_classes=256``) this maps ``y -> 255 - y``. A
    byzantine peer trains on the flipped batch and sends an honestly computed, poisoned update.
    Raises ``ValueError`` for non-integer targets or values outside ``[0, num_classes)``.
    """
    if not isinstance(targets, torch.Tensor) or targets.is_floating_point() or targets.is_complex():
        raise ValueError("flip_labels needs an integer tensor of class indices")
    if targets.dtype == torch.bool:
        raise ValueError("flip_labels needs class indices, not a bool mask")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= num_classes):
        raise ValueError(
            f"flip_labels: targets must lie in [0, {num_classes}); got values in "
            f"[{int(targets.min())}, {int(targets.max())}]"
        )
    return (num_classes - 1) - targets


def inject(
    honest: Sequence[torch.Tensor],
    byzantine: Sequence[torch.Tensor],
    *,
    positions: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """Interleave forged vectors with honest ones: ``byzantine[k]`` lands at index
    ``positions[k]`` of the result (default: after all honest vectors). Raises ``ValueError`` for
    positions that are repeated, out of range, or not one per forged vector."""
    n = len(honest) + len(byzantine)
    pos = list(range(len(honest), n)) if positions is None else [int(p) for p in positions]
    if len(pos) != len(byzantine) or len(set(pos)) != len(pos) or any(not 0 <= p < n for p in pos):
        raise ValueError(
            f"positions must be {len(byzantine)} distinct indices in [0, {n}), got {positions!r}"
        )
    out: list[torch.Tensor | None] = [None] * n
    for p, v in zip(pos, byzantine, strict=True):
        out[p] = v
    it = iter(honest)
    return [next(it) if v is None else v for v in out]


# -- factory -----------------------------------------------------------------------------------

Center = Literal["own", "aggregate"]
_CENTERS: tuple[str, ...] = get_args(Center)  # see VectorAttackOptions.center and PeerAttack


@dataclass(frozen=True, kw_only=True)
class VectorAttackOptions:
    """What every vector-level attack's spec takes besides its formula's own options."""

    center: Center = "own"
    """Only for :class:`PeerAttack` (a distributed run): where the attacker centres its estimate
    of the honest mean. ``own``: its own honest update of the round; ``aggregate``: the last
    committed aggregate (the same on every peer, so colluding attackers forge alike). Ignored by
    :meth:`Attack.forge`, which is given the honest vectors themselves."""


@dataclass(frozen=True, kw_only=True)
class SignFlipOptions(VectorAttackOptions):
    """``sign_flip``: see :func:`sign_flip`."""

    scale: float = 1.0


@dataclass(frozen=True, kw_only=True)
class IPMOptions(VectorAttackOptions):
    """``ipm``: see :func:`inner_product_manipulation`."""

    tau: float = 2.0


@dataclass(frozen=True, kw_only=True)
class ALIEOptions(VectorAttackOptions):
    """``alie``: see :func:`a_little_is_enough` (``tau=none`` for the paper's ``z_max``)."""

    tau: float | None = 1.5


@dataclass(frozen=True, kw_only=True)
class GaussianOptions(VectorAttackOptions):
    """``gaussian``: see :func:`gaussian_noise`."""

    mu: float = 0.0
    sigma: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.sigma >= 0:
            raise ValueError(f"sigma must be >= 0, got {self.sigma!r}")


@dataclass(frozen=True, kw_only=True)
class NaNOptions(VectorAttackOptions):
    """``nan``, ``inf``, ``neg_inf``: see :func:`non_finite`; the value is the spec's name."""

    coordinates: int | None = None
    seed: int = 0
    value: float = field(default=math.nan, init=False)

    def __post_init__(self) -> None:
        if self.coordinates is not None and self.coordinates < 1:
            raise ValueError(f"coordinates must be >= 1, got {self.coordinates!r}")


@dataclass(frozen=True, kw_only=True)
class InfOptions(NaNOptions):
    value: float = field(default=math.inf, init=False)


@dataclass(frozen=True, kw_only=True)
class NegInfOptions(NaNOptions):
    value: float = field(default=-math.inf, init=False)


@dataclass(frozen=True, kw_only=True)
class LabelFlipOptions:
    """``label_flip``: see :func:`flip_labels` (a data-level attack: no ``center``)."""

    num_classes: int = 256

    def __post_init__(self) -> None:
        if self.num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {self.num_classes}")


@dataclass(frozen=True)
class Attack:
    """A named, configured attack built by :func:`make_attack`.

    ``level`` is ``"vector"`` (call :meth:`forge`) or ``"data"`` (call :meth:`corrupt_targets`).
    ``options`` are the keyword arguments of the attack's function.
    """

    name: str
    level: Literal["vector", "data"]
    options: dict[str, Any] = field(default_factory=dict)
    _fn: Callable[..., Any] | None = field(default=None, repr=False, compare=False)
    center: Center = "own"
    """See :attr:`VectorAttackOptions.center`."""

    def forge(self, honest: Sequence[torch.Tensor], n_byzantine: int) -> list[torch.Tensor]:
        """Forged vectors for this round. Raises ``TypeError`` for a data-level attack."""
        if self.level != "vector" or self._fn is None:
            raise TypeError(f"{self.name} is a data-level attack; use corrupt_targets() on batches")
        return list(self._fn(honest, n_byzantine, **self.options))

    def corrupt_targets(self, targets: torch.Tensor) -> torch.Tensor:
        """Corrupted targets for a batch. Raises ``TypeError`` for a vector-level attack."""
        if self.level != "data" or self._fn is None:
            raise TypeError(f"{self.name} is a vector-level attack; use forge() on honest vectors")
        return self._fn(targets, **self.options)

    def with_options(self, **options: Any) -> Attack:
        """A copy with some options replaced (no validation: for internal use, e.g. a per-round
        seed)."""
        return Attack(self.name, self.level, {**self.options, **options}, self._fn, self.center)

    @property
    def spec(self) -> str:
        """The canonical spec: the name and the options that differ from their defaults."""
        entry = ATTACKS.lookup(self.name)
        assert entry.config_cls is not None  # every attack has an options dataclass
        defaults = {f.name: f.default for f in dataclasses.fields(entry.config_cls) if f.init}
        items = {k: v for k, v in self.options.items() if k in defaults and v != defaults[k]}
        if self.center != "own":
            items["center"] = self.center
        return format_spec(self.name, items)


def _attack(
    name: str, fn: Callable[..., Any], level: Literal["vector", "data"], config: Any
) -> Attack:
    options = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    center = options.pop("center", "own")
    return Attack(name, level, options, fn, center)


ATTACKS: Registry[Attack] = Registry("attack")
"""Every attack by spec name; an entry's config is its options dataclass."""

for _name, _fn, _level, _options, _aliases in (
    ("sign_flip", sign_flip, "vector", SignFlipOptions, ("signflip",)),
    ("ipm", inner_product_manipulation, "vector", IPMOptions, ("inner_product_manipulation",)),
    ("alie", a_little_is_enough, "vector", ALIEOptions, ("a_little_is_enough",)),
    ("gaussian", gaussian_noise, "vector", GaussianOptions, ("gaussian_noise", "noise")),
    ("nan", non_finite, "vector", NaNOptions, ()),
    ("inf", non_finite, "vector", InfOptions, ()),
    ("neg_inf", non_finite, "vector", NegInfOptions, ("-inf",)),
    ("label_flip", flip_labels, "data", LabelFlipOptions, ("labelflip", "flip_labels")),
):
    ATTACKS.add(
        _name,
        config=_options,
        build=functools.partial(_attack, _name, _fn, _level),
        aliases=_aliases,
        help=(_fn.__doc__ or "").split("\n")[0],
    )


def available_attacks() -> list[str]:
    """Names accepted by :func:`make_attack` (aliases not included)."""
    return sorted(ATTACKS.names())


def make_attack(spec: str) -> Attack:
    """Build an attack from ``name[:key=value,...]``, e.g. ``"ipm:tau=0.5"``, ``"nan:coordinates=3"``,
    ``"label_flip:num_classes=256"`` (the grammar of :mod:`isthmus.spec`). Raises
    :class:`~isthmus.spec.SpecError` (a ValueError) naming the spec and the unknown attack or
    option (with the closest valid one), or the value that is wrong."""
    return ATTACKS.build(spec)


# -- attacks inside a distributed run ----------------------------------------------------------


class PeerAttack:
    """A vector attack as one byzantine peer of a distributed run mounts it.

    The attacker knows (and nothing else; there is no side channel between byzantine peers):

    * ``own``: the honest update it computed this round on its own data, which follows the same
      distribution as every honest peer's;
    * every aggregate committed so far (passed to :meth:`observe` after each committed round;
      every peer applies it, so it is public);
    * the round's world size ``n`` and the declared ``f``.

    From these it estimates the honest vectors' coordinate-wise mean and standard deviation:

    * mean ``mu_hat``: ``own`` (``center="own"``, the default: a fresh, unbiased but noisy
      sample), or the last committed aggregate (``center="aggregate"``: one round stale, but the
      same on every attacker, so colluders forge alike as in the literature; ``own`` until an
      aggregate has been observed);
    * spread ``sigma_hat``: the square root of an exponential moving average (weight ``decay`` on
      the past) of ``(own_s - a_s)^2`` over the committed rounds ``s`` this peer contributed to,
      ``a_s`` being that round's aggregate. Zero until the first observation, so ALIE sends the
      honest-looking ``mu_hat`` in its first round.

    The attack's pure formula then runs on two stand-in honest vectors ``mu_hat +- sigma_hat /
    sqrt(2)``, whose mean is ``mu_hat`` and whose unbiased standard deviation is ``sigma_hat``.
    ALIE with ``tau=None`` uses ``alie_z_max(n, max(f, 1))``; seeded attacks (gaussian, sparse
    NaN) add the round number to their seed so that each round draws afresh.

    Call it as ``forge(own, round=, world=, f=)`` (the :class:`~isthmus.reduce.reducer.Reducer`
    hook); it returns the vector to send, possibly non-finite. While ``active()`` returns False
    (e.g. before the step a lab scenario's attack starts), it sends ``own`` unchanged but still
    learns from the committed aggregates. Raises ``TypeError`` for a data-level attack and
    ``ValueError`` for an unknown ``center`` or ``decay`` outside [0, 1).
    """

    def __init__(
        self,
        attack: Attack | str,
        *,
        decay: float = 0.9,
        active: Callable[[], bool] | None = None,
    ) -> None:
        self.attack = make_attack(attack) if isinstance(attack, str) else attack
        if self.attack.level != "vector":
            raise TypeError(
                f"{self.attack.name} is a data-level attack; corrupt the peer's targets instead"
            )
        if self.attack.center not in _CENTERS:
            raise ValueError(f"center must be one of {', '.join(_CENTERS)}")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay!r}")
        self.decay = decay
        self.active = active
        self.last_aggregate: torch.Tensor | None = None
        self.sq_dev: torch.Tensor | None = None  # EMA of (own - aggregate)^2
        self.observed = 0  # committed rounds folded into sq_dev
        self._own: torch.Tensor | None = None  # own honest update of the pending round

    def estimates(self, own: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mu_hat, sigma_hat)`` for a round whose own honest update is ``own``."""
        own = own.detach().reshape(-1)
        mu = own
        if self.attack.center == "aggregate" and self.last_aggregate is not None:
            mu = self.last_aggregate.to(own.dtype)
        if self.sq_dev is None:  # no committed round observed yet: no idea of the spread
            return mu, torch.zeros_like(own)
        return mu, self.sq_dev.sqrt().to(own.dtype)

    def __call__(self, own: torch.Tensor, *, round: int, world: int, f: int) -> torch.Tensor:
        return self.forge(own, round=round, world=world, f=f)

    def forge(self, own: torch.Tensor, *, round: int, world: int, f: int) -> torch.Tensor:
        """The vector this peer sends in round ``round`` instead of ``own``."""
        self._own = own.detach().reshape(-1).clone()
        if self.active is not None and not self.active():
            return own
        mu, sigma = self.estimates(own)
        half = sigma / math.sqrt(2.0)
        view = [mu + half, mu - half]
        attack = self.attack
        if "seed" in attack.options:
            # a fresh draw every round, also for specs that name no seed (the functions' is 0)
            attack = attack.with_options(seed=int(attack.options.get("seed", 0)) + int(round))
        if attack.name == "alie" and attack.options.get("tau", 1.5) is None:
            attack = attack.with_options(tau=alie_z_max(max(world, 2), max(1, min(f, world))))
        return attack.forge(view, 1)[0].reshape(own.shape)

    def observe(self, aggregate: torch.Tensor | None) -> None:
        """A round committed with ``aggregate`` (flat, what every peer applied; None if nothing
        was applied). Updates the estimates for the next round."""
        own, self._own = self._own, None
        if aggregate is None:
            return
        agg = aggregate.detach().reshape(-1).to(torch.float32).clone()
        if own is not None and own.numel() == agg.numel():
            dev = (own.to(torch.float32) - agg).square_()
            if self.sq_dev is None:
                self.sq_dev = dev
            else:
                self.sq_dev.mul_(self.decay).add_(dev, alpha=1.0 - self.decay)
            self.observed += 1
        self.last_aggregate = agg
