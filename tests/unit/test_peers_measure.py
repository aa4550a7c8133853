"""benchmarks/peers_measure.py: the side-by-side benchmark's figures from recorded events."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "peers_measure.py"
_spec = importlib.util.spec_from_file_location("peers_measure", _PATH)
assert _spec is not None and _spec.loader is not None
pm = importlib.util.module_from_spec(_spec)
sys.modules["peers_measure"] = pm
_spec.loader.exec_module(pm)


def _log(ts: float, msg: str) -> dict:
    return {"ts": ts, "kind": "log", "logger": "hivemind.optim.optimizer", "msg": msg}


def test_hivemind_log_lines_become_events() -> None:
    recs = [
        {"ts": 1.0, "kind": "step", "step": 0},
        _log(2.0, "Averaged gradients with 3 peers"),
        _log(3.0, "Averaging gradients failed with AllreduceException('could not find a group')"),
        _log(3.1, "Proceeding with local gradients"),
        _log(3.2, "Transitioning to epoch 7"),
        _log(4.0, "Averaged parameters with 4 peers"),
        _log(4.5, "Averaging failed with <class 'AllreduceException'>"),
        _log(5.0, "Peer is out of sync"),
        _log(5.5, "Catching up with collaboration step 9"),
        _log(6.0, "Pre-scheduling gradient averaging round in 1.20 sec"),
    ]
    events = pm.hivemind_events(recs)
    assert [(e["ts"], e["kind"], e["what"], e["n"]) for e in events] == [
        (2.0, "averaged", "gradients", 3),
        (3.0, "failed", "gradients", None),
        (3.1, "local", "gradients", None),
        (3.2, "epoch", None, 7),
        (4.0, "averaged", "parameters", 4),
        (4.5, "failed", "parameters", None),
        (5.0, "out_of_sync", None, None),
        (5.5, "caught_up", None, 9),
    ]


def test_hivemind_commits_need_another_peer() -> None:
    recs = [
        _log(1.0, "Averaged gradients with 1 peers"),
        _log(2.0, "Averaged gradients with 2 peers"),
        _log(2.5, "Averaged gradients with 4 peers"),
        _log(3.0, "Averaged parameters with 4 peers"),
    ]
    assert pm.hivemind_commits(recs, "gradients") == [2.0, 2.5]
    assert pm.hivemind_commits(recs, "gradients", fewer_than=4) == [2.0]
    assert pm.hivemind_commits(recs, "parameters") == [3.0]


def test_torchft_commits_and_participation() -> None:
    recs = [
        {"ts": 1.0, "kind": "commit", "ok": False, "participating": True, "participants": 4},
        {"ts": 2.0, "kind": "commit", "ok": True, "participating": False, "participants": 4},
        {"ts": 3.0, "kind": "commit", "ok": True, "participating": True, "participants": 3},
        {"ts": 4.0, "kind": "step", "ok": True},
    ]
    assert pm.torchft_commits(recs) == [2.0, 3.0]
    assert pm.torchft_commits(recs, participating=True) == [3.0]
    assert pm.torchft_commits(recs, fewer_than=4) == [3.0]


def test_isthmus_commits() -> None:
    events = [
        {"ts": 1.0, "kind": "commit", "world": 4},
        {"ts": 2.0, "kind": "dead", "peer": 3},
        {"ts": 2.5, "kind": "commit", "world": 3},
    ]
    assert pm.isthmus_commits(events) == [1.0, 2.5]
    assert pm.isthmus_commits(events, fewer_than=4) == [2.5]


def test_first_after() -> None:
    assert pm.first_after(10.0, [9.0, 10.0, 12.5, 11.25]) == 1.25
    assert pm.first_after(10.0, [1.0, 10.0]) is None
    assert pm.first_after(0.0, []) is None


def test_isthmus_join_commit_waits_for_an_epoch_holding_the_joiner() -> None:
    events = [
        {"ts": 1.0, "kind": "register", "peer": 0, "name": "peer0"},
        {"ts": 1.0, "kind": "register", "peer": 1, "name": "peer1"},
        {"ts": 1.1, "kind": "epoch", "epoch": 1, "members": [0, 1]},
        {"ts": 1.5, "kind": "commit", "epoch": 1},
        {"ts": 5.0, "kind": "register", "peer": 2, "name": "peer1.1"},
        {"ts": 5.2, "kind": "commit", "epoch": 1},  # before the joiner was admitted
        {"ts": 6.0, "kind": "epoch", "epoch": 2, "members": [0, 1, 2]},
        {"ts": 6.4, "kind": "commit", "epoch": 2},
        {"ts": 7.0, "kind": "commit", "epoch": 2},
    ]
    assert pm.isthmus_join_commit(events, "peer1.1") == 6.4
    assert pm.isthmus_join_commit(events, "peer0") == 1.5
    assert pm.isthmus_join_commit(events, "peer9") is None
    # registered but never in a committed round
    assert pm.isthmus_join_commit(events[:6], "peer1.1") is None


def test_eval_curve_means_over_peers_at_the_last_peer_time() -> None:
    records = {
        "peer0": [
            {"ts": 11.0, "step": 19, "eval_loss": 3.0},
            {"ts": 12.0, "step": 20},
            {"ts": 21.0, "step": 39, "eval_loss": 2.0},
            {"ts": 30.0, "kind": "final", "eval_loss": 1.0},  # no step: not a point
        ],
        "peer1": [
            {"ts": 11.5, "step": 19, "eval_loss": 4.0},
            {"ts": 22.0, "step": 39, "eval_loss": float("nan")},  # diverged: left out
        ],
    }
    curve = pm.eval_curve(records, t0=10.0)
    assert curve == [(19, 1.5, 3.5), (39, 11.0, 2.0)]
    assert pm.time_to_target(curve, 3.5) == (1.5, 19)
    assert pm.time_to_target(curve, 2.5) == (11.0, 39)
    assert pm.time_to_target(curve, 1.0) is None
    assert pm.loosest_best([curve, [(19, 1.0, 2.7)]]) == 2.7
    assert pm.loosest_best([[]]) is None


def test_wire_tx_and_backwards_counters() -> None:
    before = {"0": {"tx_bytes": 100}, "1": {"tx_bytes": 50}}
    after = {"0": {"tx_bytes": 400}, "1": {"tx_bytes": 50}, "2": {"tx_bytes": 9}}
    assert pm.wire_tx(before, after) == {"0": 300, "1": 0}
    with pytest.raises(ValueError, match="backwards"):
        pm.wire_tx(after, before)


def test_start_time_is_the_last_starting_peer() -> None:
    records = {
        "peer0": [{"ts": 1.0, "kind": "ready"}, {"ts": 2.0, "kind": "start"}],
        "peer1": [{"ts": 2.5, "kind": "start"}, {"ts": 9.0, "kind": "start"}],
        "peer1.1": [{"ts": 50.0, "kind": "start"}],
    }
    assert pm.start_time(records, ["peer0", "peer1"]) == 2.5
    with pytest.raises(ValueError, match="peer2"):
        pm.start_time(records, ["peer0", "peer2"])
