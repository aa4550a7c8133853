"""Zeroth-order training (``zo``) in one process: MeZO's step against a hand-written reference,
bit for bit; the perturbation generator; the quantizer and the bytes on the wire.

The hand-written references re-derive the seeds and ``z`` from the documented rules
(:mod:`isthmus.strategies.zo.math`'s docstring) with hashlib and ``torch.randn`` rather than calling
the module's generator.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from isthmus.comm.accounting import wire_bytes
from isthmus.comm.state import SharedState
from isthmus.models import GPT
from isthmus.strategies import STRATEGIES, make_strategy
from isthmus.strategies.zo import ZO, ZOConfig
from isthmus.strategies.zo.math import (
    ScalarCodec,
    apply_update,
    distinct,
    float32,
    perturb_,
    perturbation,
    perturbation_seed,
)
from support.zo import TINY, batch, bits_equal, doc_seed, doc_z, hand_estimate, quantized, sgd

pytestmark = pytest.mark.usefixtures("one_thread")


# -- the documented rules, written out again ------------------------------------------------------


def hand_update(
    params: list[torch.Tensor], g: float, *, seed: int, rnd: int, lr: float, wd: float = 0.0
) -> None:
    """MeZO's update ``theta -= lr * g * z``; with weight decay, first the documented decoupled
    decay of the matrices (MeZO folds it into one expression, which rounds differently)."""
    with torch.no_grad():
        if wd:
            for p in params:
                if p.dim() >= 2:
                    p.mul_(1 - lr * wd)
        for j, p in enumerate(params):
            z = doc_z(seed, rnd, 0, 0, j, p)
            p.sub_(lr * g * z)


# -- one peer: MeZO bit for bit ------------------------------------------------------------------
@pytest.mark.parametrize("bits,wd", [(32, 0.0), (8, 0.0), (8, 0.1)], ids=["f32", "8bit", "8bit-wd"])
def test_one_peer_zo_equals_a_hand_written_mezo_step_bit_for_bit(corpus, bits, wd):
    cfg = ZOConfig(lr=1e-3, eps=1e-3, bits=bits, weight_decay=wd, seed=7)
    model, ref = GPT(TINY, seed=3), GPT(TINY, seed=3)
    st = ZO(None, model, sgd(model), cfg)
    for step in range(3):
        x, y = batch(corpus, step)
        params = list(ref.parameters())  # the tied embedding once
        g = hand_estimate(
            params, lambda x=x, y=y: ref(x, y)[1], seed=7, rnd=step, rank=0, eps=cfg.eps
        )
        hand_update(params, quantized(g, bits), seed=7, rnd=step, lr=cfg.lr, wd=wd)
        st.step(lambda x=x, y=y: model(x, y)[1])
        assert bits_equal(model, ref), f"step {step}"
    assert st.step_count == 3 and st.applied == 3
    assert math.isfinite(st.last_loss)
    assert not bits_equal(model, GPT(TINY, seed=3))  # it did move


def test_step_without_a_loss_function_says_how_to_call_it():
    model = GPT(TINY, seed=0)
    st = ZO(None, model, sgd(model))
    with pytest.raises(TypeError, match=r"strategy.step\(lambda"):
        st.step()


def test_a_failing_loss_function_leaves_the_parameters_as_they_were():
    model = GPT(TINY, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    st = ZO(None, model, sgd(model))
    calls = []

    def loss() -> torch.Tensor:
        calls.append(1)
        if len(calls) == 2:  # inside the -eps pass
            raise RuntimeError("out of memory, say")
        return torch.tensor(1.0)

    with pytest.raises(RuntimeError, match="out of memory"):
        st.step(loss)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert st.step_count == 0


def test_a_non_finite_loss_is_absent_and_changes_nothing():
    model = GPT(TINY, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    st = ZO(None, model, sgd(model))
    st.step(lambda: torch.tensor(float("nan")))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert st.applied == 0 and st.absent_seen == 1 and st.step_count == 1


class WithBuffers(nn.Module):
    """BatchNorm (floating and integer buffers), a frozen parameter and a tied head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.bn = nn.BatchNorm1d(6)
        self.frozen = nn.Parameter(torch.linspace(-1, 1, 6), requires_grad=False)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight

    def loss(self, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randint(0, 10, (8,), generator=g), torch.randint(0, 10, (8,), generator=g)
        return nn.functional.cross_entropy(self.head(self.bn(self.emb(x)) + self.frozen), y)


class Registry:
    """What setup() uses of a Session: registration only (no rounds are run)."""

    def __init__(self) -> None:
        self.state = SharedState()

    def register(self, name: str, tensor: torch.Tensor) -> None:
        self.state.register(name, tensor)

    def add_commit_hook(self, fn: Callable[[Any], None]) -> None:
        pass  # no rounds are run


def test_zo_shares_parameters_and_buffers_and_leaves_buffers_untrained():
    torch.manual_seed(0)
    model, reg = WithBuffers(), Registry()
    ZO(reg, model, sgd(model))  # type: ignore[arg-type]
    assert list(reg.state) == [
        "model/emb.weight",
        "model/bn.weight",
        "model/bn.bias",
        "global/bn.running_mean",
        "global/bn.running_var",
        "model/frozen",
        "model/bn.num_batches_tracked",
        "meta/step",
    ]
    assert reg.first_round_uses_work is True  # type: ignore[attr-defined]
    st = ZO(None, model, sgd(model), ZOConfig(lr=1e-2))
    fresh = st.local_state()
    buffers = {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num" in k}
    weight = model.emb.weight.detach().clone()
    for step in range(3):
        st.step(lambda step=step: model.loss(step))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in buffers.items())
    assert not torch.equal(model.emb.weight, weight) and model.head.weight is model.emb.weight
    # checkpoints: the local state keeps its structure (nothing but counters and the RNG)
    trained = st.local_state()
    assert set(trained) == set(fresh) == {"rng", "compressor", "progress"}
    assert trained["progress"] == {"local_steps": 3}
    assert st.model_keys()["head.weight"] == "model/emb.weight"


def test_both_passes_of_a_perturbation_draw_the_same_dropout_masks():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    st = ZO(None, model, sgd(model), ZOConfig(perturbations=2))
    seen: list[torch.Tensor] = []

    def loss() -> torch.Tensor:
        seen.append(torch.get_rng_state())
        return model(torch.ones(3, 4)).sum()

    st.step(loss)
    assert len(seen) == 4
    assert torch.equal(seen[0], seen[1]) and torch.equal(seen[2], seen[3])
    assert not torch.equal(seen[0], seen[2])  # a new mask for the next perturbation


# -- the generator ------------------------------------------------------------------------------
def test_the_generator_gives_the_same_tensor_twice_and_the_documented_one():
    p = torch.empty(5, 7)
    a, b = perturbation(123, 2, p), perturbation(123, 2, p)
    assert torch.equal(a, b) and a.dtype == torch.float32
    gen = torch.Generator().manual_seed(doc_seed(123, 2))
    assert torch.equal(a, torch.randn(5, 7, generator=gen, dtype=torch.float64).float())
    assert not torch.equal(a, perturbation(123, 3, p))  # another parameter index
    assert not torch.equal(a, perturbation(124, 2, p))  # another seed
    assert perturbation(123, 2, torch.empty(3, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert perturbation_seed(1, 2, 3, 0) == doc_seed(1, 2, 3, 0)
    assert perturbation_seed(1, 2, 3, 0) != perturbation_seed(1, 2, 4, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_the_generator_gives_the_same_bits_on_cuda():
    cpu = perturbation(5, 0, torch.empty(1000))
    cuda = perturbation(5, 0, torch.empty(1000, device="cuda"))
    assert cuda.device.type == "cuda" and torch.equal(cpu, cuda.cpu())


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4, bias=False)
        self.b = nn.Linear(4, 4, bias=False)
        self.b.weight = self.a.weight
        self.c = nn.Linear(4, 1)


def test_tied_parameters_are_perturbed_and_updated_once():
    torch.manual_seed(0)
    m = Tied()
    listed = [p for _, p in m.named_parameters(remove_duplicate=False)]  # a.weight twice
    assert len(listed) == 4
    keep = distinct(listed)
    assert keep == [0, 2, 3]
    before = m.a.weight.detach().clone()
    with torch.no_grad():
        perturb_(listed, keep, seed=9, scale=0.5)
    z0 = perturbation(9, 0, before)
    assert torch.equal(m.a.weight, before.add(z0, alpha=0.5))  # once, not twice
    # the strategy enumerates the tied weight once and updates it once: as MeZO by hand on the
    # distinct parameters
    torch.manual_seed(0)
    m, ref = Tied(), Tied()
    st = ZO(None, m, sgd(m), ZOConfig(lr=0.1, bits=32, seed=2))
    assert len(st.keep) == 3

    def loss(mod: Tied) -> torch.Tensor:
        return mod.c(mod.b(mod.a(torch.ones(2, 4)))).pow(2).mean()

    params = list(ref.parameters())
    assert len(params) == 3
    ref.load_state_dict(m.state_dict())
    g = hand_estimate(params, lambda: loss(ref), seed=2, rnd=0, rank=0, eps=1e-3)
    hand_update(params, float32(g), seed=2, rnd=0, lr=0.1)
    st.step(lambda: loss(m))
    assert bits_equal(m, ref) and m.a.weight is m.b.weight
    assert not torch.equal(m.a.weight, before)  # it moved (before: the same initial weight)


def test_overlapping_views_are_refused():
    base = torch.zeros(10)
    with pytest.raises(ValueError, match="overlap"):
        distinct([base[:6], base[4:]])
    assert distinct([base[:5], base[5:]]) == [0, 1]  # disjoint views are fine


# -- quantization and bytes ---------------------------------------------------------------------
def test_quantize_round_trip_bounds():
    codec = ScalarCodec(8, 1e-3, 1e3)
    rho = (1e6) ** (1 / 126)
    half = math.sqrt(rho)
    for g in [10 ** (e / 7) for e in range(-21, 22)]:  # 1e-3 .. 1e3
        for s in (1.0, -1.0):
            q = codec.quantize(s * g)
            assert q is not None and math.copysign(1.0, q) == s
            assert abs(q / (s * g) - 1) <= half - 1 + 1e-6
    assert codec.quantize(0.0) == 0.0
    assert codec.quantize(1e-3 / half / 1.001) == 0.0  # flushed to zero below g_min
    assert codec.quantize(1e-3) == pytest.approx(1e-3, rel=1e-6)
    assert codec.quantize(5e9) == codec.quantize(1e3) == pytest.approx(1e3, rel=1e-6)  # clipped
    assert codec.quantize(-5e9) == pytest.approx(-1e3, rel=1e-6)
    for bad in (None, math.nan, math.inf, -math.inf):
        assert codec.encode(bad) == -128 and codec.quantize(bad) is None
    assert {codec.encode(x) for x in (-1e9, 1e9)} == {-127, 127}
    f32 = ScalarCodec(32)
    assert f32.quantize(0.1) == float32(0.1) and f32.quantize(math.inf) is None
    assert f32.quantize(1e39) is None and f32.quantize(None) is None  # beyond float32: absent
    assert codec.quantize(5e-324) == 0.0 and ScalarCodec(8, 2.0, 4.0).quantize(5e-324) == 0.0
    for bits in (1, 2, 17, 24):
        with pytest.raises(ValueError, match="bits"):
            ScalarCodec(bits)
    with pytest.raises(ValueError, match="g_min"):
        ScalarCodec(8, 1.0, 0.5)


@pytest.mark.parametrize("bits", [3, 4, 5, 8, 12, 16, 32])
def test_codes_pack_into_ceil_bits_times_count_over_8_bytes(bits):
    codec = ScalarCodec(bits)
    gen = torch.Generator().manual_seed(bits)
    for count in (1, 2, 3, 5, 8):
        if bits == 32:
            codes = [codec.encode(float(v)) for v in torch.randn(count, generator=gen)]
        else:
            lo, hi = codec.absent, codec.levels
            codes = torch.randint(lo, hi + 1, (count,), generator=gen).tolist()
        payload = codec.pack(codes)
        assert payload.dtype == torch.uint8
        assert payload.numel() == math.ceil(bits * count / 8) == codec.payload_bytes(count)
        assert codec.unpack(payload, count) == codes
    with pytest.raises(ValueError, match="bytes"):
        codec.unpack(torch.zeros(codec.payload_bytes(3) + 1, dtype=torch.uint8), 3)


def test_bytes_per_step_per_peer():
    # one byte of payload per projected gradient at 8 bits; isthmus counts a ring all-gather as
    # (world - 1) times the payload per rank (no header of its own)
    model = GPT(TINY, seed=0)
    for bits, per, payload in [(8, 1, 1), (8, 4, 4), (4, 3, 2), (16, 1, 2), (32, 2, 8)]:
        st = ZO(None, model, sgd(model), ZOConfig(bits=bits, perturbations=per))
        assert st.payload_bytes == payload == math.ceil(bits * per / 8)
        assert st.metrics()["zo_payload_bytes"] == payload
        for world in (1, 2, 4):
            assert wire_bytes("all_gather", payload, world) == (world - 1) * payload


def test_the_pure_update_is_the_same_in_any_member_and_equals_mezo_averaged():
    # three members' scalars applied by three "peers" holding the same parameters
    torch.manual_seed(1)
    theta = [torch.randn(6, 3), torch.randn(3)]
    seeds = [perturbation_seed(0, 4, r) for r in range(3)]
    gs = [0.5, None, -2.0]
    peers = [[t.clone() for t in theta] for _ in range(3)]
    for p in peers:
        assert apply_update(p, [0, 1], seeds, gs, lr=0.01, weight_decay=0.1) == 2
    for p in peers[1:]:
        assert all(torch.equal(a, b) for a, b in zip(p, peers[0], strict=True))
    want = [t.clone() for t in theta]
    want[0].mul_(float32(1 - 0.01 * 0.1))
    for s, g in ((seeds[0], 0.5), (seeds[2], -2.0)):
        for j, t in enumerate(want):
            t.sub_(float32(0.01 * g / 2) * perturbation(s, j, t))
    assert all(torch.equal(a, b) for a, b in zip(peers[0], want, strict=True))
    # in exact arithmetic: theta (1 - lr wd) - lr/N sum g z
    z0, z2 = perturbation(seeds[0], 0, theta[0]), perturbation(seeds[2], 0, theta[0])
    exact = theta[0] * (1 - 1e-3) - 0.005 * (0.5 * z0 - 2.0 * z2)
    torch.testing.assert_close(peers[0][0], exact)
    assert apply_update(theta, [0, 1], seeds, [None] * 3, lr=0.01) == 0  # nobody: unchanged


# -- config and registry ------------------------------------------------------------------------
BAD = [
    (lambda: ZOConfig(eps=0.0), "eps"),
    (lambda: ZOConfig(lr=-1.0), "lr"),
    (lambda: ZOConfig(perturbations=0), "perturbations"),
    (lambda: ZOConfig(bits=2), "bits"),
    (lambda: ZOConfig(g_min=2.0, g_max=1.0), "g_min"),
    (lambda: ZOConfig(weight_decay=-1.0), "weight_decay"),
    (lambda: ZOConfig(seed=-1), "seed"),
]


@pytest.mark.parametrize("make,what", BAD, ids=[w for _, w in BAD])
def test_bad_configs_are_rejected_with_the_field_named(make, what):
    with pytest.raises(ValueError, match=what):
        make()


def test_zo_is_registered_and_built_by_name_with_options():
    import isthmus

    assert "zo" in STRATEGIES.names()
    assert isthmus.ZO is ZO and isthmus.ZOConfig is ZOConfig
    model = GPT(TINY, seed=0)
    st = make_strategy("zo", None, model, sgd(model), bits="4", lr="1e-4", perturbations="2")
    assert isinstance(st, ZO) and st.config.bits == 4 and st.config.lr == 1e-4
    with pytest.raises(ValueError, match="unknown option"):
        make_strategy("zo", None, model, sgd(model), bogus=1)
    with pytest.raises(ValueError, match="compression"):
        make_strategy("zo", None, model, sgd(model), compression="int8")
