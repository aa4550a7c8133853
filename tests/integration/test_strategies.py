"""Low-communication strategies with real rounds: one-peer sessions in this process, and real peer
processes that are killed while an overlapped reduction is in flight and joined while one is.

One peer: the whole round machinery (begin, hashes, overlapped reduction, commit) must not change
a bit, and an injected failure of an in-flight reduction must be invisible in the result (the
round is retried with the snapshot taken at issue; the inner steps taken meanwhile are kept).
Several peers: survivors and joiners end bitwise equal (shared state and model).
"""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest
import torch

from conftest import assert_bitwise_equal
from isthmus.data import Corpus
from isthmus.models import GPT, GPTConfig
from isthmus.reduce.reducer import Reducer
from isthmus.strategies import (
    CO2,
    CO2Config,
    DiLoCo,
    DiLoCoConfig,
    EagerConfig,
    EagerDiLoCo,
    SparseLoCo,
    SparseLoCoConfig,
    Strategy,
    StreamingConfig,
    StreamingDiLoCo,
)
from isthmus.strategies.sparseloco import SparseRound

TINY = GPTConfig.tiny()


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))


def train(
    make: Callable[[torch.nn.Module, torch.optim.Optimizer], Strategy],
    corpus: Corpus,
    steps: int,
    *,
    join: bool = False,
) -> Strategy:
    """The loop of isthmus.job, one thread (``join``: with ``strategy.join()`` before it); the
    strategy's ``forwards`` counts the model's forward passes."""
    torch.set_num_threads(1)
    model = GPT(TINY, seed=21)
    opt = adamw(model)
    st = make(model, opt)
    forwards = [0]
    model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    if join:
        st.join()
    while st.step_count < steps:
        x, y = corpus.batch(
            step=st.step_count, rank=0, world=1, batch_size=4, block_size=TINY.block_size
        )
        model(x, y)[1].backward()
        st.step()
        opt.zero_grad()
    st.finish()
    st.forwards = forwards[0]  # type: ignore[attr-defined]
    return st


def state_of(st: Strategy) -> list[torch.Tensor]:
    out = [p.detach() for p in st.model.parameters()]
    out += list(st.global_params)  # type: ignore[attr-defined]
    if isinstance(st, CO2):
        out += st.momentum
    if isinstance(st, (EagerDiLoCo, StreamingDiLoCo)):
        # momentum buffers (none when the outer SGD has no momentum)
        out += [st.outer.state[g].get("momentum_buffer") for g in st.global_params]
        out = [t for t in out if t is not None]
    return out


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x, y), f"tensor {i} differs"


ONE_PEER = {
    "eager": lambda s, m, o: EagerDiLoCo(s, m, o, EagerConfig(sync_every=4)),
    "eager-paper": lambda s, m, o: EagerDiLoCo(
        s,
        m,
        o,
        EagerConfig(sync_every=4, start="paper", anchor=0.0, outer_lr=1.0, outer_momentum=0.0),
    ),
    "co2": lambda s, m, o: CO2(s, m, o, CO2Config(sync_every=4, clip=1e-3)),
}


@pytest.mark.parametrize("name", list(ONE_PEER))
def test_one_peer_session_equals_no_session_and_survives_a_failed_inflight_round(
    one_peer, corpus, name
):
    make = ONE_PEER[name]
    steps = 14  # boundaries at 4, 8, 12 and a partial phase synced by finish()
    alone = train(lambda m, o: make(None, m, o), corpus, steps)
    s = one_peer()
    clean = train(lambda m, o: make(s, m, o), corpus, steps)
    assert_same(state_of(clean), state_of(alone))
    assert s.stats.bytes_sent == 0
    assert s.revision == 5  # catch-up + 3 boundaries + the partial phase at finish
    # the round issued at step 8 fails while in flight: it is retried from its snapshot, and the
    # four inner steps taken meanwhile are kept, so nothing changes
    s2 = one_peer("fail@collective:step=8")
    failed = train(lambda m, o: make(s2, m, o), corpus, steps)
    assert s2.faults.fired, "the failure was not injected"
    assert failed.pipeline.retries == 1  # type: ignore[attr-defined]
    outcomes = [(r["round"], r["outcome"]) for r in s2.rounds]
    assert (2, "aborted") in outcomes and (2, "committed") in outcomes
    assert_same(state_of(failed), state_of(alone))


