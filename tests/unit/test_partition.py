"""The partition rule: who sits out when live members cannot all reach each other, and when a
pair is trusted (or tried) again. One process, no sockets, no clock."""

from __future__ import annotations

import itertools
import random

import pytest

from isthmus.coordinator.partition import (
    Decision,
    FailureReport,
    How,
    PartitionConfig,
    ProbeResult,
    Reachability,
)

FOUR = ["peer0", "peer1", "peer2", "peer3"]
ADDR = {f"peer{i}": f"10.0.0.{i + 2}:4123{i}" for i in range(64)}


def fail(a: str, b: str, at: float, how: How = How.REFUSED) -> FailureReport:
    return FailureReport(reporter=a, remote=b, address=ADDR[b], how=how, at=at)


def assert_clique(reach: Reachability, keep: tuple[str, ...]) -> None:
    for a, b in itertools.combinations(keep, 2):
        assert not reach.pair_state(a, b).down, (a, b)


def test_no_failure_keeps_everyone() -> None:
    d = Reachability().decide(FOUR)
    assert d == Decision(tuple(FOUR), {}, (), True, "every pair is up")


@pytest.mark.parametrize("how", [How.REFUSED, How.TIMED_OUT])
def test_two_of_four_cannot_reach_each_other_the_junior_sits_out(how: How) -> None:
    reach = Reachability()
    # both ends report, as both see their connection attempt fail
    reach.report(fail("peer1", "peer2", 10.0, how))
    reach.report(fail("peer2", "peer1", 10.2, how))
    d = reach.decide(FOUR)
    assert d.keep == ("peer0", "peer1", "peer3")
    assert d.exact
    assert d.out == {"peer2": f"isolated: cannot reach peer1 at {ADDR['peer1']} ({how.value})"}


def test_seniority_decides_which_end_of_a_broken_pair_sits_out() -> None:
    reach = Reachability()
    reach.report(fail("peer1", "peer2", 1.0))
    d = reach.decide(FOUR, seniority=["peer2", "peer0", "peer1", "peer3"])
    assert d.keep == ("peer0", "peer2", "peer3")
    assert d.out == {"peer1": f"isolated: cannot reach peer2 at {ADDR['peer2']} (refused)"}
    assert "longest-serving" in d.why


def test_a_one_way_failure_breaks_the_pair_in_both_directions() -> None:
    reach = Reachability()
    reach.report(fail("peer1", "peer2", 1.0, How.TIMED_OUT))  # peer2 never reports peer1
    assert reach.pair_state("peer2", "peer1").down
    d = reach.decide(FOUR)
    assert d.keep == ("peer0", "peer1", "peer3")
    # told from the left-out member's side: the other end could not reach it
    assert d.out["peer2"] == f"isolated: peer1 cannot reach it at {ADDR['peer2']} (timed out)"


def test_a_member_that_reaches_nobody_sits_out_alone() -> None:
    reach = Reachability()
    for other in ("peer0", "peer1", "peer2"):
        reach.report(fail("peer3", other, 5.0, How.RESET))
    d = reach.decide(FOUR, seniority=["peer3", "peer0", "peer1", "peer2"])
    # most senior, but keeping it would cost three members
    assert d.keep == ("peer0", "peer1", "peer2")
    assert d.out == {"peer3": f"isolated: cannot reach peer0 at {ADDR['peer0']} (reset)"}


def test_two_broken_pairs_keep_the_senior_end_of_each() -> None:
    reach = Reachability()
    reach.report(fail("peer0", "peer1", 1.0))
    reach.report(fail("peer3", "peer2", 1.0))
    d = reach.decide(FOUR)
    assert d.keep == ("peer0", "peer2")
    assert set(d.out) == {"peer1", "peer3"}


def test_a_state_holder_is_kept_even_against_seniority() -> None:
    reach = Reachability()
    reach.report(fail("peer0", "peer1", 1.0))
    assert reach.decide(FOUR).keep == ("peer0", "peer2", "peer3")
    d = reach.decide(FOUR, holders=["peer1"])
    assert d.keep == ("peer1", "peer2", "peer3")
    assert "peer1, which holds the run's state" in d.why
    # a holder that the largest group keeps anyway changes nothing
    assert reach.decide(FOUR, holders=["peer0", "peer1"]).keep == ("peer0", "peer2", "peer3")


