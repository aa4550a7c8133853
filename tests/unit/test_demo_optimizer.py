"""DeMo's math and one-peer strategy, without a network: the DCT, the tiles, the message's bytes,
and one peer against a hand-written DeMo step."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from isthmus.data import Corpus
from isthmus.models import GPT, GPTConfig
from isthmus.strategies import DeMo, DeMoConfig, make_strategy
from isthmus.strategies.decoupled_momentum.math import DCTCodec, dct_basis, tile_size

TINY = GPTConfig.tiny()


def test_dct_basis_is_the_orthonormal_dct_ii():
    d = dct_basis(4)
    # D[k, j] = a_k cos(pi (2j + 1) k / 8), a_0 = 1/2, a_k = sqrt(1/2)
    assert d[0].tolist() == [0.5] * 4
    assert d[1, 0].item() == pytest.approx(math.sqrt(0.5) * math.cos(math.pi / 8), abs=1e-15)
    assert d[2, 1].item() == pytest.approx(
        math.sqrt(0.5) * math.cos(3 * math.pi * 2 / 8), abs=1e-15
    )
    assert torch.allclose(d @ d.T, torch.eye(4, dtype=torch.float64), atol=1e-14)


def test_tiles_follow_the_divisor_rule_and_invert():
    assert [tile_size(n, 64) for n in (256, 96, 32, 7, 128, 1)] == [64, 48, 32, 7, 64, 1]
    codec = DCTCodec([torch.Size([96, 32]), torch.Size([32]), torch.Size([4, 6, 5])], 64, 10)
    assert [(t.s1, t.s2, t.tiles) for t in codec.tilings] == [(48, 32, 2), (1, 32, 1), (4, 30, 1)]
    g = torch.Generator().manual_seed(0)
    for i, shape in enumerate([(96, 32), (32,), (4, 6, 5)]):
        x = torch.randn(shape, generator=g)
        back = codec.inverse(codec.transform(x, i).reshape(-1), i)
        assert torch.allclose(back, x.reshape(-1), atol=1e-6)
    # a tile's coefficients are D1 T D2^T
    x = torch.randn(96, 32, generator=g, dtype=torch.float64)
    coef = codec.transform(x, 0)
    want = dct_basis(48) @ x[48:, :] @ dct_basis(32).T
    assert torch.allclose(coef[1].view(48, 32), want.float(), atol=1e-5)


def test_message_is_exactly_the_documented_bytes():
    model = GPT(TINY, seed=3)
    st = DeMo(None, model, torch.optim.AdamW(model.parameters()))
    # by hand, per tensor: tiles * min(32, tile size) * (2 + 4) bytes
    kept = 0
    for p in st.params:
        rows, cols = (p.shape[0], p.numel() // p.shape[0]) if p.dim() >= 2 else (1, p.numel())
        s1, s2 = tile_size(rows, 64), tile_size(cols, 64)
        kept += (rows // s1) * (cols // s2) * min(32, s1 * s2)
    assert st.payload_bytes == 4 + 6 * kept  # header: the present flag (no buffers)
    assert st.payload_bytes == 7_876  # the tiny GPT: 1,312 coefficients of 34,688 values
    msg = st.codec.encode([torch.randn(p.numel()) for p in st.params], None)
    assert msg.dtype == torch.uint8 and msg.numel() == 7_876


def _hand_compress(m: torch.Tensor, shape: torch.Size, chunk: int, k: int) -> torch.Tensor:
    """What DeMo sends of one momentum, written out tile by tile with a DCT from its definition."""
    rows, cols = (shape[0], m.numel() // shape[0]) if len(shape) >= 2 else (1, m.numel())
    s1, s2 = tile_size(rows, chunk), tile_size(cols, chunk)

    def basis(n: int) -> torch.Tensor:
        k_ = torch.arange(n, dtype=torch.float64).view(-1, 1)
        j = torch.arange(n, dtype=torch.float64).view(1, -1)
        a = torch.where(k_ == 0, math.sqrt(1 / n), math.sqrt(2 / n))
        return a * torch.cos(math.pi * (2 * j + 1) * k_ / (2 * n))

    b1, b2 = basis(s1), basis(s2)
    x = m.to(torch.float64).view(rows, cols)
    out = torch.zeros(rows, cols, dtype=torch.float64)
    for r in range(0, rows, s1):
        for c in range(0, cols, s2):
            coef = b1 @ x[r : r + s1, c : c + s2] @ b2.T
            flat = coef.reshape(-1)
            keep = torch.topk(flat.abs(), min(k, flat.numel())).indices
            sparse = torch.zeros_like(flat)
            sparse[keep] = flat[keep]
            out[r : r + s1, c : c + s2] = b1.T @ sparse.view(s1, s2) @ b2
    return out.reshape(-1)


def test_one_peer_equals_a_hand_written_demo():
    torch.set_num_threads(1)
    corpus = Corpus.from_stdlib(max_bytes=50_000)
    model = GPT(TINY, seed=5)
    ref = copy.deepcopy(model)
    lr, wd, decay = 1e-3, 0.1, 0.9
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)
    st = DeMo(None, model, opt, DeMoConfig(decay=decay, top_k=8, chunk=16))
    momentum = [torch.zeros(p.numel(), dtype=torch.float64) for p in ref.parameters()]
    for step in range(3):
        x, y = corpus.batch(step=step, rank=0, world=1, batch_size=2, block_size=TINY.block_size)
        model(x, y)[1].backward()
        st.step()
        opt.zero_grad()
        ref(x, y)[1].backward()
        with torch.no_grad():
            for i, p in enumerate(ref.parameters()):
                momentum[i] = decay * momentum[i] + lr * p.grad.reshape(-1).double()
                q = _hand_compress(momentum[i], p.shape, 16, 8)
                momentum[i] -= q
                p.mul_(1 - lr * wd)
                p.sub_(lr * torch.sign(q).view(p.shape).float())
                p.grad = None
    for i, (p, r) in enumerate(zip(model.parameters(), ref.parameters(), strict=True)):
        # the sign makes the step exact; the momentum is compared to the float64 hand value
        assert torch.equal(p, r), f"{st.names[i]} differs"
        assert torch.allclose(st.momentum[i].double(), momentum[i], rtol=1e-5, atol=1e-9)
    assert st.step_count == 3


def test_options_and_refusals():
    model = GPT(TINY, seed=1)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="chunk"):
        DeMoConfig(chunk=200)
    with pytest.raises(ValueError, match="decay"):
        DeMoConfig(decay=1.5)
    with pytest.raises(ValueError, match="aggregator"):
        make_strategy("decoupled_momentum", None, model, opt, aggregator="median")
    partial = torch.optim.SGD(list(model.parameters())[:2], lr=0.1)
    with pytest.raises(ValueError, match="lr from the optimizer"):
        DeMo(None, model, partial)
    st = make_strategy("decoupled_momentum", None, model, opt, top_k="4", sign="false")
    assert isinstance(st, DeMo) and st.codec.k == 4 and not st.config.sign
