"""Zeroth-order training (``zo``) with real processes: peers killed and joined end bitwise equal,
one joiner caught up by replaying the missed rounds and one by a state transfer; every peer
sends exactly the documented bytes per step."""

from __future__ import annotations

import signal

from conftest import assert_bitwise_equal


def test_zo_kills_and_joins_by_replay_and_by_transfer_end_bitwise_equal(cluster):
    # min_peers=3: after each kill the survivors wait for the next joiner, so j joins in round 3
    # (replaying rounds 0-2 from a source's log) and k in round 6 (taking the state's tensors)
    c = cluster(start_peers=3, min_peers=3)
    steps, opts = 9, {"lr": 1e-3}
    c.spawn("a", strategy="zo", strategy_options=opts, steps=steps)
    c.spawn(
        "b", strategy="zo", strategy_options=opts, steps=steps, faults=["kill@collective:step=3"]
    )
    c.spawn(
        "c", strategy="zo", strategy_options=opts, steps=steps, faults=["kill@collective:step=6"]
    )
    c.wait_until(
        lambda st: any(p["name"] == "b" and p["state"] == "dead" for p in st["peers"]), "b dead"
    )
    c.spawn("j", strategy="zo", strategy_options={**opts, "catch_up": "replay"}, steps=steps)
    c.wait_until(
        lambda st: any(p["name"] == "c" and p["state"] == "dead" for p in st["peers"]), "c dead"
    )
    c.spawn("k", strategy="zo", strategy_options={**opts, "catch_up": "transfer"}, steps=steps)
    codes = c.wait(timeout=180)
    assert codes == {"a": 0, "b": -signal.SIGKILL, "c": -signal.SIGKILL, "j": 0, "k": 0}, c.log("k")
    fa, fj, fk = c.final("a"), c.final("j"), c.final("k")
    # the replay joiner and the transfer joiner hold the run's state, bit for bit
    assert fa["revision"] == fj["revision"] == fk["revision"] == steps
    assert fj["digest"] == fk["digest"] == fa["digest"]
    assert_bitwise_equal(c.state("a"), c.state("j"))
    assert_bitwise_equal(c.state("a"), c.state("k"))
    # how each caught up: j replayed rounds 0-2 from a log of 15 bytes per round (its number,
    # world and one byte per member), k received the tensors
    first_j = next(r for r in fj["rounds"] if r["outcome"] == "committed")
    first_k = next(r for r in fk["rounds"] if r["outcome"] == "committed")
    assert first_j["round"] == 3 and first_j["resynced"]
    assert first_k["round"] == 6 and first_k["resynced"]
    assert fj["strategy"]["zo_replays"] == 1 and fj["strategy"]["zo_replayed_rounds"] == 3
    assert fj["strategy"]["zo_replay_bytes"] == 3 * (12 + 3)
    assert fk["strategy"]["zo_replays"] == 0
    # bytes per step per peer: the one-byte codes of a ring all-gather, (world - 1) of them,
    # in every committed round; the catch-up handshakes add only point-to-point sends
    for f in (fa, fj, fk):
        for r in f["rounds"]:
            if r["outcome"] != "committed":
                continue
            assert r["bytes_by_op"]["all_gather"] == r["world"] - 1 == 2, (f["name"], r)
            if "send" not in r["bytes_by_op"]:
                assert r["bytes"] == 2
    # the destinations' side of the handshake: protocol version, revision and wish (24 bytes),
    # and j's verdict on its replay (8 bytes)
    assert first_j["bytes_by_op"]["send"] == 24 + 8
    assert first_k["bytes_by_op"]["send"] == 24