def test_holder_kept_at_the_cost_of_a_larger_group() -> None:
    reach = Reachability()
    for other in ("peer0", "peer1", "peer2"):
        reach.report(fail("peer3", other, 1.0))
    d = reach.decide(FOUR, holders=["peer3"])
    assert d.keep == ("peer3",)
    assert set(d.out) == {"peer0", "peer1", "peer2"}


def test_a_pair_that_just_failed_stays_out_until_something_changes() -> None:
    reach = Reachability()
    reach.report(fail("peer1", "peer2", 10.0))
    for _ in range(3):  # asking again, later, changes nothing
        assert reach.decide(FOUR).keep == ("peer0", "peer1", "peer3")
    assert reach.pair_state("peer1", "peer2").down
    # a failed probe is no change either
    reach.probe(ProbeResult("peer1", "peer2", ok=False, at=15.0))
    assert reach.decide(FOUR).keep == ("peer0", "peer1", "peer3")
    # a new process in the slot is a change
    reach.forget("peer2")
    assert reach.decide(FOUR).keep == tuple(FOUR)


def test_readmitted_after_one_successful_probe() -> None:
    reach = Reachability()
    reach.report(fail("peer1", "peer2", 10.0))
    before = reach.decide(FOUR)
    assert before.out.keys() == {"peer2"}
    reach.probe(ProbeResult("peer2", "peer1", ok=True, at=15.0))
    after = reach.decide(FOUR, previous=before)
    assert after.keep == tuple(FOUR)
    assert after.back == ("peer2",)
    assert after.out == {}
    assert reach.decide(FOUR, previous=after).back == ()


def test_probes_are_due_every_interval_while_the_pair_is_down() -> None:
    reach = Reachability(PartitionConfig(probe_every_s=5.0))
    reach.report(fail("peer1", "peer2", 10.0))
    assert reach.probes_due(FOUR, 12.0) == []
    assert reach.probes_due(FOUR, 15.0) == [("peer1", "peer2")]
    reach.probe(ProbeResult("peer1", "peer2", ok=False, at=15.0))
    assert reach.probes_due(FOUR, 19.0) == []
    assert reach.probes_due(FOUR, 20.0) == [("peer1", "peer2")]
    assert reach.probes_due(["peer0", "peer1"], 20.0) == []  # only among the members asked
    reach.probe(ProbeResult("peer1", "peer2", ok=True, at=20.0))
    assert reach.probes_due(FOUR, 100.0) == []


def test_a_flapping_link_must_stay_up_longer_each_time() -> None:
    cfg = PartitionConfig(settle_s=10.0, settle_max_s=40.0, probe_every_s=5.0)
    reach = Reachability(cfg)
    pair = ("peer1", "peer2")
    reach.report(fail(*pair, 0.0))
    reach.probe(ProbeResult(*pair, ok=True, at=5.0))
    assert not reach.pair_state(*pair).down  # first failure: one probe heals
    reach.report(fail(*pair, 10.0))  # second episode: 10 s of good probes needed
    for t in (15.0, 20.0):
        reach.probe(ProbeResult(*pair, ok=True, at=t))
        assert reach.pair_state(*pair).down
    reach.probe(ProbeResult(*pair, ok=False, at=22.0))  # a failed probe restarts the wait
    for t in (25.0, 30.0):
        reach.probe(ProbeResult(*pair, ok=True, at=t))
        assert reach.pair_state(*pair).down
    reach.probe(ProbeResult(*pair, ok=True, at=35.0))
    st = reach.pair_state(*pair)
    assert not st.down and st.episodes == 2
    reach.report(fail(*pair, 40.0))  # third: 20 s
    reach.probe(ProbeResult(*pair, ok=True, at=45.0))
    reach.probe(ProbeResult(*pair, ok=True, at=60.0))
    assert reach.pair_state(*pair).down
    reach.probe(ProbeResult(*pair, ok=True, at=65.0))
    assert not reach.pair_state(*pair).down
    assert cfg.settle_for(10) == 40.0  # capped


def test_a_pair_up_for_long_enough_starts_counting_again() -> None:
    reach = Reachability(PartitionConfig(forget_after_s=600.0))
    pair = ("peer0", "peer3")
    reach.report(fail(*pair, 0.0))
    reach.probe(ProbeResult(*pair, ok=True, at=5.0))
    reach.report(fail(*pair, 1000.0))
    assert reach.pair_state(*pair).episodes == 1
    reach.probe(ProbeResult(*pair, ok=True, at=1005.0))
    assert not reach.pair_state(*pair).down


