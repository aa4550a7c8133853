"""The Hugging Face integration in one process: the reader's indices through the elastic
sampler (two simulated peers, one killed: every row of an epoch once, and the rows handed out
are the dataset's), the optimizer wrapper under a Trainer schedule, the schedule's jump to the
run's step, and the callback's control of the Trainer."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="the integration needs transformers")
datasets = pytest.importorskip("datasets", reason="the reader's tests use a datasets.Dataset")

from transformers import TrainerControl, TrainerState, get_scheduler  # noqa: E402

from isthmus import DDP  # noqa: E402
from isthmus.coordinator.protocol import RoundPlan  # noqa: E402
from isthmus.integrations import hf  # noqa: E402


@dataclass
class FakeSession:
    """What the reader's sampler needs of a session: shared tensors, commit hooks, rank, world."""

    rank: int = 0
    world: int = 1
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    hooks: list[Any] = field(default_factory=list)

    def register(self, name: str, tensor: torch.Tensor) -> None:
        self.tensors[name] = tensor

    def add_commit_hook(self, fn: Any) -> None:
        self.hooks.append(fn)


def _table(rows: int) -> Any:
    return datasets.Dataset.from_dict(
        {"row": list(range(rows)), "input_ids": [[r, r + 1] for r in range(rows)]}
    )


def _commit(peers: dict[int, tuple[FakeSession, hf.ElasticReader]], rnd: int) -> list[int]:
    """Commit a round of the live peers (ids are peer ids, ranks their order); returns the
    indices it used, the same on every member."""
    members = tuple(sorted(peers))
    # shared state is identical on members: copy from the first (a repair if it was not)
    first = peers[members[0]][0].tensors
    for m in members[1:]:
        for name, t in peers[m][0].tensors.items():
            t.copy_(first[name])
    plan = RoundPlan(rnd, 0, members, (), {}, True)
    used = []
    for m in members:
        session, reader = peers[m]
        session.rank, session.world = members.index(m), len(members)
        for hook in session.hooks:
            hook(plan)
        used.append(reader.sampler.last_used)
    assert all(u == used[0] for u in used)
    return used[0]


def test_every_row_of_an_epoch_is_read_once_across_a_kill() -> None:
    rows, batch = 40, 4
    table = _table(rows)
    peers: dict[int, tuple[FakeSession, hf.ElasticReader]] = {}
    for pid in (0, 1):
        s = FakeSession()
        peers[pid] = (s, hf.ElasticReader(table, global_batch=batch, session=s, seed=7))
    used: list[int] = []
    rnd = 0
    used += _commit(peers, rnd)  # the catch-up round: nobody drew yet
    seen: dict[int, list[int]] = {0: [], 1: []}

    def draw(pid: int, steps: int) -> None:
        session, reader = peers[pid]
        for _ in range(steps):
            idx = reader.indices()
            got = reader.examples(idx)
            # the rows handed out are the dataset's rows at those indices, whole
            assert [g["row"] for g in got] == idx
            assert [g["input_ids"] for g in got] == [[i, i + 1] for i in idx]
            assert len(idx) == batch // session.world
            seen[pid] += idx

    for rnd in range(1, 4):  # three rounds of two peers, 2 steps each
        draw(0, 2)
        draw(1, 2)
        used += _commit(peers, rnd)
    draw(0, 2)
    draw(1, 2)
    del peers[1]  # peer 1 dies before the round commits: its two shares are owed again
    rnd += 1
    used += _commit(peers, rnd)
    while len(used) < rows:  # the survivor alone reads the rest of the epoch, whole batches
        draw(0, 1)
        rnd += 1
        used += _commit(peers, rnd)
    assert sorted(used) == list(range(rows))
    assert peers[0][1].sampler.epoch == 1
    # the dead peer's last shares were handed out to it and then read again by the survivor
    assert set(seen[1][-4:]) <= set(seen[0])


def test_drop_last_and_empty_shares() -> None:
    table = _table(10)
    reader = hf.ElasticReader(table, global_batch=4)
    assert len(reader) == 8  # the last 10 % 4 rows are not read
    got = [i for _ in range(4) for i in reader.indices()]  # no session: whole batches
    assert sorted(got[:8]) == list(range(8)) and sorted(got[8:]) == list(range(8))
    short = hf.ElasticReader(table, global_batch=4, drop_last=False, session=FakeSession())
    short.session.rank, short.session.world = 2, 3
    short.sampler._t["drawn"][0] = 2  # the third block of the epoch: 2 rows for 3 peers
    with pytest.raises(RuntimeError, match="drop_last=True"):
        short.indices()
    with pytest.raises(ValueError, match="fewer than one global batch"):
        hf.ElasticReader(_table(3), global_batch=4)
    with pytest.raises(ValueError, match="global_batch"):
        hf.ElasticReader(table, global_batch=0)


