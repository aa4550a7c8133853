"""With one peer, strategies equal plain training (DDP) or the hand-written composition (DiLoCo),
bit for bit.

These run a real coordinator and a real session (world of one), so the whole round machinery
(begin, hashes, commit, the contribution count) is in the path and must not change a single bit.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import TOKEN, Cluster
from isthmus import DDP, DiLoCo, DiLoCoConfig, Session, SessionConfig
from isthmus.data import Corpus
from isthmus.models import GPT, GPTConfig
from isthmus.strategies.base import materialize_optimizer_state


def batch(corpus: Corpus, step: int):
    return corpus.batch(
        step=step, rank=0, world=1, batch_size=4, block_size=GPTConfig.tiny().block_size
    )


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))


def params_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


@pytest.fixture
def session(tmp_path):
    c = Cluster(tmp_path, start_peers=1)
    s = Session(SessionConfig(coordinator=c.coord.address, token=TOKEN, connect_timeout=5))
    yield s
    s.close()
    c.close()


def test_ddp_with_one_peer_equals_plain_training_bit_for_bit(session, corpus):
    plain = GPT(GPTConfig.tiny(), seed=1)
    wrapped = GPT(GPTConfig.tiny(), seed=1)
    opt_plain, opt_wrapped = adamw(plain), adamw(wrapped)
    ddp = DDP(session, wrapped, opt_wrapped)
    for step in range(8):
        for model, opt in ((plain, opt_plain), (wrapped, opt_wrapped)):
            x, y = batch(corpus, step)
            model(x, y)[1].backward()
            if model is plain:
                opt.step()
            else:
                ddp.step()
            opt.zero_grad()
    # the commit is pipelined (the default): the last round's verdict is settled by finish()
    assert session.revision == 7 and session.pending_revision == 8
    ddp.finish()
    assert params_equal(plain, wrapped)
    assert session.revision == 8 and ddp.step_count == 8 and session.pending_revision is None
    assert session.stats.bytes_sent == 0  # one peer communicates nothing


def test_ddp_without_session_is_plain_optimizer_step(corpus):
    a, b = GPT(GPTConfig.tiny(), seed=2), GPT(GPTConfig.tiny(), seed=2)
    oa, ob = adamw(a), adamw(b)
    ddp = DDP(None, b, ob)
    for step in range(3):
        for m in (a, b):
            m(*batch(corpus, step))[1].backward()
        oa.step()
        ddp.step()
        oa.zero_grad()
        ob.zero_grad()
    assert params_equal(a, b)


def _hand_diloco(
    corpus: Corpus, seed: int, h: int, outer_steps: int
) -> tuple[list[torch.Tensor], GPT]:
    """DiLoCo by hand: H AdamW steps, delta = theta - local, Nesterov SGD on theta."""
    local = GPT(GPTConfig.tiny(), seed=seed)
    opt = adamw(local)
    theta = [p.detach().clone() for p in local.parameters()]
    buf = [torch.zeros_like(t) for t in theta]
    lr, mom = 0.7, 0.9
    step = 0
    for _ in range(outer_steps):
        for _ in range(h):
            local(*batch(corpus, step))[1].backward()
            opt.step()
            opt.zero_grad()
            step += 1
        with torch.no_grad():
            for t, p, b in zip(theta, local.parameters(), buf, strict=True):
                # m <- mu m + delta; theta <- theta - lr (delta + mu m), written in the operation
                # order torch's SGD uses so that float rounding matches bit for bit
                delta = t - p
                b.mul_(mom).add_(delta)
                t.add_(delta.add(b, alpha=mom), alpha=-lr)
                p.copy_(t)
    return theta, local


def test_diloco_with_one_peer_equals_hand_computed_composition(session, corpus):
    h, outer_steps = 3, 2
    theta, local = _hand_diloco(corpus, seed=3, h=h, outer_steps=outer_steps)
    model = GPT(GPTConfig.tiny(), seed=3)
    opt = adamw(model)
    dl = DiLoCo(session, model, opt, DiLoCoConfig(sync_every=h))
    dl.run_steps = h * outer_steps  # the last round waits for its verdict: nothing to settle
    # the loop of isthmus.job: the first step() is the catch-up round and drops its gradient
    while dl.step_count < h * outer_steps:
        model(*batch(corpus, dl.step_count))[1].backward()
        dl.step()
        opt.zero_grad()
    assert dl.outer_rounds == outer_steps + 1  # + the catch-up round
    assert session.revision == outer_steps + 1 and session.pending_revision is None
    for got, want in zip(dl.global_params, theta, strict=True):
        assert torch.equal(got, want)
    assert params_equal(model, local)
    assert session.stats.bytes_sent == 0


def test_diloco_without_session_equals_hand_computed_composition(corpus):
    theta, _ = _hand_diloco(corpus, seed=4, h=2, outer_steps=3)
    model = GPT(GPTConfig.tiny(), seed=4)
    opt = adamw(model)
    dl = DiLoCo(None, model, opt, DiLoCoConfig(sync_every=2))
    while dl.step_count < 6:
        model(*batch(corpus, dl.step_count))[1].backward()
        dl.step()
        opt.zero_grad()
    for got, want in zip(dl.global_params, theta, strict=True):
        assert torch.equal(got, want)


def test_materializing_optimizer_state_changes_nothing(corpus):
    for make in (
        adamw,
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True),
    ):
        a, b = GPT(GPTConfig.tiny(), seed=5), GPT(GPTConfig.tiny(), seed=5)
        oa, ob = make(a), make(b)
        materialize_optimizer_state(ob)
        assert params_equal(a, b)
        assert all(ob.state[p] for p in b.parameters())
        before = copy.deepcopy(ob.state_dict())
        for step in range(4):
            for m, o in ((a, oa), (b, ob)):
                m(*batch(corpus, step))[1].backward()
                o.step()
                o.zero_grad()
        assert params_equal(a, b)
        assert before["state"]  # state existed before the first real step