def test_a_probe_at_the_instant_of_a_failure_does_not_heal_it() -> None:
    reach = Reachability()
    reach.probe(ProbeResult("peer1", "peer2", ok=True, at=3.0))
    reach.report(fail("peer1", "peer2", 3.0))
    assert reach.pair_state("peer1", "peer2").down


def test_bounded_history_keeps_counting_episodes() -> None:
    reach = Reachability(PartitionConfig(history=4, settle_s=1.0, settle_max_s=1000.0))
    pair = ("peer1", "peer2")
    t = 0.0
    for _ in range(6):  # heal each episode with enough probes
        reach.report(fail(*pair, t))
        need = reach.config.settle_for(reach.pair_state(*pair).episodes)
        reach.probe(ProbeResult(*pair, ok=True, at=t + 1))
        reach.probe(ProbeResult(*pair, ok=True, at=t + 1 + need))
        t += 10 + need
    st = reach.pair_state(*pair)
    assert st.episodes == 6
    assert st.last_report is not None and st.last_report.at == t - 10 - need  # kept past history


def _events() -> list[FailureReport | ProbeResult]:
    return [
        fail("peer1", "peer2", 10.0),
        fail("peer2", "peer1", 10.0, How.TIMED_OUT),
        fail("peer3", "peer0", 11.0, How.RESET),
        ProbeResult("peer0", "peer3", ok=True, at=16.0),
        fail("peer3", "peer0", 20.0),
        ProbeResult("peer1", "peer2", ok=False, at=16.0),
        fail("peer4", "peer5", 12.0),
        ProbeResult("peer5", "peer4", ok=True, at=13.0),
    ]


def _feed(reach: Reachability, events: list[FailureReport | ProbeResult]) -> Reachability:
    for ev in events:
        if isinstance(ev, FailureReport):
            reach.report(ev)
        else:
            reach.probe(ev)
    return reach


def test_decisions_do_not_depend_on_the_order_of_reports() -> None:
    members = [f"peer{i}" for i in range(6)]
    ref = _feed(Reachability(), _events())
    want = ref.decide(members)
    assert want.keep == ("peer0", "peer1", "peer4", "peer5")
    rng = random.Random(7)
    for _ in range(30):
        evs = _events()
        rng.shuffle(evs)
        reach = _feed(Reachability(), evs)
        assert reach.decide(members) == want
        for a, b in itertools.combinations(members, 2):
            assert reach.pair_state(a, b) == ref.pair_state(a, b)


def _brute(members: list[str], down: set[tuple[str, str]]) -> tuple[str, ...]:
    """The largest all-up subset, ties to the most senior members (members are in seniority
    order): the reference the search must equal."""
    n = len(members)
    for size in range(n, 0, -1):
        for combo in itertools.combinations(range(n), size):  # lexicographic: senior first
            keep = [members[i] for i in combo]
            if all((a, b) not in down for a, b in itertools.combinations(sorted(keep), 2)):
                return tuple(keep)
    return ()


@pytest.mark.parametrize("seed", range(25))
def test_the_search_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(4, 10)
    members = [f"peer{i}" for i in range(n)]
    reach = Reachability()
    down: set[tuple[str, str]] = set()
    p = rng.choice([0.1, 0.3, 0.6])
    for a, b in itertools.combinations(members, 2):
        if rng.random() < p:
            reach.report(fail(a, b, rng.uniform(0, 10)))
            down.add((min(a, b), max(a, b)))
    d = reach.decide(members, seniority=members)
    assert d.exact
    assert d.keep == _brute(members, down)
    assert set(d.out) == set(members) - set(d.keep)


def test_sixty_four_members_with_scattered_failures_are_solved_exactly() -> None:
    rng = random.Random(3)
    members = [f"peer{i}" for i in range(64)]
    reach = Reachability()
    for _ in range(40):
        a, b = rng.sample(members, 2)
        reach.report(fail(a, b, 1.0, How.TIMED_OUT))
    d = reach.decide(members)
    assert d.exact
    assert_clique(reach, d.keep)
    assert len(d.keep) + len(d.out) == 64
    assert len(d.keep) >= 64 - 40
    assert reach.decide(list(reversed(members)), seniority=sorted(members)).keep == tuple(
        m for m in reversed(members) if m in d.keep
    )


