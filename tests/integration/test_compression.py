"""Compression end to end with real peer processes: quantized DDP ends bit-identical, a SIGKILL
inside a compressed collective (error feedback on) is retried by the survivors, a joiner meets a
stateful compressor (PowerSGD under DiLoCo), and every byte a peer sends is accounted for per
round and per collective, matching the compressors' predictions."""

from __future__ import annotations

import signal
from typing import Any

import pytest

from conftest import assert_bitwise_equal
from isthmus.comm.group import wire_bytes
from isthmus.models import GPT, GPTConfig
from isthmus.reduce.compress import make_compressor

COLLECTIVES = ("all_reduce", "all_gather", "all_to_all")


def _shapes() -> list[tuple[int, ...]]:
    model = GPT(GPTConfig.tiny(), seed=0)
    return [tuple(p.shape) for p in model.parameters() if p.requires_grad]


def _check_bytes(final: dict[str, Any]) -> None:
    """Every byte this peer sent belongs to exactly one round, and per-collective totals add up."""
    rounds = final["rounds"]
    assert sum(r["bytes"] for r in rounds) == final["bytes_sent"]
    for r in rounds:
        assert sum(r["bytes_by_op"].values()) == r["bytes"]
    by_op: dict[str, int] = {}
    for r in rounds:
        for op, b in r["bytes_by_op"].items():
            by_op[op] = by_op.get(op, 0) + b
    assert by_op == {op: b for op, b in final["bytes_by_op"].items() if b}


def _predicted(spec: str, world: int, exact_values: int) -> int:
    """Bytes one peer sends in one plain compressed round: the compressor's collectives plus the
    exact all-reduce (the step counts and the contributor count)."""
    return make_compressor(spec).predict_bytes_many(_shapes(), world) + wire_bytes(
        "all_reduce", 4 * (exact_values + 1), world
    )


# the rest of a parametrized family runs with `make test-slow` (tests/conftest.py skips it
# otherwise, with the reason shown)
SLOW = [pytest.mark.slow]
QUANTIZED = ["e3m0", "int4", "int8", "uint8", "fp8_e4m3", "fp8_e5m2"]


@pytest.mark.parametrize(
    "fmt", [f if f == "e3m0" else pytest.param(f, marks=SLOW) for f in QUANTIZED]
)
def test_ddp_with_quantized_gradients_ends_bit_identical(cluster, fmt):
    # one format runs by default (each run costs two interpreters); the unit tests check the
    # bits of every format with in-process groups
    c = cluster(start_peers=2)
    for n in ("a", "b"):
        c.spawn(n, steps=5, compression=fmt)
    assert c.wait() == {"a": 0, "b": 0}, c.log("a")
    fa, fb = c.final("a"), c.final("b")
    assert fa["digest"] == fb["digest"] and fa["model_digest"] == fb["model_digest"]
    assert_bitwise_equal(c.state("a"), c.state("b"))
    assert c.coord.status()["counters"]["parity_failures"] == 0
    assert fa["strategy"]["reducer"].startswith(fmt)
    want = _predicted(fmt, 2, 0)
    for f in (fa, fb):
        _check_bytes(f)
        assert [r["bytes"] for r in f["rounds"]] == [want] * 5
        assert set(f["rounds"][0]["bytes_by_op"]) == {"all_reduce", "all_to_all", "all_gather"}


def test_sigkill_inside_a_compressed_collective_with_error_feedback(cluster):
    spec = "topk:0.1+ef"
    c = cluster(start_peers=3)
    c.spawn("a", steps=16, compression=spec)
    c.spawn("b", steps=16, compression=spec, faults=["kill@collective:step=6"])
    c.spawn("c", steps=16, compression=spec)
    codes = c.wait()
    assert codes == {"a": 0, "b": -signal.SIGKILL, "c": 0}, c.log("a")
    st = c.coord.status(events=500)
    assert st["counters"]["rounds_committed"] == 16
    assert any(e["kind"] == "abort" and e["round"] == 6 for e in st["events"])
    fa, fc = c.final("a"), c.final("c")
    assert fa["digest"] == fc["digest"] and fa["model_digest"] == fc["model_digest"]
    assert_bitwise_equal(c.state("a"), c.state("c"))
    for f in (fa, fc):
        _check_bytes(f)
        r6 = [r for r in f["rounds"] if r["round"] == 6]
        assert r6[0]["outcome"] == "aborted" and r6[-1]["outcome"] == "committed"
        assert r6[-1]["world"] == 2
        # plain rounds send exactly what the compressor predicts, before and after the kill
        for r in f["rounds"]:
            if r["outcome"] == "committed" and not r["resynced"]:
                assert r["bytes"] == _predicted(spec, r["world"], 0), r


@pytest.mark.parametrize(
    ("strategy", "spec"),
    [
        # joiners and shared compressor state: tests/integration/test_compress_reducer.py
        pytest.param("diloco", "powersgd:rank=2", marks=SLOW),
        pytest.param("ddp", "randk:0.2+ef21", marks=SLOW),
        pytest.param("ddp", "sketch:0.05", marks=SLOW),
    ],
)
def test_joiner_meets_a_stateful_compressor(cluster, strategy, spec):
    # Shared compressor state (PowerSGD's warm-start Q, the EF21 aggregate, random-k's round
    # counter, the sketch error) cannot travel to a joiner: every member restarts it at the new
    # epoch, so the joiner computes the same bits from then on.
    # the members run for 12 s or more, so that the joiner (a fresh interpreter: seconds to
    # start, many more on a loaded machine) arrives mid-run
    job = {"strategy": strategy, "steps": 120, "step_delay": 0.1, "compression": spec}
    if strategy == "diloco":
        job["strategy_options"] = {"sync_every": 3}
    c = cluster(start_peers=2)
    for n in ("a", "b"):
        c.spawn(n, **job)
    c.wait_until(lambda s: s["revision"] >= 1, "the first committed round")
    c.spawn("j", **job)
    assert c.wait() == {"a": 0, "b": 0, "j": 0}, c.log("j")
    st = c.coord.status(events=500)
    assert st["counters"]["resyncs"] >= 1 and st["counters"]["parity_failures"] == 0
    fa, fb, fj = c.final("a"), c.final("b"), c.final("j")
    assert fj["rounds"][0]["resynced"]
    # the joiner took part in later rounds of three peers, with its own contribution
    later = [r for r in fj["rounds"][1:] if r["outcome"] == "committed"]
    assert later and all(r["world"] == 3 and not r["resynced"] for r in later)
    assert fa["model_digest"] == fb["model_digest"] == fj["model_digest"]
    assert_bitwise_equal(c.state("a"), c.state("j"))
    assert_bitwise_equal(c.state("a"), c.state("b"))
    exact = 1 if strategy == "diloco" else 0  # DiLoCo's inner-step count rides along
    for f in (fa, fb, fj):
        _check_bytes(f)
        for r in f["rounds"]:
            transfers = {"broadcast", "send"} & set(r["bytes_by_op"])
            if r["outcome"] == "committed" and not transfers:
                assert r["bytes"] == _predicted(spec, r["world"], exact), r
