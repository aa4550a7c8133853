"""The tiny GPT's init is the same bits in another process."""

from __future__ import annotations

import subprocess
import sys

import torch
import xxhash

from isthmus.models import GPT, GPTConfig

# Run in a child process to check that init is identical across processes (and thread counts).
_CHILD = """
import torch, xxhash
torch.set_num_threads(1)
from isthmus.models import GPT, GPTConfig
m = GPT(GPTConfig.tiny(), seed=7)
h = xxhash.xxh64()
for name, p in m.state_dict().items():
    h.update(name.encode()); h.update(p.detach().numpy().tobytes())
print(h.hexdigest())
"""


def _digest(m: torch.nn.Module) -> str:
    h = xxhash.xxh64()
    for name, p in m.state_dict().items():
        h.update(name.encode())
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def test_init_is_identical_in_another_process() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == _digest(GPT(GPTConfig.tiny(), seed=7))
