"""A forward pass after a strategy wrote an FSDP2 model's shards sees them. FSDP2 keeps the root
module's parameters gathered after a forward pass without backward (ZO's passes, a user's
evaluation), so a strategy must let them go once it has written the shards: ZO after each step,
DiLoCo after its final round in ``finish()``. Each case runs in a child process (a one-rank Gloo
default group for FSDP2) on a model whose root holds the parameters."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHILD = r"""
import sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from isthmus.strategies.diloco import DiLoCo, DiLoCoConfig
from isthmus.strategies.zo import ZO, ZOConfig

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)  # the root holds the parameters
fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.ones(3, 4)
if sys.argv[1] == "zo":
    s = ZO(None, model, opt, ZOConfig(lr=0.1, eps=0.5, perturbations=1))
    for _ in range(2):
        s.step(lambda: model(x).pow(2).mean())
else:
    s = DiLoCo(None, model, opt, DiLoCoConfig(sync_every=2, outer_lr=0.7))
    for _ in range(3):
        model(x).pow(2).mean().backward()
        s.step()
        opt.zero_grad()
    with torch.no_grad():
        model(x)  # an evaluation: the root stays gathered
    s.finish()  # the last step's round writes the shards
with torch.no_grad():
    seen = model(x).clone()
    for m in model.modules():
        if hasattr(m, "reshard"):
            m.reshard()
    fresh = model(x).clone()
print("EQUAL" if torch.equal(seen, fresh) else f"STALE {seen.tolist()} {fresh.tolist()}")
dist.destroy_process_group()
"""


@pytest.mark.parametrize("strategy", ["zo", "diloco"])
def test_forward_after_the_strategy_wrote_the_shards_sees_them(strategy: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, strategy],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "EQUAL", out.stdout
