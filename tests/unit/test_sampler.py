"""Elastic sampler: the ledger arithmetic, and simulated runs with made-up round plans (kills,
joins, aborted rounds, resyncs, DDP-like and DiLoCo-like intervals) in which every sample of an
epoch must be used exactly once by a committed round, and exactly by the peers that drew it."""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from isthmus.coordinator.protocol import RoundPlan, Transfer
from isthmus.data import ElasticSampler, LedgerOverflow, TokenDataset, prepare
from isthmus.data.ledger import (
    EpochOrder,
    Position,
    commit,
    draw,
    merge,
    share,
    share_bounds,
    subtract,
)

# ------------------------------------------------------------------------------ pure functions


def _positions(ranges: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> list[int]:
    return [p for s, n in ranges for p in range(s, s + n)]


def test_order_is_a_seeded_permutation_per_epoch() -> None:
    for n in [1, 2, 3, 4, 5, 7, 16, 17, 100, 1000, 4097]:
        order = EpochOrder(n, seed=3)
        for epoch in range(3):
            assert sorted(order(epoch, range(n)).tolist()) == list(range(n))
    order = EpochOrder(1000, seed=0)
    a = order(0, range(1000)).tolist()
    assert a == EpochOrder(1000, seed=0)(0, range(1000)).tolist()  # deterministic
    assert a != order(1, range(1000)).tolist()  # epochs differ
    assert a != EpochOrder(1000, seed=1)(0, range(1000)).tolist()  # seeds differ
    # any position can be read directly, in any order
    assert order(0, [999, 0, 500]).tolist() == [a[999], a[0], a[500]]


def test_order_never_touches_the_global_rng_and_is_pinned() -> None:
    # Peers of one run and resumed checkpoints rely on these exact values: a change to the
    # permutation must be deliberate (and breaks resuming runs mid-epoch).
    torch.manual_seed(0)
    np.random.seed(0)
    before = (torch.random.get_rng_state(), np.random.get_state()[1].copy())
    assert EpochOrder(10, seed=0)(0, range(10)).tolist() == [5, 3, 6, 8, 0, 2, 7, 9, 1, 4]
    assert torch.equal(torch.random.get_rng_state(), before[0])
    assert np.array_equal(np.random.get_state()[1], before[1])
    with pytest.raises(ValueError, match="positions"):
        EpochOrder(10, seed=0)(0, [10])
    with pytest.raises(ValueError, match="seed"):
        EpochOrder(10, seed=-1)


def test_shares_are_contiguous_and_the_first_ranks_one_larger() -> None:
    for size in range(0, 30):
        for world in range(1, 8):
            bounds = [share_bounds(size, r, world) for r in range(world)]
            expected = np.array_split(np.arange(size), world)
            assert [list(range(lo, hi)) for lo, hi in bounds] == [e.tolist() for e in expected]
    block = ((10, 3), (20, 4))  # positions 10 11 12 20 21 22 23
    assert [_positions(share(block, r, 3)) for r in range(3)] == [
        [10, 11, 12],
        [20, 21],
        [22, 23],
    ]
    with pytest.raises(ValueError, match="rank"):
        share_bounds(5, 3, 3)


def test_merge_and_subtract_match_set_arithmetic() -> None:
    rng = random.Random(0)
    for _ in range(300):
        a = [(rng.randrange(50), rng.randrange(0, 6)) for _ in range(rng.randrange(6))]
        b = [(rng.randrange(50), rng.randrange(0, 6)) for _ in range(rng.randrange(6))]
        merged = merge(a)
        assert _positions(merged) == sorted(set(_positions(a)))
        assert all(merged[i][0] + merged[i][1] < merged[i + 1][0] for i in range(len(merged) - 1))
        assert _positions(subtract(a, b)) == sorted(set(_positions(a)) - set(_positions(b)))


def test_blocks_take_the_ledger_first_and_never_span_epochs() -> None:
    # n = 10 samples per epoch, B = 4: the ledger owes 2-4 and 8, the cursor is at 9.
    blocks = draw([(2, 3), (8, 1)], 9, 10, 4, 4)
    assert [_positions(b) for b in blocks] == [
        [2, 3, 4, 8],
        [9],
        [10, 11, 12, 13],
        [14, 15, 16, 17],
    ]


def test_commit_uses_the_contributors_shares_and_owes_the_rest() -> None:
    pos = Position(epoch=0, cursor=0, ledger=(), assigners=(4, 7, 9))
    # two blocks of 6 drawn; peer 7 died (not a member); peer 9 was resynced; 12 joined
    new, used = commit(pos, n=100, batch_size=6, drawn=2, members=(4, 9, 12), resynced={9, 12})
    assert _positions(used) == [0, 1, 6, 7]  # peer 4's shares of both blocks
    assert new.ledger == ((2, 4),)  # positions 2-5 are owed; 8-11 fold back under the cursor
    assert new.cursor == 8 and new.epoch == 0 and new.assigners == (4, 9, 12)
    # before any commit nobody has a share: everything drawn stays owed, the cursor goes back
    new, used = commit(Position(), n=100, batch_size=6, drawn=3, members=(0, 1), resynced=())
    assert used == [] and new == Position(assigners=(0, 1))


def test_commit_advances_the_epoch_once_nothing_of_it_is_owed() -> None:
    # n = 10, B = 4, one peer: blocks 0-3, 4-7, 8-9 (short), then epoch 1's 10-13
    pos = Position(epoch=5, cursor=0, ledger=(), assigners=(0,))
    new, used = commit(pos, n=10, batch_size=4, drawn=4, members=(0,), resynced=())
    assert _positions(used) == list(range(14))
    assert new == Position(epoch=6, cursor=4, ledger=(), assigners=(0,))
    # two peers, peer 1 gone: its halves of epoch 5 stay owed, so the epoch stays 5 although
    # the cursor is already in epoch 6 (its share 12-13 of epoch 6 folds back under the cursor)
    pos = Position(epoch=5, cursor=0, ledger=(), assigners=(0, 1))
    new, _ = commit(pos, n=10, batch_size=4, drawn=4, members=(0,), resynced=())
    assert new == Position(epoch=5, cursor=12, ledger=((2, 2), (6, 2), (9, 1)), assigners=(0,))
    # a later commit that uses them all moves on to epoch 6, re-based
    new, used = commit(new, n=10, batch_size=4, drawn=3, members=(0,), resynced=())
    assert _positions(used) == [2, 3, 6, 7, 9, 12, 13, 14, 15]
    assert new == Position(epoch=6, cursor=6, ledger=(), assigners=(0,))


# ----------------------------------------------------------------------------- the simulator


class FakeSession:
    """What ElasticSampler.attach needs: register tensors, add a commit hook."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}
        self.hooks: list[Callable[[Any], None]] = []

    def register(self, name: str, tensor: torch.Tensor) -> None:
        assert name not in self.state
        self.state[name] = tensor

    def add_commit_hook(self, fn: Callable[[Any], None]) -> None:
        self.hooks.append(fn)


@dataclass
class Peer:
    pid: int
    sampler: ElasticSampler
    session: FakeSession
    rank_world: tuple[int, int] = (0, 1)  # of the last round it was in; (0, 1) before any
    in_sync: bool = False
    drawn: list[list[int]] = field(default_factory=list)  # indices drawn since the last commit


class Sim:
    """Peers, each with its own sampler and fake session, and a coordinator's rules in brief:
    at formation the in-sync members vote on each shared tensor (majority, ties to the lowest
    id; at the start everyone votes), members holding another value receive it and are
    resynced; a commit runs every member's hooks; an abort runs none."""

    def __init__(self, n: int, batch: int, tmp: Path, *, seed: int = 0, capacity: int = 4096):
        self.n, self.batch, self.tmp, self.seed, self.capacity = n, batch, tmp, seed, capacity
        self.peers: dict[int, Peer] = {}
        self.next_pid = 0
        self.round = 0
        self.started = False
        self.commits: list[tuple[int, list[int]]] = []  # (round, used indices)

    def join(self) -> int:
        pid = self.next_pid
        self.next_pid += 1
        s = ElasticSampler(
            self.n,
            self.batch,
            seed=self.seed,
            ledger_capacity=self.capacity,
            used_log=self.tmp / f"used-{pid}.jsonl",
        )
        session = FakeSession()
        s.attach(session)
        self.peers[pid] = Peer(pid, s, session)
        return pid

    def kill(self, pid: int) -> None:
        del self.peers[pid]

    def train(self, pid: int, steps: int) -> None:
        p = self.peers[pid]
        for _ in range(steps):
            p.drawn.append(p.sampler.indices(*p.rank_world))

    def train_all(self, steps: int) -> None:
        for pid in self.peers:
            self.train(pid, steps)

    def form(self) -> RoundPlan:
        members = sorted(self.peers)
        voters = [m for m in members if self.peers[m].in_sync] if self.started else members
        names = list(self.peers[members[0]].session.state)
        transfers = []
        for m in members:
            wrong = []
            for name in names:
                votes = Counter(self.peers[v].session.state[name].numpy().tobytes() for v in voters)
                best = max(votes.values())
                canon = next(
                    v
                    for v in sorted(voters)
                    if votes[self.peers[v].session.state[name].numpy().tobytes()] == best
                )
                src = self.peers[canon].session.state[name]
                if not torch.equal(self.peers[m].session.state[name], src):
                    wrong.append((name, canon))
            if wrong:
                transfers.append(Transfer(wrong[0][1], m, tuple(n for n, _ in wrong)))
                for name, canon in wrong:
                    self.peers[m].session.state[name].copy_(self.peers[canon].session.state[name])
        for m in members:
            self.peers[m].rank_world = (members.index(m), len(members))
            self.peers[m].in_sync = self.peers[m].in_sync and m not in {t.dst for t in transfers}
        self.started = True
        return RoundPlan(self.round, 0, tuple(members), tuple(transfers), {}, True)

    def abort(self, plan: RoundPlan, kill: int | None = None) -> None:
        assert plan.round == self.round
        if kill is not None:
            self.kill(kill)

    def commit(self, plan: RoundPlan) -> list[int]:
        members = list(plan.members)
        first = self.peers[members[0]].sampler
        before = first.position
        contributors = [p for p in before.assigners if p in plan.members and p not in plan.resynced]
        expected = sorted(i for c in contributors for batch in self.peers[c].drawn for i in batch)
        for m in members:
            for hook in self.peers[m].session.hooks:
                hook(plan)
        used = first.last_used
        # the samples used are exactly those the contributors drew and trained on
        assert sorted(used) == expected
        for m in members:
            p = self.peers[m]
            assert p.sampler.last_used == used
            assert p.sampler.state_dict().keys() == first.state_dict().keys()
            for k, v in first.state_dict().items():
                assert torch.equal(p.sampler.state_dict()[k], v), (m, k)
            p.in_sync = True
            p.drawn = []
        self.commits.append((self.round, used))
        self.round += 1
        return used

    def run_round(self) -> list[int]:
        return self.commit(self.form())

    def used_by_epoch(self) -> dict[int, list[int]]:
        """Every commit's used indices by epoch, from the used logs of all peers ever (each
        round once: every member writes the same lines)."""
        lines: dict[tuple[int, int], list[int]] = {}
        for f in sorted(self.tmp.glob("used-*.jsonl")):
            for line in f.read_text().splitlines():
                d = json.loads(line)
                key = (d["round"], d["epoch"])
                assert lines.setdefault(key, d["used"]) == d["used"]
        out: dict[int, list[int]] = {}
        for (_, epoch), used in sorted(lines.items()):
            out.setdefault(epoch, []).extend(used)
        return out


def _assert_exactly_once(sim: Sim, *, complete_epochs: int) -> None:
    by_epoch = sim.used_by_epoch()
    for e in range(complete_epochs):
        assert sorted(by_epoch[e]) == list(range(sim.n)), f"epoch {e}"
    for e, used in by_epoch.items():
        assert len(used) == len(set(used)), f"epoch {e} used a sample twice"


# ---------------------------------------------------------------------- scenario simulations


def test_kill_join_abort_catch_up_ddp_and_diloco_use_every_sample_once(tmp_path: Path) -> None:
    sim = Sim(n=100, batch=6, tmp=tmp_path, seed=7)
    for _ in range(3):
        sim.join()
    # the catch-up round (a starting peer's first step): no assigners yet, nothing is used
    sim.train_all(1)
    assert sim.run_round() == []
    H = 3
    # DiLoCo-like: H blocks per round under members [0, 1, 2]
    sim.train_all(H)
    assert len(sim.run_round()) == H * 6
    # a kill mid-round: the attempt aborts; the survivors retry and commit; peer 2's shares
    # (a third of each block) are owed again
    sim.train_all(H)
    sim.abort(sim.form(), kill=2)
    assert len(sim.run_round()) == H * 4
    # a join: peer 3 draws one batch before its catch-up round while the members draw H; it is
    # resynced in that round (its data/drawn too), contributes nothing, and counts afterwards
    pid = sim.join()
    sim.train(pid, 1)
    sim.train(0, H)
    sim.train(1, H)
    plan = sim.form()
    assert plan.resynced == {pid}
    assert len(sim.commit(plan)) >= H * 6  # the owed shares first, whole blocks of 2 peers
    # an aborted round with no death: the retry commits what the same draws would have
    sim.train_all(H)
    sim.abort(sim.form())
    assert len(sim.run_round()) == H * 6
    # DDP-like until well into the next epoch, with one more kill and join on the way
    for step in range(60):
        sim.train_all(1)
        if step == 10:
            sim.abort(sim.form(), kill=0)
        if step == 20:
            sim.train(sim.join(), 0)
        sim.run_round()
    assert sim.peers[1].sampler.epoch >= 1
    _assert_exactly_once(sim, complete_epochs=1)


def test_a_peer_with_another_batch_count_is_repaired_and_does_not_count(tmp_path: Path) -> None:
    sim = Sim(n=60, batch=6, tmp=tmp_path)
    for _ in range(3):
        sim.join()
    sim.train_all(1)
    sim.run_round()
    sim.train(0, 2)
    sim.train(1, 2)
    sim.train(2, 3)  # out-voted: its data/drawn is repaired, its work does not count
    plan = sim.form()
    assert plan.resynced == {2}
    used = sim.commit(plan)
    assert len(used) == 2 * 4


def test_blocks_spill_into_the_next_epoch_without_mixing(tmp_path: Path) -> None:
    # 10 samples, global batch 4, 2 peers, 5 batches per interval: one interval crosses into
    # epoch 1 while a dead peer's share of epoch 0 is still owed.
    sim = Sim(n=10, batch=4, tmp=tmp_path, seed=1)
    sim.join()
    sim.join()
    sim.train_all(1)
    sim.run_round()
    sim.train_all(5)
    order = EpochOrder(10, seed=1)
    e0, e1 = set(order(0, range(10)).tolist()), set(order(1, range(10)).tolist())
    # every block's two shares together come from one epoch: blocks 0-1 epoch 0, block 2 the
    # short end of epoch 0 (2 samples: one each), blocks 3-4 epoch 1's start
    d0, d1 = sim.peers[0].drawn, sim.peers[1].drawn
    assert [len(a) + len(b) for a, b in zip(d0, d1, strict=True)] == [4, 4, 2, 4, 4]
    assert all(set(a + b) <= e0 for a, b in zip(d0[:3], d1[:3], strict=True))
    sim.abort(sim.form(), kill=1)
    sim.run_round()  # peer 1's halves of both epochs are owed
    assert sim.peers[0].sampler.epoch == 0
    for _ in range(30):
        sim.train_all(5)
        sim.run_round()
    assert sim.peers[0].sampler.epoch >= 5
    _assert_exactly_once(sim, complete_epochs=5)
    assert all(len(e0) == 10 for e0 in [e0, e1])


@pytest.mark.parametrize("seed", range(6))
def test_random_churn_keeps_exactly_once(tmp_path: Path, seed: int) -> None:
    """Random kills, joins, aborts and interval lengths over many rounds."""
    rng = random.Random(seed)
    n, batch = rng.choice([(37, 5), (64, 8), (101, 7)])
    sim = Sim(n=n, batch=batch, tmp=tmp_path, seed=seed)
    for _ in range(rng.randint(1, 4)):
        sim.join()
    sim.train_all(1)
    sim.run_round()
    for _ in range(120):
        steps = rng.choice([1, 1, 2, 4])
        joiner = sim.join() if rng.random() < 0.1 and len(sim.peers) < 6 else None
        for pid in list(sim.peers):
            sim.train(pid, 1 if pid == joiner else steps)
        event = rng.random()
        # a kill needs a survivor that holds the run's state (the coordinator would wait)
        victims = [
            p for p in sorted(sim.peers) if any(q.in_sync for q in sim.peers.values() if q.pid != p)
        ]
        if event < 0.15 and victims:
            sim.abort(sim.form(), kill=rng.choice(victims))
        elif event < 0.25:
            sim.abort(sim.form())
        sim.run_round()
    epoch = min(p.sampler.epoch for p in sim.peers.values())
    assert epoch >= 2
    _assert_exactly_once(sim, complete_epochs=epoch)


# ------------------------------------------------------------------ the sampler as an object


def test_attach_registers_the_documented_tensors_and_a_hook() -> None:
    s = ElasticSampler(1000, 32, seed=5, ledger_capacity=64, max_peers=16)
    session = FakeSession()
    s.attach(session)
    assert {k: (tuple(v.shape), v.dtype) for k, v in session.state.items()} == {
        "data/epoch": ((1,), torch.int64),
        "data/cursor": ((1,), torch.int64),
        "data/drawn": ((1,), torch.int64),
        "data/ledger": ((64, 2), torch.int64),
        "data/ledger_count": ((1,), torch.int64),
        "data/assigners": ((16,), torch.int64),
        "data/config": ((3,), torch.int64),
    }
    assert session.state["data/config"].tolist() == [1000, 32, 5]
    assert session.hooks == [s.on_commit]
    assert all(t.is_contiguous() for t in session.state.values())
    with pytest.raises(RuntimeError, match="twice"):
        s.attach(session)


def test_without_a_session_each_call_consumes_its_block() -> None:
    # one process: consecutive calls walk the whole order, epoch after epoch
    s = ElasticSampler(10, 4, seed=2)
    got = [s.indices(0, 1) for _ in range(6)]
    assert [len(g) for g in got] == [4, 4, 2, 4, 4, 2]
    epoch0 = [i for g in got[:3] for i in g]
    assert sorted(epoch0) == list(range(10))
    assert epoch0 == EpochOrder(10, seed=2)(0, range(10)).tolist()
    assert s.epoch == 2
    # a fixed-size torch job: each rank has its own sampler, the shares tile each block
    a, b = ElasticSampler(10, 4, seed=2), ElasticSampler(10, 4, seed=2)
    shares = [(a.indices(0, 2), b.indices(1, 2)) for _ in range(3)]
    assert sorted(i for x, y in shares for i in x + y) == list(range(10))


def test_the_ranks_of_an_island_split_its_share_and_use_it_once() -> None:
    """Islands of 2 and 1 ranks: every rank holds the sampler's shared state and draws its
    part of its island's share; the parts are disjoint and together are what the commit uses."""
    sizes = {(0, 0): 2, (0, 1): 2, (1, 0): 1}  # (peer, local rank) -> its island's size
    samplers = {key: ElasticSampler(40, 7, seed=1) for key in sizes}
    for s in samplers.values():
        s.attach(FakeSession())
    for rnd in range(2):  # the first round's work is owed again (nobody knew the membership)
        drawn = {
            (peer, r): [i for _ in range(3) for i in s.indices(peer, 2, local_rank=r,
                                                               local_world=sizes[(peer, r)])]
            for (peer, r), s in samplers.items()
        }  # fmt: skip
        plan = SimpleNamespace(round=rnd, members=(0, 1), resynced=())
        for s in samplers.values():
            s.on_commit(plan)
    every = [i for got in drawn.values() for i in got]
    assert len(every) == len(set(every)) == 21  # 3 blocks of 7, no sample twice
    assert all(sorted(s.last_used) == sorted(every) for s in samplers.values())
    # a block of 7: 4 to the island of 2 (2 + 2 over its ranks), 3 to the island of 1
    assert [len(drawn[k]) for k in sorted(drawn)] == [6, 6, 9]
    assert len({tuple(s.state_dict()["cursor"].tolist()) for s in samplers.values()}) == 1
    with pytest.raises(ValueError, match="local_rank must be in"):
        samplers[(0, 0)].indices(0, 2, local_rank=2, local_world=2)


def test_assignment_says_whose_work_will_count(tmp_path: Path) -> None:
    sim = Sim(n=50, batch=4, tmp=tmp_path)
    sim.join()
    sim.join()
    assert sim.peers[0].sampler.assignment(0) is None  # nothing counts before the first commit
    sim.train_all(1)
    sim.run_round()
    assert sim.peers[0].sampler.assignment(1) == (1, 2)
    assert sim.peers[0].sampler.assignment(5) is None


def test_ledger_overflow_is_a_clear_error_and_changes_nothing(tmp_path: Path) -> None:
    sim = Sim(n=100, batch=6, tmp=tmp_path, capacity=1)
    for _ in range(3):
        sim.join()
    sim.train_all(1)
    sim.run_round()
    sim.train_all(2)
    sim.abort(sim.form(), kill=1)  # the middle peer's shares: two separate ranges owed
    plan = sim.form()
    before = sim.peers[0].sampler.state_dict()
    with pytest.raises(LedgerOverflow, match="ledger_capacity"):
        sim.peers[0].sampler.on_commit(plan)
    after = sim.peers[0].sampler.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_peer_with_other_settings_fails_clearly_after_resync() -> None:
    run, other = ElasticSampler(100, 8, seed=1), ElasticSampler(99, 8, seed=1)
    run.attach(FakeSession())
    other.attach(FakeSession())
    for k, t in other.tensors().items():  # what a resync does
        t.copy_(run.tensors()[k])
    with pytest.raises(ValueError, match=r"same dataset, global batch size and seed"):
        other.indices(0, 1)
    plan = RoundPlan(0, 0, (0,), (), {}, True)
    with pytest.raises(ValueError, match=r"\(99, 8, 1\).*\(100, 8, 1\)"):
        other.on_commit(plan)


def test_state_dict_round_trip_resumes_the_same_batches(tmp_path: Path) -> None:
    sim = Sim(n=40, batch=6, tmp=tmp_path, seed=4)
    for _ in range(3):
        sim.join()
    sim.train_all(1)
    sim.run_round()
    sim.train_all(2)
    sim.abort(sim.form(), kill=1)
    sim.run_round()
    s = sim.peers[0].sampler
    assert s.position.ledger  # something is owed: the state is not trivial
    saved = s.state_dict()
    fresh = ElasticSampler(40, 6, seed=4)
    fresh.attach(FakeSession())
    fresh.load_state_dict(saved)
    assert fresh.position == s.position
    assert [fresh.indices(r, 2) for r in (0, 1)] == [s.indices(r, 2) for r in (0, 1)]
    # mismatches are refused and leave the sampler unchanged
    with pytest.raises(ValueError, match="ledger_capacity"):
        ElasticSampler(40, 6, seed=4, ledger_capacity=8).load_state_dict(saved)
    with pytest.raises(ValueError, match="seed"):
        ElasticSampler(40, 6, seed=5).load_state_dict(saved)
    bad = {k: v.clone() for k, v in saved.items()}
    bad["cursor"][0] = 0
    before = fresh.state_dict()
    with pytest.raises(ValueError, match="below the cursor"):
        fresh.load_state_dict(bad)
    assert all(torch.equal(before[k], fresh.state_dict()[k]) for k in before)
    with pytest.raises(ValueError, match="keys"):
        fresh.load_state_dict({"epoch": saved["epoch"]})


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        ElasticSampler(10, 0)
    with pytest.raises(ValueError, match="length"):
        ElasticSampler([], 4)
    with pytest.raises(ValueError, match="seed"):
        ElasticSampler(10, 4, seed=-1)
    s = ElasticSampler(10, 4)
    with pytest.raises(ValueError, match="rank"):
        s.indices(2, 2)
    assert ElasticSampler(range(10), 4).num_samples == 10
    assert ElasticSampler(np.int64(10), 4).num_samples == 10


def test_a_sampler_over_prepared_token_files_visits_every_window_once(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("".join(f"line {i}: {i * i % 977}\n" for i in range(400)))
    prepare([text], tmp_path / "tok", eval_fraction=0, progress=False)
    ds = TokenDataset(tmp_path / "tok", 16)
    starts = {tuple(ds[i][0][:16].tolist()) for i in range(len(ds))}
    assert len(starts) == len(ds)  # windows are distinct, so rows identify them
    a, b = ElasticSampler(ds, 8, seed=1), ElasticSampler(ds, 8, seed=1)
    seen = []
    for _ in range(ElasticSampler(ds, 8).batches_per_epoch):
        for s, rank in ((a, 0), (b, 1)):
            x, y = ds.batch(s.indices(rank, 2))
            assert torch.equal(x[:, 1:], y[:, :-1])
            seen += [tuple(row) for row in x.tolist()]
    assert sorted(seen) == sorted(starts)


def test_a_first_round_that_trains_on_its_batches_uses_them_once(tmp_path: Path) -> None:
    """DDP trains on its first batch, drawn before anyone knew the membership (every peer as
    rank 0 of 1): with ``first_round_uses_work`` that whole block counts once, and the next
    blocks are split by the first round's members."""
    sim = Sim(n=60, batch=6, tmp=tmp_path, seed=3)
    for _ in range(3):
        pid = sim.join()
        sim.peers[pid].session.first_round_uses_work = True  # type: ignore[attr-defined]
    sim.train_all(1)
    drawn = {pid: p.drawn[0] for pid, p in sim.peers.items()}
    assert drawn[0] == drawn[1] == drawn[2] and len(drawn[0]) == 6  # the whole first block
    plan = sim.form()
    for pid in plan.members:
        for hook in sim.peers[pid].session.hooks:
            hook(plan)
    used = sim.peers[0].sampler.last_used
    assert sorted(used) == sorted(drawn[0])
    for p in sim.peers.values():
        p.in_sync, p.drawn = True, []
    sim.round += 1
    while len(sim.used_by_epoch().get(0, [])) < sim.n:
        sim.train_all(1)
        sim.run_round()
    _assert_exactly_once(sim, complete_epochs=1)
