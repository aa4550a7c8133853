"""Striping over several connections per peer pair with real processes: a SIGKILL inside a
striped collective ends in a retried round and bit parity (comm/stripes.py; its spans are in
tests/unit/test_stripes.py, the bits of plain and quantized all-reduce in
tests/integration/test_stripes_gloo.py)."""

from __future__ import annotations

import signal

from conftest import assert_bitwise_equal


def test_sigkill_inside_a_striped_collective_retries_and_keeps_parity(cluster):
    c = cluster(start_peers=3)
    # the tiny model's gradient bucket (139 KB) is cut into 4 spans, one per connection
    c.spawn("a", steps=10, connections=4)
    c.spawn("b", steps=10, connections=4, faults=["kill@collective:step=4"])
    c.spawn("c", steps=10, connections=4)
    codes = c.wait()
    assert codes == {"a": 0, "b": -signal.SIGKILL, "c": 0}, c.log("b")
    st = c.coord.status(events=500)
    assert st["counters"]["rounds_aborted"] >= 1
    assert st["counters"]["rounds_committed"] == 10
    fa, fc = c.final("a"), c.final("c")
    assert fa["step"] == fc["step"] == 10 and fa["digest"] == fc["digest"]
    assert_bitwise_equal(c.state("a"), c.state("c"))
    r4 = [r for r in fa["rounds"] if r["round"] == 4]
    assert r4[0]["outcome"] == "aborted" and r4[-1]["outcome"] == "committed"
    assert r4[-1]["world"] == 2
