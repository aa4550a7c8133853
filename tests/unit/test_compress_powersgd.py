"""PowerSGD in one process: the orthogonalization against QR and the configuration checks."""

from __future__ import annotations

import pytest
import torch

from isthmus.reduce.compress.powersgd import (
    PowerSGDConfig,
    orthogonalize_,
)


def test_orthogonalize_matches_qr_and_keeps_zero_columns():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(20, 2, generator=g)
    q = orthogonalize_(a.clone())
    assert torch.allclose(q.t() @ q, torch.eye(2), atol=1e-6)
    ref = torch.linalg.qr(a).Q
    assert torch.allclose(q.abs(), ref.abs(), atol=1e-5)
    z = torch.zeros(5, 2)
    assert torch.equal(orthogonalize_(z), torch.zeros(5, 2))  # torch's hook would give NaN


def test_config_validation():
    with pytest.raises(ValueError, match="rank"):
        PowerSGDConfig(rank=0)
    with pytest.raises(ValueError, match="seed_scheme"):
        PowerSGDConfig(seed_scheme="numpy")
    with pytest.raises(ValueError, match="min_compression_rate"):
        PowerSGDConfig(min_compression_rate=0)
