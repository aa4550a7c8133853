"""When to gossip: communication schedules over a run of ``total_steps`` local steps.

A schedule is a pure function of ``(step, total_steps)`` returning a :class:`CommDecision`: how
many gossip (mixing) iterations to run after local step ``step`` (0 means none; more than one is
DFedSAM-MGS's "multiple gossip steps") and whether to replace them by one exact global average.
Every peer evaluates it independently, so it uses integer arithmetic only: a transcendental
function rounding differently on two machines would make one peer gossip while its neighbour
does not, and the exchange would stall.

* ``constant``: gossip after every ``every``-th step.
* ``late_heavy``: "A Single Merging Suffices: Recovering Server-based Learning Performance in
  Decentralized Learning" (Zhu et al.) finds that spending the communication budget late in
  training generalizes better. The period between exchanges shrinks from ``start_every`` to
  ``end_every`` over the run, linearly or geometrically (see :class:`LateHeavySchedule`).
* ``single_merge``: the same paper's extreme: no gossip at all, one exact global average at the
  last step.
* ``poisson``: in the spirit of DADAO (Nabli and Oyallon, "DADAO: Decoupled Accelerated
  Decentralized Asynchronous Optimization", ICML 2023), where gossip fires on a Poisson clock
  independent of gradient steps: the number of gossip iterations at each step is a seeded draw
  with mean ``rate``, identical on all peers. (The synchronous approximation: a real DADAO clock
  is per edge and asynchronous.)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from isthmus.spec import Registry
from isthmus.strategies.gossip.math._rng import Rng, derive_seed

__all__ = [
    "SCHEDULES",
    "CommDecision",
    "ConstantSchedule",
    "LateHeavySchedule",
    "PoissonSchedule",
    "Schedule",
    "SingleMergeSchedule",
    "comm_steps",
    "make_schedule",
]


@dataclass(frozen=True)
class CommDecision:
    """What to do after one local step."""

    gossip_iters: int = 0
    """Gossip (mixing) iterations to run now; 0 for none."""
    global_average: bool = False
    """Replace gossip by one exact global average (all-reduce) over all peers."""

    @property
    def communicate(self) -> bool:
        return self.gossip_iters > 0 or self.global_average


_NOTHING = CommDecision()


class Schedule(Protocol):
    def __call__(self, step: int, total_steps: int) -> CommDecision: ...


def _check_step(step: int, total_steps: int) -> None:
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if not 0 <= step < total_steps:
        raise ValueError(f"step must be in 0..{total_steps - 1} (0-based), got {step}")


def _positive_int(owner: str, name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ConstantSchedule:
    """Gossip ``iters`` times after every ``every``-th step (steps ``every-1, 2*every-1, ...``)."""

    every: int = 1
    """Local steps between exchanges (1 = D-PSGD, gossip after every step)."""
    iters: int = 1
    """Gossip iterations per exchange (DFedSAM-MGS's Q)."""
    final_merge: bool = False
    """Make the last step an exact global average instead of a gossip."""

    def __post_init__(self) -> None:
        _positive_int("ConstantSchedule", "every", self.every)
        _positive_int("ConstantSchedule", "iters", self.iters)

    def __call__(self, step: int, total_steps: int) -> CommDecision:
        _check_step(step, total_steps)
        if self.final_merge and step == total_steps - 1:
            return CommDecision(global_average=True)
        if (step + 1) % self.every == 0:
            return CommDecision(gossip_iters=self.iters)
        return _NOTHING


@functools.lru_cache(maxsize=64)
def _late_heavy_steps(start: int, end: int, shape: str, total: int) -> frozenset[int]:
    """0-based steps after which a late-heavy schedule gossips (integer arithmetic only)."""
    phases = 1
    p = start
    while p // 2 >= end:
        p //= 2
        phases += 1

    def period(done: int) -> int:
        if shape == "linear":
            return start - ((start - end) * done) // total
        return max(end, start >> min(phases - 1, (done * phases) // total))

    steps = set()
    done = period(0)
    while done <= total:
        steps.add(done - 1)
        done += period(done)
    return frozenset(steps)


@dataclass(frozen=True, kw_only=True)
class LateHeavySchedule:
    """Gossip more and more often toward the end of the run.

    After ``d`` completed steps, the period to the next exchange is

    * ``shape="linear"``: ``start_every - (start_every - end_every) * d // total_steps``, falling
      linearly from ``start_every`` to ``end_every``;
    * ``shape="geometric"``: the run is cut into ``P`` equal phases, ``P`` the number of halvings
      from ``start_every`` down to ``end_every`` plus one; phase ``k`` uses period
      ``max(end_every, start_every >> k)``, so each phase holds about twice the exchanges of the
      one before.

    With ``start_every=64, end_every=1`` over 6400 steps, linear gossips 378 times (311 of them
    in the second half) and geometric 1811 times (1656 in the second half).
    """

    start_every: int = 32
    """Period (in local steps) at the start of the run."""
    end_every: int = 1
    """Period at the end; must not exceed ``start_every``."""
    shape: Literal["linear", "geometric"] = "linear"
    """``linear`` or ``geometric``."""
    iters: int = 1
    """Gossip iterations per exchange."""
    final_merge: bool = False
    """Make the last step an exact global average instead of a gossip."""

    def __post_init__(self) -> None:
        _positive_int("LateHeavySchedule", "start_every", self.start_every)
        _positive_int("LateHeavySchedule", "end_every", self.end_every)
        _positive_int("LateHeavySchedule", "iters", self.iters)
        if self.end_every > self.start_every:
            raise ValueError(
                f"LateHeavySchedule: end_every ({self.end_every}) must be <= start_every "
                f"({self.start_every}); communication must get denser toward the end"
            )
        if self.shape not in ("linear", "geometric"):
            raise ValueError(
                f"LateHeavySchedule.shape must be 'linear' or 'geometric', got {self.shape!r}"
            )

    def __call__(self, step: int, total_steps: int) -> CommDecision:
        _check_step(step, total_steps)
        if self.final_merge and step == total_steps - 1:
            return CommDecision(global_average=True)
        if step in _late_heavy_steps(self.start_every, self.end_every, self.shape, total_steps):
            return CommDecision(gossip_iters=self.iters)
        return _NOTHING


@dataclass(frozen=True, kw_only=True)
class SingleMergeSchedule:
    """No gossip; one exact global average after the last step."""

    def __call__(self, step: int, total_steps: int) -> CommDecision:
        _check_step(step, total_steps)
        return CommDecision(global_average=True) if step == total_steps - 1 else _NOTHING


@dataclass(frozen=True, kw_only=True)
class PoissonSchedule:
    """A seeded random number of gossip iterations per step, mean ``rate``.

    The draw is Binomial(``slots``, ``rate / slots``), which approaches Poisson(``rate``) as
    ``slots`` grows; it is computed with integer comparisons so every peer draws the same count
    from ``(seed, step)``.
    """

    rate: float = 1.0
    """Mean gossip iterations per step (0 < rate <= slots)."""
    seed: int = 0
    slots: int = 64
    """Bernoulli trials per step; the count never exceeds this."""
    final_merge: bool = False
    """Make the last step an exact global average instead of a gossip."""

    def __post_init__(self) -> None:
        _positive_int("PoissonSchedule", "slots", self.slots)
        if not (isinstance(self.rate, int | float) and 0 < self.rate <= self.slots):
            raise ValueError(
                f"PoissonSchedule.rate must be a number in (0, slots={self.slots}], got {self.rate!r}"
            )

    def __call__(self, step: int, total_steps: int) -> CommDecision:
        _check_step(step, total_steps)
        if self.final_merge and step == total_steps - 1:
            return CommDecision(global_average=True)
        # float division and scaling by 2^64 are exact IEEE operations, so every peer gets the
        # same integer threshold
        threshold = int((float(self.rate) / self.slots) * 18446744073709551616.0)
        rng = Rng(derive_seed(self.seed, "poisson_schedule", step))
        count = sum(1 for _ in range(self.slots) if rng.next64() < threshold)
        return CommDecision(gossip_iters=count) if count else _NOTHING


def _itself(schedule: Schedule) -> Schedule:
    return schedule


SCHEDULES: Registry[Schedule] = Registry("schedule")
"""Every schedule by spec name (``constant:every=4``, ``late_heavy:shape=geometric``); a
schedule is its own options dataclass, so an entry's config is the schedule itself."""

for _name, _cls in (
    ("constant", ConstantSchedule),
    ("late_heavy", LateHeavySchedule),
    ("single_merge", SingleMergeSchedule),
    ("poisson", PoissonSchedule),
):
    SCHEDULES.add(_name, config=_cls, build=_itself, help=(_cls.__doc__ or "").split("\n")[0])


def make_schedule(name: str, **options: Any) -> Schedule:
    """Build a schedule by name with its options, e.g. ``make_schedule("constant", every=4)``.

    Raises ``ValueError`` for an unknown name (a :class:`~isthmus.spec.SpecError` with the
    closest one) and ``TypeError`` for an unknown option.
    """
    config_cls = SCHEDULES.lookup(name).config_cls
    assert config_cls is not None  # every schedule is its own options dataclass
    schedule: Schedule = config_cls(**options)
    return schedule


def comm_steps(schedule: Schedule, total_steps: int) -> list[int]:
    """The 0-based steps at which ``schedule`` communicates (gossip or global average)."""
    return [s for s in range(total_steps) if schedule(s, total_steps).communicate]
