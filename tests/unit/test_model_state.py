"""The model's whole state in one process: what ModelState enumerates, the shared-state schema
every strategy registers (names, dtypes), the buffers' global copy, mixed precision, and the
local state a checkpoint holds. Multi-peer parity is tests/integration/test_model_state_runs.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from isthmus.strategies import STRATEGIES, DiLoCo, DiLoCoConfig, Strategy, make_strategy
from isthmus.strategies.model_state import ModelState, SharedBuffers, as_started, global_copy
from support.sessions import Registry

pytestmark = pytest.mark.usefixtures("one_thread")

OPTIONS: dict[str, dict[str, Any]] = {
    "ddp": {},
    "diloco": {"sync_every": 3},
    "localsgd": {"sync_every": 3},
    "streaming": {"sync_every": 4, "fragments": 2, "overlap": 1, "pattern": "balanced"},
    "eager": {"sync_every": 3},
    "co2": {"sync_every": 3},
    "gossip": {"total_steps": 10},
    "zo": {},
    # on Streaming's fragments with a round in flight: the form with the most state
    "sparseloco": {"sync_every": 4, "fragments": 2, "overlap": 1, "pattern": "balanced"},
    "decoupled_momentum": {},
}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.lin(x)))


class Net(nn.Module):
    """Tied embedding and head, a block used twice (its tensors under two names), a frozen
    parameter, persistent buffers (BatchNorm) and a non-persistent one (a rotary table)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.block = Block()
        self.again = self.block
        self.frozen = nn.Parameter(torch.linspace(-1, 1, 6), requires_grad=False)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("inv_freq", torch.arange(3.0), persistent=False)
        self.register_buffer("ema", torch.zeros(6))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.again(self.block(self.emb(tokens) + self.frozen))
        if self.training:
            with torch.no_grad():
                self.ema.mul_(0.9).add_(h.mean(0), alpha=0.1)
        return self.head(h + self.inv_freq.sum() * 0)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 10, (8,), generator=g), torch.randint(0, 10, (8,), generator=g)


def net(seed: int = 0, dtype: torch.dtype = torch.float32) -> Net:
    torch.manual_seed(seed)
    return Net().to(dtype)


def build(name: str, session: Any, model: nn.Module, **extra: Any) -> Strategy:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return make_strategy(name, session, model, opt, **{**OPTIONS[name], **extra})


def drive(st: Strategy, steps: int) -> None:
    while st.step_count < steps:
        x, y = batch(st.step_count)
        nn.functional.cross_entropy(st.model(x).float(), y).backward()
        st.step()
        st.optimizer.zero_grad()
    st.finish()


# -- what the model holds ---------------------------------------------------------------------


def test_model_state_enumerates_parameters_once_and_persistent_buffers_only():
    model = net()
    ms = ModelState.of(model)
    assert [n for n, _ in ms.trainable] == [
        "emb.weight",
        "block.lin.weight",
        "block.lin.bias",
        "block.bn.weight",
        "block.bn.bias",
    ]
    assert [n for n, _ in ms.frozen] == ["frozen"]
    assert [n for n, _ in ms.float_buffers] == [
        "ema",
        "block.bn.running_mean",
        "block.bn.running_var",
    ]
    assert [n for n, _ in ms.other_buffers] == ["block.bn.num_batches_tracked"]
    keys = ms.state_dict_keys()
    assert list(keys) == list(model.state_dict())  # every key, repeats included
    assert keys["head.weight"] == "emb.weight"
    assert keys["again.bn.running_mean"] == "block.bn.running_mean"
    assert "inv_freq" not in keys and all("inv_freq" not in n for n in keys.values())


@pytest.mark.parametrize("name", list(OPTIONS))
def test_every_strategy_shares_the_whole_state_dict_and_names_its_keys(name):
    model, reg = net(), Registry()
    st = build(name, reg, model)
    names = list(reg.state)
    assert all("inv_freq" not in n for n in names)  # non-persistent buffers stay local
    assert "model/frozen" in names and "model/block.bn.num_batches_tracked" in names
    assert reg.first_round_uses_work is (name in ("ddp", "zo", "decoupled_momentum"))  # type: ignore[attr-defined]
    keys = st.model_keys()
    if name == "gossip":
        # parameters and floating buffers are mixed, not shared: no shared copy holds them
        assert keys == {} and not any(n.startswith("global/") for n in names)
        return
    assert list(keys) == list(model.state_dict())
    assert set(keys.values()) <= set(names)
    assert keys["head.weight"] == keys["emb.weight"]
    params = "model" if name in ("ddp", "zo", "decoupled_momentum") else "global"
    assert keys["emb.weight"] == f"{params}/emb.weight"
    assert keys["block.bn.running_mean"] == "global/block.bn.running_mean"
    assert keys["frozen"] == "model/frozen"


