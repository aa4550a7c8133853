"""Host staging and the outer state on the host with a CUDA model: copies into pinned buffers
on a side stream see the writes queued before them and not those queued after; a pinned upload
casts like a plain copy; every strategy of the DiLoCo family computes with its outer state on
the host what it computes with it on the GPU, and frees the GPU memory of theta and the
momentum.

Skipped, with the reason, where there is no CUDA device (the CPU half of the same logic is
tests/unit/test_host_copy.py, which make test runs)."""

from __future__ import annotations

import pytest
import torch
from test_host_copy import FAMILY, _Normed  # the CPU test's model and strategy table

from isthmus.comm.host_copy import HostStage, upload

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine (CPU-only CI)"
)


def test_a_staged_copy_is_pinned_and_holds_the_values_queued_before_it():
    base = torch.randn(1 << 20)
    x = base.cuda()
    x.mul_(2)  # queued before the stage: the copy must see it
    stage = HostStage()
    staged = stage.stage([x])
    x.add_(100)  # queued after: the compute stream waits for the copy, which must not see it
    got = staged.get(0)
    assert got.is_pinned() and got.device.type == "cpu"
    assert torch.equal(got, base * 2)
    torch.cuda.synchronize()
    assert torch.equal(x.cpu(), base * 2 + 100)
    again = stage.stage([x])
    assert stage.allocations == 1 and again.get(0).data_ptr() == got.data_ptr()
    assert torch.equal(again.get(0), base * 2 + 100)


def test_without_the_fence_kernels_that_read_the_sources_run_beside_the_copy():
    x = torch.randn(2048, 2048, device="cuda")
    want = x.cpu()
    staged = HostStage().stage([x], fence=False)
    y = x @ x  # only reads x: needs no wait for the copy
    assert torch.equal(staged.get(0), want)
    assert torch.allclose(y.cpu(), want @ want, rtol=1e-3, atol=1e-2)


def test_an_upload_from_pinned_memory_casts_like_a_plain_copy():
    src = torch.randn(4096).pin_memory()
    for dtype in (torch.float32, torch.bfloat16):
        dst = torch.empty(4096, dtype=dtype, device="cuda")
        ev = upload(dst, src)
        assert ev is not None
        ev.synchronize()
        assert torch.equal(dst.cpu(), src.to(dtype))


def _train(cls, config, steps: int = 11):
    torch.cuda.synchronize()
    model = _Normed(64, 256).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = torch.cuda.memory_allocated()
    strategy = cls(None, model, opt, config)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 64, generator=gen).cuda()
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        loss.backward()
        strategy.step()
        opt.zero_grad(set_to_none=False)
    strategy.finish()
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before
    state = [t.detach().cpu() for t in model.state_dict().values()]
    outer = [g.detach().cpu() for g in strategy.global_params]
    return strategy, state, outer, grown


@pytest.mark.parametrize("cls,make", [(c, m) for _, c, m in FAMILY], ids=[n for n, _, _ in FAMILY])
def test_host_outer_state_computes_what_device_outer_state_does_and_frees_the_gpu(cls, make):
    host, state_h, outer_h, grown_h = _train(cls, make("cpu"))
    same, state_s, outer_s, grown_s = _train(cls, make("same"))
    assert all(g.device.type == "cpu" and g.is_pinned() for g in host.global_params)
    assert all(g.is_cuda for g in same.global_params)
    # theta (and, where the rule keeps one, the momentum) no longer on the GPU
    theta_bytes = sum(g.numel() * g.element_size() for g in host.global_params)
    assert grown_s - grown_h >= theta_bytes, (grown_s, grown_h, theta_bytes)
    # the same math; the last bit may differ where the GPU fuses a multiply-add
    for a, b in zip(state_h + outer_h, state_s + outer_s, strict=True):
        assert torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-5), (a - b).abs().max()
    assert host.outer_rounds == same.outer_rounds > 1
