"""ZO on an FSDP2 model whose root module holds parameters: a forward pass after a step sees
the updated parameters. FSDP2 keeps the root's parameters gathered after a forward pass
without backward (ZO's passes), so the strategy must let them go once it has written the
shards. Runs in a child process (a one-rank Gloo default group for FSDP2)."""

from __future__ import annotations

import subprocess
import sys

CHILD = r"""
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from isthmus.strategies.zo import ZO, ZOConfig

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)  # the root holds the parameters
fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
zo = ZO(None, model, torch.optim.SGD(model.parameters(), lr=0.1),
        ZOConfig(lr=0.1, eps=0.5, perturbations=1))
x = torch.ones(3, 4)
for _ in range(2):
    zo.step(lambda: model(x).pow(2).mean())
with torch.no_grad():
    seen = model(x).clone()
    for m in model.modules():
        if hasattr(m, "reshard"):
            m.reshard()
    fresh = model(x).clone()
print("EQUAL" if torch.equal(seen, fresh) else f"STALE {seen.tolist()} {fresh.tolist()}")
dist.destroy_process_group()
"""


def test_forward_after_zo_step_sees_the_updated_shards() -> None:
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=240, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "EQUAL", out.stdout
