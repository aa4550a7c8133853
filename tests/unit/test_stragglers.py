"""Straggler and slow-link detection from timings (isthmus.coordinator.stragglers), pure."""

from __future__ import annotations

import pytest

from isthmus.coordinator.stragglers import StragglerConfig, StragglerDetector


def _feed(d: StragglerDetector, step: int, work: dict[int, float], **extra: dict) -> list:
    events = []
    for pid, w in work.items():
        timing = {"step": step, "work_s": w, **{k: v[pid] for k, v in extra.items() if pid in v}}
        events += d.observe(pid, f"peer{pid}", timing)
    return events


def test_a_bout_is_flagged_during_and_cleared_after() -> None:
    d = StragglerDetector(StragglerConfig(factor=2.0, rounds=3))
    kinds: list[tuple[int, str, str]] = []
    for step in range(40):
        slow = 15 <= step < 25
        work = {0: 0.10, 1: 0.11, 2: 0.30 if slow else 0.10}
        for kind, ev in _feed(d, step, work):
            kinds.append((step, kind, ev["name"]))
        if step == 22:
            assert d.status()["flagged"] == ["peer2"]
    assert [(k, n) for _, k, n in kinds] == [("straggler", "peer2"), ("straggler_cleared", "peer2")]
    flagged_at, cleared_at = kinds[0][0], kinds[1][0]
    assert 15 < flagged_at <= 15 + 2 + 3  # median of 3 reports, then m=3 in a row
    assert 25 < cleared_at <= 25 + 2 + 3
    st = d.status()
    assert st["flagged"] == [] and st["flags"] == 1
    assert st["baselines"]["peer2"]["work_s"] == pytest.approx(0.10)  # the bout is not in it


def test_a_steady_run_flags_nobody_and_repeats_are_ignored() -> None:
    d = StragglerDetector()
    for step in range(50):
        assert _feed(d, step, {0: 0.1 + 0.01 * (step % 3), 1: 0.12, 2: 0.09}) == []
        assert d.observe(0, "peer0", {"step": step, "work_s": 99.0}) == []  # seen already
    assert d.observe(0, "peer0", {"step": 99, "work_s": "x"}) == []  # malformed: ignored
    # one hiccup is not a straggler
    assert _feed(d, 60, {0: 5.0, 1: 0.1, 2: 0.1}) == []
    assert d.status()["flags"] == 0


def test_with_two_peers_the_other_one_is_the_reference() -> None:
    d = StragglerDetector(StragglerConfig(rounds=2))
    events = []
    for step in range(6):
        events += _feed(d, step, {0: 0.1, 1: 0.35})
    assert [(k, e["name"]) for k, e in events] == [("straggler", "peer1")]
    d.forget(1)
    assert d.status()["flagged"] == []


def test_links_are_named_when_pairs_report_and_not_guessed_otherwise() -> None:
    d = StragglerDetector(StragglerConfig(rounds=2))
    events = []
    for step in range(8):
        links = {
            0: {"peer1": 0.01, "peer2": 0.01},
            1: {"peer2": 0.01, "peer3": 0.20 if step >= 3 else 0.01},
            3: {"peer0": 0.01},
        }
        events += _feed(d, step, {0: 0.1, 1: 0.1, 3: 0.1}, links=links)
    anomalies = [e for k, e in events if k == "link_anomaly"]
    assert [a["pair"] for a in anomalies] == [["peer1", "peer3"]]
    assert d.status()["slow_links"] == [["peer1", "peer3"]]
    # every peer's synchronization slows down together, nobody's work does: a link anomaly
    # without a pair (an all-reduce's timings cannot name one)
    d2 = StragglerDetector(StragglerConfig(rounds=3))
    events = []
    for step in range(20):
        sync = 0.5 if step >= 10 else 0.05
        events += _feed(d2, step, {0: 0.1, 1: 0.1, 2: 0.1}, sync_s={0: sync, 1: sync, 2: sync})
    assert [(k, e["pair"]) for k, e in events] == [("link_anomaly", None)]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"factor": 1.0}, "factor must be a number > 1"),
        ({"rounds": 0}, "rounds must be an integer >= 1"),
        ({"policy": "kick"}, "policy must be one of"),
    ],
)
def test_bad_settings_say_which(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StragglerConfig(**kw)


def test_the_reference_among_many_peers_is_the_median_of_the_others() -> None:
    # many peers, an even then an odd number of others, one of them forgotten: the reference
    # a flag carries is the plain median of the other peers' current times
    import random
    import statistics

    rng = random.Random(7)
    d = StragglerDetector(StragglerConfig(factor=2.0, rounds=1))
    recent: dict[int, list[float]] = {}
    for step in range(3):
        for pid in range(41):
            w = round(rng.uniform(1.0, 2.0), 3)
            recent.setdefault(pid, []).append(w)
            assert d.observe(pid, f"peer{pid}", {"step": step, "work_s": w}) == []

    def expected(pid: int) -> float:
        return statistics.median(statistics.median(v[-3:]) for q, v in recent.items() if q != pid)

    for forget, pid in ((None, 100), (5, 101)):
        if forget is not None:
            d.forget(forget)
            del recent[forget]
        events = []
        for step in range(3):
            recent.setdefault(pid, []).append(50.0)
            events += d.observe(pid, f"peer{pid}", {"step": step, "work_s": 50.0})
        assert [k for k, _ in events] == ["straggler"]
        assert events[0][1]["reference_s"] == round(expected(pid), 6)


def test_a_slow_synchronization_everywhere_is_a_link_anomaly_once_all_report_it() -> None:
    # every peer's sync beyond k times its own baseline, judged from counts kept as they report
    d = StragglerDetector(StragglerConfig(factor=2.0, rounds=2, window=10))
    kinds = []
    for step in range(12):
        sync = 1.0 if step >= 6 else 0.1
        for pid in range(30):
            kinds += [
                k
                for k, _ in d.observe(pid, f"p{pid}", {"step": step, "work_s": 0.5, "sync_s": sync})
            ]
    assert kinds == ["link_anomaly"]
    d.forget(3)  # the counts follow a peer that leaves
    assert d.status()["link_anomalies"] == 1