def test_a_dataset_on_disk_and_a_plain_one(tmp_path: Path) -> None:
    _table(12).save_to_disk(str(tmp_path / "ds"))
    reader = hf.ElasticReader(tmp_path / "ds", global_batch=6)
    idx = reader.indices()
    assert [r["row"] for r in reader.examples(idx)] == idx
    plain = hf.ElasticReader([{"x": i} for i in range(6)], global_batch=3)
    batch = next(iter(plain.batches(lambda rows: torch.tensor([r["x"] for r in rows]))))
    assert batch.shape == (3,)


def test_missing_datasets_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match=r"isthmus\[hf\]"):
        hf.ElasticReader("some/dir", global_batch=2)


def test_the_optimizer_wrapper_steps_the_strategy_under_a_trainer_schedule() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    inner = torch.optim.AdamW(model.parameters(), lr=0.1)
    strategy = DDP(None, model, inner)
    opt = hf.StrategyOptimizer(strategy)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    sched = get_scheduler("cosine", opt, num_warmup_steps=2, num_training_steps=10)
    for _ in range(3):
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    assert strategy.step_count == 3
    assert inner.param_groups[0]["lr"] == sched.get_last_lr()[0] < 0.1
    assert opt.state_dict()["state"].keys() == inner.state_dict()["state"].keys()
    with pytest.raises(RuntimeError, match="inner optimizer"):
        opt.add_param_group({"params": []})


def test_a_schedule_jumps_to_the_runs_step_as_if_it_had_stepped() -> None:
    def make() -> Any:
        p = torch.nn.Parameter(torch.zeros(1))
        return get_scheduler(
            "cosine", torch.optim.SGD([p], lr=1.0), num_warmup_steps=3, num_training_steps=20
        )

    stepped, jumped = make(), make()
    for _ in range(13):
        stepped.optimizer.step()
        stepped.step()
    jumped.optimizer.step()
    jumped.step()  # a joiner's first step, then the jump to the run's step 13
    hf._align_schedule(jumped, 13)
    assert jumped.get_last_lr() == stepped.get_last_lr()
    assert jumped.optimizer.param_groups[0]["lr"] == stepped.optimizer.param_groups[0]["lr"]
    stepped.optimizer.step()
    stepped.step()
    jumped.optimizer.step()
    jumped.step()
    assert jumped.get_last_lr() == stepped.get_last_lr()


def test_the_callback_keeps_the_trainer_on_the_run(tmp_path: Path) -> None:
    reports: list[dict[str, Any]] = []
    session = SimpleNamespace(name="peer1.1", rank=1, report=lambda **kw: reports.append(kw))
    finished: list[bool] = []
    joins: list[bool] = []
    strategy = SimpleNamespace(
        session=session, step_count=0, finish=lambda: finished.append(True),
        join=lambda: joins.append(True),
    )  # fmt: skip
    cb = hf.IsthmusCallback(strategy, save_pretrained=tmp_path / "m")  # type: ignore[arg-type]
    args = SimpleNamespace(max_steps=20, world_size=1)
    state, control = TrainerState(max_steps=20), TrainerControl()
    cb.on_train_begin(args, state, control)
    assert joins == [True] and state.global_step == 0 and cb.joined_at is None  # a starter
    with pytest.raises(ValueError, match="max_steps"):
        cb.on_train_begin(SimpleNamespace(max_steps=-1, world_size=1), state, control)

    state.global_step, strategy.step_count = 1, 1
    cb.on_step_end(args, state, control)
    assert state.global_step == 1 and cb.joined_at is None and reports[-1] == {"step": 1}

    # a joiner: its catch-up round, run by on_train_begin, put it at the run's step
    cb = hf.IsthmusCallback(strategy, save_pretrained=tmp_path / "m")  # type: ignore[arg-type]
    state, strategy.step_count = TrainerState(max_steps=20), 11
    cb.on_train_begin(args, state, control)
    assert joins == [True, True] and state.global_step == 11 and cb.joined_at == 11
    state.global_step += 1  # the Trainer's count after its first step
    strategy.step_count = 12
    control.should_save = True
    cb.on_step_end(args, state, control)
    assert state.global_step == 12 and cb.joined_at == 11
    assert not control.should_save and not control.should_training_stop
    assert reports[-1] == {"step": 12}

    state.global_step, strategy.step_count = 13, 20
    cb.on_step_end(args, state, control)
    assert control.should_training_stop and state.global_step == 20

    # a strategy whose join() does nothing (DDP): a joiner jumps at its first step instead
    ddp = hf.IsthmusCallback(strategy)  # type: ignore[arg-type]
    ddp_state, strategy.step_count = TrainerState(max_steps=20), 0
    ddp.on_train_begin(args, ddp_state, TrainerControl())
    ddp_state.global_step, strategy.step_count = 1, 9
    ddp.on_step_end(args, ddp_state, TrainerControl())
    assert ddp_state.global_step == 9 and ddp.joined_at == 9

    saved: list[Path] = []
    model = SimpleNamespace(save_pretrained=saved.append)
    cb.on_train_end(args, state, control, model=model)
    assert finished == [True] and saved == [] and cb.saved is None  # rank 1 does not save
    session.rank = 0
    cb.on_train_end(args, state, control, model=model)
    assert saved == [tmp_path / "m"] and cb.saved == tmp_path / "m"