def test_past_the_search_bound_the_greedy_rule_still_keeps_an_all_up_group() -> None:
    rng = random.Random(0)
    members = [f"peer{i}" for i in range(64)]
    reach = Reachability(PartitionConfig(max_steps=200))
    for a, b in itertools.combinations(members, 2):
        if rng.random() < 0.1:
            reach.report(fail(a, b, 1.0))
    d = reach.decide(members)
    assert not d.exact
    assert "bound of 200 steps" in d.why
    assert d.keep  # never empty: one member alone is always a group
    assert_clique(reach, d.keep)
    assert reach.decide(members) == d  # the bound is a step count: the same answer every time
    exact = Reachability(PartitionConfig(max_steps=100_000))
    for a, b in reach.down_pairs(members):
        exact.report(fail(a, b, 1.0))
    best = exact.decide(members)
    assert best.exact
    assert_clique(exact, best.keep)
    assert len(best.keep) >= len(d.keep)
    for m in d.out:
        assert d.out[m].startswith("isolated: ")


def test_the_bound_applies_with_holders_too() -> None:
    reach = Reachability(PartitionConfig(max_steps=1))
    reach.report(fail("peer0", "peer1", 1.0))
    reach.report(fail("peer2", "peer3", 1.0))
    d = reach.decide(FOUR, holders=["peer3"])
    assert not d.exact
    assert "peer3" in d.keep
    assert_clique(reach, d.keep)


def test_odd_input_never_raises() -> None:
    reach = Reachability()
    reach.report(fail("peer1", "peer1", 1.0))  # about itself: ignored
    reach.probe(ProbeResult("peer1", "peer1", ok=False, at=1.0))
    reach.report(fail("peer1", "peer9", 1.0))
    d = reach.decide(["peer1", "peer1", "peer2"], seniority=["peer7"])
    assert d.keep == ("peer1", "peer2")  # duplicates once; a pair with a non-member is ignored
    assert Reachability().decide([]).keep == ()


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"settle_s": -1.0}, "settle_s"),
        ({"probe_every_s": 0.0}, "probe_every_s"),
        ({"settle_s": 10.0, "settle_max_s": 5.0}, "settle_max_s"),
        ({"max_steps": 0}, "max_steps"),
        ({"history": True}, "history"),
        ({"forget_after_s": float("nan")}, "forget_after_s"),
        ({"trial_after_s": -1.0}, "trial_after_s"),
    ],
)
def test_config_errors_name_the_field(kw: dict[str, float], msg: str) -> None:
    with pytest.raises(ValueError, match=f"PartitionConfig.{msg}"):
        PartitionConfig(**kw)  # type: ignore[arg-type]


def test_a_pair_whose_probes_keep_failing_is_tried_again_after_trial_after_s() -> None:
    reach = Reachability(PartitionConfig(trial_after_s=900.0))
    reach.report(fail("peer1", "peer2", 10.0))
    for t in range(15, 1000, 5):  # the probe port is blocked, say, while Gloo's is not
        reach.probe(ProbeResult("peer1", "peer2", ok=False, at=float(t)))
    d = reach.decide(FOUR, now=909.0)
    assert d.keep == ("peer0", "peer1", "peer3") and d.trials == ()
    d = reach.decide(FOUR, now=910.0)
    assert d.keep == tuple(FOUR) and d.trials == (("peer1", "peer2"),)
    assert reach.decide(FOUR).keep == ("peer0", "peer1", "peer3")  # no time, no trial
    # the trial epoch fails: a new report, and the next trial is another 900 s away
    reach.report(fail("peer2", "peer1", 930.0, How.TIMED_OUT))
    assert reach.decide(FOUR, now=1829.0).keep == ("peer0", "peer1", "peer3")
    assert reach.decide(FOUR, now=1830.0).trials == (("peer1", "peer2"),)


def test_no_trials_when_switched_off() -> None:
    reach = Reachability(PartitionConfig(trial_after_s=None))
    reach.report(fail("peer1", "peer2", 10.0))
    assert reach.decide(FOUR, now=10.0**6).keep == ("peer0", "peer1", "peer3")
    assert not reach.on_trial("peer1", "peer2", 10.0**6)