def test_schema_order_and_names_of_ddp_and_diloco():
    reg = Registry()
    build("ddp", reg, net())
    assert [n for n in reg.state if not n.startswith("opt/")] == [
        "model/emb.weight",
        "model/block.lin.weight",
        "model/block.lin.bias",
        "model/block.bn.weight",
        "model/block.bn.bias",
        "global/ema",
        "global/block.bn.running_mean",
        "global/block.bn.running_var",
        "model/frozen",
        "model/block.bn.num_batches_tracked",
        "meta/step",
    ]
    reg = Registry()
    build("diloco", reg, net())
    assert [n for n in reg.state if not n.startswith("outer/")][:9] == [
        "global/emb.weight",
        "global/block.lin.weight",
        "global/block.lin.bias",
        "global/block.bn.weight",
        "global/block.bn.bias",
        "global/ema",
        "global/block.bn.running_mean",
        "global/block.bn.running_var",
        "model/frozen",
    ]


def test_the_registry_names_each_strategys_first_round():
    for entry in STRATEGIES.names():
        cls = type(build(entry, None, net()))
        # ddp, zo and decoupled_momentum train on the batch drawn before their first round
        assert cls.first_round_uses_work is (entry in ("ddp", "zo", "decoupled_momentum")), entry


# -- the buffers' global copy -------------------------------------------------------------------


def test_global_copy_of_fp32_is_the_same_bits_and_half_precision_gets_fp32():
    t = torch.randn(5)
    assert global_copy(t).dtype == torch.float32 and torch.equal(global_copy(t), t)
    assert global_copy(t) is not t
    h = t.to(torch.bfloat16)
    assert global_copy(h).dtype == torch.float32
    assert as_started(t, t) is t
    g = torch.tensor([1.001])
    assert as_started(g, h[:1]).item() == g.to(torch.bfloat16).item() != g.item()


def test_shared_buffers_land_restart_and_rebase_keep_exact_ends():
    b = torch.tensor([1.0, 2.0, 3.0])
    bufs = SharedBuffers([("b", b)])
    snap = bufs.snapshot()
    assert torch.equal(bufs.flat(snap), b)
    # the round gave this peer's own values back (one peer): the buffer is left as it is
    b.add_(0.1)
    after = b.clone()
    bufs.land(bufs.flat(snap))
    bufs.rebase(snap)
    assert torch.equal(b, after)
    # nothing ran since the snapshot: the buffer becomes the mean exactly
    snap = bufs.snapshot()
    bufs.land(torch.tensor([5.0, 6.0, 7.0]))
    bufs.rebase(snap)
    assert torch.equal(b, torch.tensor([5.0, 6.0, 7.0]))
    # statistics gathered since the snapshot stay on top of the mean
    snap = bufs.snapshot()
    b.add_(1.0)
    bufs.land(torch.tensor([0.0, 0.0, 0.0]))
    bufs.rebase(snap)
    assert torch.equal(b, torch.tensor([1.0, 1.0, 1.0]))
    b.fill_(9.0)
    bufs.restart()
    assert torch.equal(b, torch.zeros(3))
    bad = SharedBuffers([("b", torch.tensor([float("nan")]))])
    assert not bad.finite(bad.snapshot())