def test_streaming_one_peer_failed_inflight_fragment_changes_nothing(one_peer, corpus):
    cfg = StreamingConfig(sync_every=6, fragments=2, overlap=2, alpha=0.5)
    steps = 17
    s = one_peer()
    clean = train(lambda m, o: StreamingDiLoCo(s, m, o, cfg), corpus, steps)
    assert s.stats.bytes_sent == 0
    # rounds: catch-up (fragment 0), then one every 3 steps, alternating fragments
    frags = [f for _, f in clean.sync_log]  # type: ignore[attr-defined]
    assert frags[:6] == [0, 1, 0, 1, 0, 1]
    assert [r["round"] for r in s.rounds] == list(range(len(frags)))
    s2 = one_peer("fail@collective:step=7")
    failed = train(lambda m, o: StreamingDiLoCo(s2, m, o, cfg), corpus, steps)
    assert s2.faults.fired and failed.pipeline.retries == 1  # type: ignore[attr-defined]
    assert failed.sync_log == clean.sync_log  # type: ignore[attr-defined]
    assert_same(state_of(failed), state_of(clean))


FIRST_ROUND = {
    "diloco": lambda s, m, o: DiLoCo(s, m, o, DiLoCoConfig(sync_every=4)),
    # one fragment: with P > 1 the catch-up round shifts the fragment schedule (round % P)
    # against a run without a session, which has no such round
    "streaming": lambda s, m, o: StreamingDiLoCo(
        s, m, o, StreamingConfig(sync_every=4, fragments=1, overlap=1)
    ),
    "sparseloco": lambda s, m, o: SparseLoCo(s, m, o, SparseLoCoConfig(sync_every=4)),
    "eager": ONE_PEER["eager"],
    "co2": ONE_PEER["co2"],
}


@pytest.mark.parametrize("name", list(FIRST_ROUND))
def test_first_round_commits_without_reducing(one_peer, corpus, monkeypatch, name):
    # The run's first round (every peer's catch-up, nobody has trained) begins and commits, so
    # joiners and parity checks keep their round, but it reduces nothing: round 0 never reaches
    # the reducer (nor SparseLoCo's exchange), and the state is the one a run without a session
    # ends on, bit for bit.
    make = FIRST_ROUND[name]
    steps = 8
    alone = train(lambda m, o: make(None, m, o), corpus, steps)
    s = one_peer()
    reduced: list[int] = []
    start, exchange = Reducer.start, SparseRound.start

    def counting(self: Reducer, rnd, items, **kw):  # type: ignore[no-untyped-def]
        reduced.append(rnd.number)
        return start(self, rnd, items, **kw)

    def counting_exchange(self: SparseRound, rnd, contribute):  # type: ignore[no-untyped-def]
        reduced.append(rnd.number)
        return exchange(self, rnd, contribute)

    monkeypatch.setattr(Reducer, "start", counting)
    monkeypatch.setattr(SparseRound, "start", counting_exchange)
    clean = train(lambda m, o: make(s, m, o), corpus, steps)
    rounds = [(r["round"], r["outcome"]) for r in s.rounds]
    assert rounds[0] == (0, "committed") and all(o == "committed" for _, o in rounds), rounds
    assert reduced == [r for r, _ in rounds[1:]], (reduced, rounds)
    assert clean.step_count == steps
    assert_same(state_of(clean), state_of(alone))


