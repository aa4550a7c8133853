"""Elastic training with real processes (issue 17): with a fixed global batch, kills and joins
are invisible to the optimizer."""

from __future__ import annotations

import json
import signal

import pytest
import torch

from conftest import assert_bitwise_equal
from isthmus.coordinator.stragglers import StragglerConfig, StragglerDetector
from isthmus.data.global_batch import GlobalOrder, step_positions
from isthmus.run.config import from_flat
from isthmus.run.job import build_corpus, build_model, global_batch_loss
from isthmus.strategies.ddp import DDP, DDPConfig

STEPS, BATCH, MICRO = 60, 12, 4
RUN = {"model": "tiny", "corpus_bytes": 200_000, "batch_size": MICRO, "global_batch": BATCH}


def _one_process_run() -> tuple[list[float], list[list[int]]]:
    """The run without any fault: one process, the same model, data, optimizer and samples."""
    run = from_flat(steps=STEPS, strategy="ddp", **RUN)
    corpus, model = build_corpus(run), build_model(run)
    opt = torch.optim.AdamW(
        model.parameters(), lr=run.optim.lr, weight_decay=run.optim.weight_decay, betas=(0.9, 0.95)
    )
    ddp = DDP(None, model, opt, DDPConfig(global_batch=BATCH, micro_batch=MICRO))
    block = model.config.block_size
    order = GlobalOrder(len(corpus.train_data) - block, seed=run.data.seed)
    loss_fn = global_batch_loss(model, corpus, order, block)
    losses, samples = [], []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the peers run; many threads crawl on a busy 2-core box
    try:
        for step in range(STEPS):
            ddp.step(loss_fn)
            opt.zero_grad(set_to_none=False)
            losses.append(ddp.last_loss)
            samples.append(sorted(int(i) for i in order(step_positions(step, BATCH))))
    finally:
        torch.set_num_threads(threads)
    return losses, samples


def test_kill_and_join_do_not_change_the_steps_of_a_fixed_global_batch(cluster) -> None:
    """3 peers, one SIGKILLed at step 20, a new one joining after step 25: every one of the 60
    steps uses the same 12 samples and gives the same loss (to 1e-4; only the summation order
    differs) as one process training on them, and the peers end bit-identical."""
    c = cluster(start_peers=3)
    job = {"steps": STEPS, "step_delay": 0.05, **RUN}
    c.spawn("a", **job)
    c.spawn("b", faults=["kill@20"], **job)
    c.spawn("c", **job)
    c.wait_until(lambda s: s["revision"] >= 25, "25 committed rounds")
    c.spawn("j", **job)
    codes = c.wait(timeout=180)
    assert codes == {"a": 0, "b": -signal.SIGKILL, "c": 0, "j": 0}, c.log("j")
    want_loss, want_samples = _one_process_run()
    records = {n: c.dir.joinpath(f"{n}.jsonl").read_text().splitlines() for n in "abcj"}

    by_step: dict[int, list[dict]] = {}
    for lines in records.values():
        for line in lines:
            r = json.loads(line)
            by_step.setdefault(r["step"], []).append(r)
    assert sorted(by_step) == list(range(STEPS))
    worlds = set()
    for step, rs in by_step.items():
        got = sorted(i for r in rs for i in r["samples"])
        assert got == want_samples[step], f"step {step}"
        assert len({r["loss"] for r in rs}) == 1, f"step {step}: peers disagree {rs}"
        assert rs[0]["loss"] == pytest.approx(want_loss[step], rel=1e-4), f"step {step}"
        worlds.add(len(rs))
    assert worlds == {2, 3}  # the kill and the join both happened inside the 60 steps
    fa = c.final("a")
    assert fa["digest"] == c.final("c")["digest"] == c.final("j")["digest"]


def test_a_time_budget_lets_a_slow_peer_do_fewer_inner_steps(cluster) -> None:
    """DiLoCo with inner_budget=time, one of 3 peers 3x slower: after the first phase (H steps
    for everyone: no rate is known yet) the fast peers run more inner steps per phase than the
    slow one (about 3x on a quiet box), and all end bit-identical."""
    # a 10 s heartbeat bound: under make test's workers a live peer missed the 3 s default, was
    # evicted and found the run finished (this test is about budgets; eviction is tested apart)
    c = cluster(start_peers=3, heartbeat_timeout=10.0)
    opts = {"sync_every": 8, "inner_budget": "time"}
    job = {"steps": 64, "step_delay": 0.03, "strategy": "diloco", "strategy_options": opts}
    for name in "ab":
        c.spawn(name, **job)
    c.spawn("s", faults=["slow:3"], **job)
    assert c.wait(timeout=180) == {"a": 0, "b": 0, "s": 0}, c.log("s")
    phases = {n: c.final(n)["strategy"]["phase_steps"] for n in "abs"}
    assert all(p[0] == 8 for p in phases.values()), phases
    fast = sorted(phases["a"][1:-1] + phases["b"][1:-1])
    slow = sorted(phases["s"][1:-1])
    assert len(slow) >= 3, phases
    ratio = fast[len(fast) // 2] / max(1, slow[len(slow) // 2])
    # 3x on a quiet box; the slow fault stretches s's own work, while make test's load slows
    # the fast peers too (1.75 seen there): what must hold is that s does clearly fewer
    assert 1.3 <= ratio <= 4.5, phases
    assert c.final("a")["digest"] == c.final("b")["digest"] == c.final("s")["digest"]
    assert_bitwise_equal(c.state("a"), c.state("s"))


def test_a_slow_bout_is_flagged_during_it_and_evicted_then_rejoins(cluster) -> None:
    """3 DDP peers; peer s's steps 15 to 34 take 4x as long. With straggler_policy=evict the
    coordinator flags s during the bout (only s, only then), removes it, s registers again and
    is resynced, and the run ends with all three bit-identical. (The steady case, nobody
    flagged, is checked in the kill-and-join run above.)"""
    c = cluster(start_peers=3)
    c.coord.stragglers = StragglerDetector(StragglerConfig(policy="evict"))
    job = {"steps": 60, "step_delay": 0.04}
    for name in "ab":
        c.spawn(name, **job)
    c.spawn("s", faults=["slow:4@15-35"], **job)
    assert c.wait(timeout=180) == {"a": 0, "b": 0, "s": 0}, c.log("s")
    events = c.coord.events()
    flags = [e for e in events if e["kind"] == "straggler"]
    assert flags and {e["name"] for e in flags} == {"s"}, flags
    # from the bout on (the detection lags; under load s may still be flagged as it catches up)
    assert all(e["step"] >= 15 for e in flags), flags
    removed = [e for e in events if e["kind"] == "dead" and "straggler" in e.get("reason", "")]
    assert removed and {e["name"] for e in removed} == {"s"}
    assert c.final("s")["evictions"] >= 1
    assert sum(e["kind"] == "register" and e["name"] == "s" for e in events) >= 2
    assert c.final("a")["digest"] == c.final("b")["digest"] == c.final("s")["digest"]
    assert c.coord.status()["stragglers"]["flagged"] == []