class Standardize(nn.Module):
    """BatchNorm first: its statistics depend on the data only, not on the parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.bn(x))


@pytest.mark.parametrize("name", ["diloco", "localsgd", "streaming", "eager", "co2", "sparseloco"])
def test_one_peer_buffers_are_plain_trainings_whatever_the_rounds(name):
    """A peer alone averages its buffers with nobody: every round, overlapped or not, must leave
    the statistics its forward passes gathered exactly as plain training has them."""
    torch.manual_seed(0)
    model, plain = Standardize(), Standardize()
    plain.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    options = {**OPTIONS[name], "pattern": "sequential"} if name == "streaming" else OPTIONS[name]
    options = {**options, "fragments": 1} if name == "streaming" else options
    st = make_strategy(name, None, model, opt, **options)
    for step in range(11):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step)) * (step + 1)
        plain(x)
        model(x).sum().backward()
        st.step()
        opt.zero_grad()
    st.finish()
    assert st.outer_rounds >= 3  # type: ignore[attr-defined]
    for key, value in plain.state_dict().items():
        if key.startswith("bn.running") or key.endswith("num_batches_tracked"):
            assert torch.equal(model.state_dict()[key], value), key


def test_a_catch_up_round_drops_its_forward_statistics():
    model = net()
    st = build("diloco", Registry(), model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model(batch(0)[0])
    assert not torch.equal(model.ema, before["ema"])
    st.drop_catch_up_forward()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_non_finite_buffers_contribute_nothing():
    model = net()
    st = build("diloco", None, model)
    drive(st, 2)
    theta = [g.clone() for g in st.global_params]  # type: ignore[attr-defined]
    model.ema.fill_(float("nan"))
    drive(st, 3)  # the round at step 3 is dropped: theta and the buffers' copy stay
    assert st.reducer.nonfinite_skips == 1
    for g, t in zip(st.global_params, theta, strict=True):  # type: ignore[attr-defined]
        assert torch.equal(g, t)
    assert torch.isfinite(model.ema).all()  # restarted from the global copy


# -- mixed precision ----------------------------------------------------------------------------


def test_bf16_model_gets_fp32_global_state_and_local_parameters_cast_from_it():
    reg = Registry()
    build("diloco", reg, net(dtype=torch.bfloat16))
    dtypes = {n: t.dtype for n, t in reg.state.items()}
    assert dtypes["global/emb.weight"] == dtypes["global/block.bn.running_mean"] == torch.float32
    assert dtypes["outer/0/momentum_buffer"] == torch.float32
    assert dtypes["model/frozen"] == torch.bfloat16
    model = net(dtype=torch.bfloat16)
    st = build("diloco", None, model)
    drive(st, 7)
    assert isinstance(st, DiLoCo) and st.outer_rounds == 3
    for p, g in zip(st.params, st.global_params, strict=True):
        assert g.dtype == torch.float32 and torch.equal(p, g.to(torch.bfloat16))
    for b, g in zip(st.buffers.local, st.buffers.globals, strict=True):
        assert torch.equal(b, g.to(b.dtype))


def test_bf16_rounding_never_moves_the_fp32_global_parameters():
    """Without inner progress the outer gradient is zero: theta keeps its fp32 bits, which the
    bf16 model cannot hold (measuring from theta itself would pull theta onto the bf16 grid)."""
    torch.manual_seed(0)
    model = nn.Linear(5, 5)
    theta = [p.detach().clone() for p in model.parameters()]
    model = model.to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    st = DiLoCo(None, model, opt, DiLoCoConfig(sync_every=2))
    with torch.no_grad():
        for g, t in zip(st.global_params, theta, strict=True):
            g.copy_(t)  # fp32 values between bf16 grid points
    for _ in range(6):
        model(torch.ones(2, 5, dtype=torch.bfloat16)).sum().backward()
        st.step()
        opt.zero_grad()
    assert st.outer_rounds == 3
    for g, t in zip(st.global_params, theta, strict=True):
        assert torch.equal(g, t)


# -- local state ----------------------------------------------------------------------------------


def layout(obj: Any, path: str = "") -> dict[str, Any]:
    """Every leaf of a nested state: its path, and its type (a tensor's shape and dtype)."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(layout(v, f"{path}.{k}"))
        return out
    if isinstance(obj, (list, tuple)):
        out = {}
        for i, v in enumerate(obj):
            out.update(layout(v, f"{path}.{i}"))
        return out
    if isinstance(obj, torch.Tensor):
        return {path: (tuple(obj.shape), obj.dtype)}
    if path.endswith(".compressor"):
        return {path: bytes}  # serialized: its length changes with the error feedback
    return {path: type(obj)}


# zo takes no compression and steps with a loss function (tests/unit/test_zo.py checks its state)
@pytest.mark.parametrize("name", [n for n in OPTIONS if n != "zo"])
def test_local_state_has_the_same_structure_before_the_first_step_as_after(name):
    # gossip compresses with quantizers only; sparseloco and demo compress their own messages
    comp = None if name in ("gossip", "sparseloco", "decoupled_momentum") else "topk:0.1+ef"
    fresh = build(name, None, net(), compression=comp)
    trained = build(name, None, net(), compression=comp)
    drive(trained, 5)
    state = trained.local_state()
    assert layout(fresh.local_state()) == layout(state)
    assert state["progress"]["local_steps"] == 5
    # DDP's optimizer state and parameters are shared; DeMo's momentum is its local state and
    # it never steps the optimizer
    if name not in ("ddp", "decoupled_momentum"):
        assert state["optimizer"]["state"] and "emb.weight" in state["model"]
        assert "block.bn.running_mean" in state["model"] and "frozen" not in state["model"]


def test_load_local_state_refuses_what_does_not_fit():
    st = build("diloco", None, net())
    good = st.local_state()
    with pytest.raises(ValueError, match="'progress'"):
        st.load_local_state({k: v for k, v in good.items() if k != "progress"})
    bad = {**good, "model": {**good["model"], "emb.weight": torch.zeros(3)}}
    with pytest.raises(ValueError, match=r"model/emb\.weight"):
        st.load_local_state(bad)
    other = build("diloco", None, net(), compression="topk:0.1+ef")
    with pytest.raises(ValueError, match="compressor"):
        build("diloco", None, net(), compression="topk:0.2+ef").load_local_state(
            other.local_state()
        )