@pytest.mark.parametrize("name", ["diloco", "streaming", "eager"])
def test_join_runs_the_catch_up_round_before_the_first_forward_pass(one_peer, corpus, name):
    # join() runs the catch-up round that the first step() would have been: no forward and
    # backward pass is thrown away (steps passes in all, one more without it) and the state ends
    # bit for bit where the loop without join() ends, and where a run without a session ends.
    make = FIRST_ROUND[name]
    steps = 8
    alone = train(lambda m, o: make(None, m, o), corpus, steps)
    s1, s2 = one_peer(), one_peer()
    late = train(lambda m, o: make(s1, m, o), corpus, steps)
    early = train(lambda m, o: make(s2, m, o), corpus, steps, join=True)
    assert late.forwards == steps + 1 and early.forwards == steps  # type: ignore[attr-defined]
    assert [r["round"] for r in s1.rounds] == [r["round"] for r in s2.rounds]
    assert_same(state_of(early), state_of(late))
    assert_same(state_of(early), state_of(alone))
    early.join()  # a peer that joined already: nothing happens
    assert [r["round"] for r in s2.rounds] == [r["round"] for r in s1.rounds]


# -- several peers: kill during an in-flight reduction, join while one is in flight ------------

MULTI = {
    # kill at the round issued at step 10; the joiner arrives mid-run
    "localsgd": {"sync_every": 5},
    "streaming": {"sync_every": 6, "fragments": 2, "overlap": 2},
    "eager": {"sync_every": 5},
    "co2": {"sync_every": 5},
}


# make test runs Streaming DiLoCo (the round pipeline of pipeline.py with fragments); the
# others share that skeleton and are slow tests (make test-slow)
@pytest.mark.parametrize(
    "strategy",
    [s if s == "streaming" else pytest.param(s, marks=pytest.mark.slow) for s in MULTI],
)
def test_kill_inflight_and_join_inflight_end_bitwise_equal(cluster, strategy):
    # min_peers=3: after the kill the survivors cannot form a round until the joiner is there, so
    # the joiner arrives while the killed round is being retried, however long it takes to start
    c = cluster(start_peers=3, min_peers=3)
    steps = 40
    common = {"strategy": strategy, "strategy_options": MULTI[strategy], "steps": steps}
    c.spawn("a", **common)
    c.spawn("b", faults=["kill@collective:step=10"], **common)
    c.spawn("c", **common)
    c.wait_until(
        lambda st: any(p["name"] == "b" and p["state"] == "dead" for p in st["peers"]),
        "b to be dead",
    )
    c.spawn("j", **common)
    codes = c.wait(timeout=240)
    assert codes == {"a": 0, "b": -signal.SIGKILL, "c": 0, "j": 0}, c.log("j")
    st = c.coord.status(events=2000)
    assert st["counters"]["rounds_aborted"] >= 1
    aborted = {e["round"] for e in st["events"] if e["kind"] == "abort"}
    fa, fc, fj = c.final("a"), c.final("c"), c.final("j")
    # the round b was in when it died aborted for everyone and the survivors retried it
    killed_round = min(aborted)
    for f in (fa, fc):
        attempts = [r for r in f["rounds"] if r["round"] == killed_round]
        assert attempts[0]["outcome"] == "aborted" and attempts[-1]["outcome"] == "committed"
        in_round = [a for a in attempts if a["outcome"] == "aborted" and a["stage"] == "round"]
        # an attempt that failed while its epoch's group was connecting (b died then, which a
        # loaded machine can make happen) is begun again inside Session.begin: the strategy never
        # saw it, so only an attempt that failed in the round itself makes a retry
        if strategy != "localsgd" and in_round:
            assert f["strategy"]["round_retries"] >= 1  # the snapshot was reduced again
    assert fa["step"] == fc["step"] == fj["step"] == steps
    # the joiner was admitted into a round (a reduction every member takes part in, and that, for
    # the overlapped strategies, runs while they train), then contributed to later rounds
    first = fj["rounds"][0]
    assert first["resynced"] and first["outcome"] == "committed" and first["world"] == 3
    later = [r for r in fj["rounds"][1:] if r["outcome"] == "committed"]
    assert later and all(not r["resynced"] and r["world"] == 3 for r in later)
    assert fa["digest"] == fc["digest"] == fj["digest"]
    assert fa["model_digest"] == fc["model_digest"] == fj["model_digest"]
    assert_bitwise_equal(c.state("a"), c.state("c"))
    assert_bitwise_equal(c.state("a"), c.state("j"))
