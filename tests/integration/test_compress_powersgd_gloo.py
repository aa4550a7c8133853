"""PowerSGD over real in-process Gloo groups: against torch's DDP hook, its compression rule and
byte prediction, exactness on low-rank input and zero gradients."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

from isthmus.reduce.compress.powersgd import (
    PowerSGD,
    PowerSGDConfig,
    should_compress,
)
from isthmus.testing import local_groups, run_parallel

# (40, 30) is large enough to be compressed at rank 4 (QR path); (16, 12) appears twice, apart,
# so torch's shape grouping reorders the tensors; vectors stay uncompressed.
SHAPES = [(16, 12), (16,), (40, 30), (8, 16), (16, 12), (6, 3, 2, 2), (4,)]


class _Bucket:
    """The four methods of dist.GradBucket that powerSGD_hook calls. GradBucket itself has no
    Python constructor; the hook only needs these, so the hook's code runs unchanged."""

    def __init__(self, buf: torch.Tensor, grads: list[torch.Tensor]) -> None:
        self._buf = buf
        self._grads = grads

    def buffer(self) -> torch.Tensor:
        return self._buf

    def gradients(self) -> list[torch.Tensor]:
        return self._grads

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


# the hook seeds torch's *global* RNG inside its synchronous part; one lock keeps the threads
# (one per rank) from interleaving there. Collectives are only issued asynchronously inside it.
_HOOK_LOCK = threading.Lock()


def _run_against_torch(world: int, rank: int, warm: bool, steps: int = 4):
    groups = local_groups(world)

    def body(g):
        st = torch_psgd.PowerSGDState(
            g.pg,
            matrix_approximation_rank=rank,
            start_powerSGD_iter=2,
            warm_start=warm,
            random_seed=7,
        )
        st.iter = 2  # past torch's vanilla-allreduce warm-up, which DDP needs and we do not
        mine = PowerSGD(PowerSGDConfig(rank=rank, warm_start=warm, seed=7, seed_scheme="torch"))
        gen = torch.Generator().manual_seed(1000 + g.rank)
        rows = []
        for _ in range(steps):
            grads = [torch.randn(s, generator=gen) for s in SHAPES]
            buf = torch.cat([x.reshape(-1) for x in grads])
            views, off = [], 0
            for s in SHAPES:
                n = math.prod(s)
                views.append(buf[off : off + n].view(s))
                off += n
            with _HOOK_LOCK:
                fut = torch_psgd.powerSGD_hook(st, _Bucket(buf, views))
            ref = fut.wait().clone()
            got = mine.reduce_sum_many(g, [(f"p{i}", x) for i, x in enumerate(grads)])
            mine.commit()
            ours = torch.cat([o.reshape(-1) for o in got]) / world
            # torch's error buffer, for the compressed tensors, against ours
            errs = []
            off = 0
            for i, s in enumerate(SHAPES):
                n = math.prod(s)
                e = mine.state_dict()["local"].get(f"p{i}", {}).get("error")
                if e is not None:
                    errs.append((st.error_dict[0][off : off + n].reshape(e.shape), e))
                off += n
            rows.append((ref, ours, errs))
        return rows

    return run_parallel(groups, body)


@pytest.mark.parametrize(("rank", "warm"), [(1, True), (2, True), (4, True), (2, False)])
def test_matches_torch_powersgd_hook(rank, warm):
    world = 3
    out = _run_against_torch(world, rank, warm)
    for r in range(world):
        for step, (ref, ours, errs) in enumerate(out[r]):
            assert torch.allclose(ours, ref, rtol=1e-4, atol=1e-5), (rank, warm, r, step)
            assert errs, "some tensors must have been compressed"
            for te, me in errs:
                assert torch.allclose(me, te, rtol=1e-4, atol=1e-5)
    # and the output is genuinely compressed: it is not the exact mean
    for step in range(len(out[0])):
        assert torch.equal(out[0][step][1], out[1][step][1])  # identical bits across peers


def test_compression_rule_and_byte_prediction():
    assert not should_compress(16, 1, 1, 2.0)  # vectors stay plain
    assert should_compress(16, 12, 1, 2.0)
    assert not should_compress(16, 12, 4, 2.0)  # (28 * 4) * 2 = 224 >= 192
    groups = local_groups(3)
    psgd = PowerSGD(PowerSGDConfig(rank=2))

    def body(g):
        xs = [torch.randn(s) for s in SHAPES]
        psgd_local = PowerSGD(PowerSGDConfig(rank=2))
        before = g.stats.bytes_sent
        psgd_local.reduce_sum_many(g, [(f"k{i}", x) for i, x in enumerate(xs)])
        return g.stats.bytes_sent - before

    sent = run_parallel(groups, body)
    assert sent == [psgd.predict_bytes_many(SHAPES, 3)] * 3
    dense = sum(math.prod(s) for s in SHAPES) * 4
    assert psgd.predict_bytes_many(SHAPES, 3) < dense  # it does compress


def test_exact_for_low_rank_input_and_zero_gradients():
    # a rank-1 matrix shared by all peers is reproduced exactly (up to fp32) at rank 1
    groups = local_groups(2)
    u = torch.linspace(-1, 1, 16).reshape(16, 1)
    v = torch.linspace(0.5, 2, 12).reshape(1, 12)

    def body(g):
        c = PowerSGD(PowerSGDConfig(rank=1))
        a = c.reduce_sum(g, "w", u @ v)
        c.commit()
        z = c.reduce_sum(g, "z", torch.zeros(16, 12))  # no NaN from 0/0
        return a, z

    for a, z in run_parallel(groups, body):
        assert torch.allclose(a, 2 * (u @ v), atol=1e-5)
        assert torch.equal(z, torch.zeros(16, 12))
