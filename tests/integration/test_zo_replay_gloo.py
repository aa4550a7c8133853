"""A stale ``zo`` member brought up to date over a real in-process Gloo pair
(:func:`isthmus.comm.transfer.apply_transfers`), by replay, by transfer and by a replay that does
not match and falls back, each verified against the source's hashes."""

from __future__ import annotations

import pytest
import torch

from isthmus.comm.group import Group
from isthmus.comm.transfer import apply_transfers
from isthmus.coordinator.protocol import RoundPlan, Transfer
from isthmus.data import Corpus
from isthmus.models import GPT
from isthmus.strategies.zo import ZO, ZOConfig
from isthmus.testing import local_groups, run_parallel
from support.sessions import Rounds
from support.zo import TINY

pytestmark = pytest.mark.usefixtures("one_thread")


# -- a stale member catches up over a real pair -------------------------------------------------
def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.0)


def _trained(corpus: Corpus, steps: int, cfg: ZOConfig) -> list[ZO]:
    """Two members that ran ``steps`` committed rounds together."""
    groups = local_groups(2)
    models = [GPT(TINY, seed=3) for _ in range(2)]

    def peer(g: Group) -> ZO:
        model = models[g.rank]
        st = ZO(Rounds(g), model, _sgd(model), cfg)  # type: ignore[arg-type]
        for step in range(steps):
            x, y = corpus.batch(
                step=step, rank=g.rank, world=2, batch_size=4, block_size=TINY.block_size
            )
            st.step(lambda x=x, y=y: model(x, y)[1])
        return st

    return run_parallel(groups, peer)


def _catch_up(src: ZO, cfg: ZOConfig, init_seed: int) -> tuple[ZO, int, int]:
    """A fresh member (model seed ``init_seed``, revision 0) repaired from ``src`` by the plan
    a coordinator would make; returns it, the bytes it received and the bytes of the tensors
    that differed."""
    groups = local_groups(2)
    model = GPT(TINY, seed=init_seed)
    dst = ZO(Rounds(groups[1]), model, _sgd(model), cfg)  # type: ignore[arg-type]
    assert src.session is not None and dst.session is not None
    want, have = src.session.state.hashes(), dst.session.state.hashes()
    wrong = tuple(n for n in want if have[n] != want[n])
    plan = RoundPlan(
        round=src.session.revision,
        epoch=1,
        members=(0, 1),
        transfers=(Transfer(0, 1, wrong),),
        expected={n: want[n] for n in wrong},
        new_epoch=True,
    )
    states = [src.session.state, dst.session.state]
    got = run_parallel(groups, lambda g: apply_transfers(g, plan, states[g.rank], g.rank))
    wrong_bytes = sum(
        src.session.state[n].numel() * src.session.state[n].element_size() for n in wrong
    )
    return dst, got[1], wrong_bytes


@pytest.mark.parametrize(
    ("catch_up", "init_seed", "replayed"),
    [("replay", 3, True), ("transfer", 3, False), ("auto", 3, True), ("replay", 4, False)],
    ids=["replay", "transfer", "auto-replays-a-short-log", "replay-from-another-state-falls-back"],
)
def test_a_stale_member_catches_up_bitwise_by_replay_or_transfer(
    corpus, catch_up, init_seed, replayed
):
    # auto on a thin link (10 kbit/s: the 5 MB state takes over an hour) replays a short log
    cfg = ZOConfig(lr=1e-3, seed=2, catch_up=catch_up, link_mbps=0.01)
    steps = 4
    src, _ = _trained(corpus, steps, cfg)
    assert src.session is not None and len(src.log) == steps
    dst, received, wrong_bytes = _catch_up(src, cfg, init_seed)
    assert dst.session is not None
    assert dst.session.state.digest() == src.session.state.digest()
    assert dst.replays == int(replayed) and dst.replayed_rounds == (steps if replayed else 0)
    log_bytes = 8 + steps * (12 + 2)  # its length; per round: round, world, two one-byte codes
    if replayed:
        # the log alone: every tensor that differs is one the replay reproduces
        assert received == log_bytes
        assert [e.round for e in dst.log] == list(range(steps))  # it can serve replays now
    elif catch_up == "replay":
        # a replay from another initial state does not match: the tensors follow
        assert received == log_bytes + wrong_bytes
    else:
        assert received == wrong_bytes


def test_auto_transfers_when_the_link_is_fast_enough(corpus):
    # at 1e6 Mbit/s the state moves faster than any z regenerates
    cfg = ZOConfig(lr=1e-3, seed=2, link_mbps=1e6)
    src, _ = _trained(corpus, 2, cfg)
    dst, received, wrong_bytes = _catch_up(src, cfg, 3)
    assert dst.session is not None and src.session is not None
    assert dst.session.state.digest() == src.session.state.digest()
    assert dst.replays == 0 and received == wrong_bytes


def test_a_catch_up_between_two_protocol_versions_is_refused_naming_both(corpus, monkeypatch):
    from isthmus.comm import transfer
    from isthmus.comm.transfer import TransferError
    from isthmus.coordinator.wire import PROTOCOL_VERSION

    cfg = ZOConfig(lr=1e-3, seed=2, catch_up="replay", link_mbps=0.01)
    src, _ = _trained(corpus, 2, cfg)
    # both heads now announce the next version, which neither side's check accepts
    monkeypatch.setattr(transfer, "PROTOCOL_VERSION", PROTOCOL_VERSION + 1)
    with pytest.raises(TransferError) as e:
        _catch_up(src, cfg, 3)
    assert (
        f"speaks isthmus protocol {PROTOCOL_VERSION + 1}, this peer speaks {PROTOCOL_VERSION}; "
        "upgrade one of them"
    ) in str(e.value)
