"""Host staging and the DiLoCo family's outer state on the host, on the CPU: the staging logic
the CUDA path shares (kept buffers, reuse, slots, what a staged copy holds), the CUDA path's
order of calls with recording stand-ins for streams and events, the option's validation, the backend ``auto`` picks for a host outer state, and ``outer_state_device="cpu"``
against ``"same"`` bit for bit for every strategy of the family (one process, no session).

The CUDA half (pinned buffers, the side stream, the device memory saved) is
tests/unit/test_cuda_host.py, skipped where there is no GPU."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from isthmus.comm.host_copy import CudaOps, HostStage, upload
from isthmus.comm.session import Session
from isthmus.models import GPT, GPTConfig
from isthmus.strategies import outer_home
from isthmus.strategies.co2 import CO2, CO2Config
from isthmus.strategies.diloco import DiLoCo, DiLoCoConfig
from isthmus.strategies.eager import EagerConfig, EagerDiLoCo
from isthmus.strategies.localsgd import LocalSGD, LocalSGDConfig
from isthmus.strategies.model_state import SharedBuffers
from isthmus.strategies.outer_home import OuterHome
from isthmus.strategies.streaming import StreamingConfig, StreamingDiLoCo

TINY = GPTConfig.tiny()

pytestmark = pytest.mark.usefixtures("one_thread")


# -- HostStage ---------------------------------------------------------------------------------


def test_stage_copies_into_kept_buffers_reused_by_the_next_stage_of_the_slot():
    stage = HostStage()
    a, b = torch.arange(6.0).view(2, 3), torch.arange(4, dtype=torch.int64)
    first = stage.stage([a, b])
    got = first.tensors()
    assert torch.equal(got[0], a) and torch.equal(got[1], b)
    assert got[0].data_ptr() != a.data_ptr()  # a copy, not the tensor itself
    assert not got[0].is_pinned()  # nothing is pinned without CUDA
    assert first.ready() and stage.allocations == 2
    assert stage.staged_bytes == 6 * 4 + 4 * 8
    a.add_(1)  # the source moves on: the staged copy holds what it was
    assert torch.equal(got[0], torch.arange(6.0).view(2, 3))
    again = stage.stage([a, b])
    assert stage.allocations == 2  # same shapes and dtypes: the same buffers
    assert again.get(0).data_ptr() == got[0].data_ptr()
    assert torch.equal(again.get(0), a)
    assert torch.equal(again.get(0), again.get(0))  # get() twice is the same tensor


def test_a_buffer_is_replaced_when_its_shape_or_dtype_changes_and_slots_are_apart():
    stage = HostStage()
    stage.stage([torch.zeros(3)])
    stage.stage([torch.zeros(4)])  # new shape
    stage.stage([torch.zeros(4, dtype=torch.float64)])  # new dtype
    assert stage.allocations == 3
    x = stage.stage([torch.ones(4, dtype=torch.float64)], slot="other").get(0)
    y = stage.stage([torch.full((4,), 2.0, dtype=torch.float64)]).get(0)
    assert stage.allocations == 4  # a slot of its own: nothing of the default slot reused
    assert torch.equal(x, torch.ones(4, dtype=torch.float64))  # untouched by the other slot
    assert torch.equal(y, torch.full((4,), 2.0, dtype=torch.float64))


def test_upload_on_the_cpu_is_a_plain_copy_with_the_cast():
    dst = torch.zeros(5, dtype=torch.bfloat16)
    src = torch.linspace(-1, 1, 5)
    assert upload(dst, src) is None  # nothing in flight without CUDA
    assert torch.equal(dst, src.to(torch.bfloat16))


# -- the CUDA path's order of calls, with recording stand-ins -----------------------------------


class _Stream:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: _Stream) -> None:
        self.log.append(f"{self.name}.wait_stream({other.name})")

    def wait_event(self, ev: _Event) -> None:
        self.log.append(f"{self.name}.wait_event({ev.name})")


class _Event:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def record(self, stream: _Stream) -> None:
        self.log.append(f"{self.name}.record({stream.name})")

    def synchronize(self) -> None:
        self.log.append(f"{self.name}.synchronize")

    def query(self) -> bool:
        self.log.append(f"{self.name}.query")
        return False


class _RecordingCuda(CudaOps):
    """Every tensor "on CUDA", every call logged; the copies themselves are CPU copies."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.main = _Stream("main", self.log)
        self.events = 0

    def usable(self, t: torch.Tensor) -> bool:
        return True

    def pinned(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        self.log.append("pinned")
        return torch.empty(shape, dtype=dtype)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return True

    def current_stream(self, device: torch.device) -> _Stream:
        return self.main

    def new_stream(self, device: torch.device) -> _Stream:
        self.log.append("new_stream")
        return _Stream("side", self.log)

    @contextmanager
    def on(self, stream: _Stream) -> Iterator[None]:
        self.log.append(f"on({stream.name})")
        yield
        self.log.append(f"off({stream.name})")

    def event(self) -> _Event:
        self.events += 1
        return _Event(f"e{self.events - 1}", self.log)

    def keep_for(self, t: torch.Tensor, stream: _Stream) -> None:
        self.log.append(f"keep_for({stream.name})")


def test_the_cuda_path_copies_on_a_side_stream_after_the_queued_work_and_fences_the_main_one():
    ops = _RecordingCuda()
    stage = HostStage(ops)
    a, b = torch.arange(4.0), torch.arange(3, dtype=torch.int32)
    staged = stage.stage([a, b])
    copy = ["side.wait_stream(main)", "on(side)"]  # after the queued work, on the side stream
    assert ops.log == [
        "pinned", "new_stream", *copy, "e0.record(side)", "off(side)", "keep_for(side)",
        "pinned", *copy, "e1.record(side)", "off(side)", "keep_for(side)",
        "main.wait_event(e1)",  # later kernels on the main stream wait for the copies (on the GPU)
    ]  # fmt: skip
    ops.log.clear()
    assert torch.equal(staged.get(1), b) and ops.log == ["e1.synchronize"]  # that copy alone
    staged.get(1)
    assert ops.log == ["e1.synchronize"]  # waited for once
    assert not staged.ready() and ops.log[-1] == "e0.query"  # polls, never blocks
    ops.log.clear()
    assert torch.equal(stage.stage([a, b]).get(0), a)
    assert "pinned" not in ops.log and "new_stream" not in ops.log  # kept buffers and stream
    assert stage.allocations == 2
    ops.log.clear()
    stage.stage([a], fence=False)  # the caller's later kernels only read: no GPU-side wait
    assert ops.log[-1] == "keep_for(side)" and not any("wait_event" in x for x in ops.log)


def test_an_upload_from_pinned_memory_is_non_blocking_and_gives_its_event():
    ops = _RecordingCuda()
    src = torch.linspace(-1, 1, 7)
    for dtype in (torch.float32, torch.bfloat16):
        dst = torch.zeros(7, dtype=dtype)
        ev = upload(dst, src, ops)
        assert isinstance(ev, _Event) and ops.log[-1] == f"{ev.name}.record(main)"
        assert torch.equal(dst, src.to(dtype))


# -- OuterHome ---------------------------------------------------------------------------------


def test_outer_home_on_the_cpu_stages_copies_and_same_reads_the_parameters():
    params = [torch.randn(3, 2), torch.randn(4)]
    host = OuterHome("cpu", params)
    same = OuterHome("same", params)
    assert host.host and not host.pin and host.buffers_device == torch.device("cpu")
    assert not same.host and same.buffers_device is None
    for home in (host, same):
        theta = home.copy(params[0])
        assert torch.equal(theta, params[0]) and theta.data_ptr() != params[0].data_ptr()
        assert home.copy(params[0].bfloat16(), torch.float32).dtype == torch.float32
    staged, direct = host.fetch(params), same.fetch(params)
    assert torch.equal(staged[1], params[1]) and staged[1].data_ptr() != params[1].data_ptr()
    assert direct[1].data_ptr() == params[1].data_ptr()
    dst = torch.zeros(4)
    host.load(dst, params[1])
    host.settle()  # nothing in flight on the CPU: returns at once
    assert torch.equal(dst, params[1])
    assert host.on_model(params[1], dst) is params[1]


@pytest.mark.parametrize(
    "make", [DiLoCoConfig, StreamingConfig, EagerConfig, LocalSGDConfig, CO2Config]
)
def test_a_bad_outer_state_device_is_refused_naming_the_choices(make):
    with pytest.raises(ValueError, match=r"outer_state_device must be 'auto' .* or 'same'"):
        make(outer_state_device="cuda")
    assert make().outer_state_device == "auto"


def test_host_state_of_a_cuda_model_is_refused_with_an_nccl_session(monkeypatch):
    # what a CUDA model looks like to the check, without a GPU: nothing is pinned or copied
    monkeypatch.setattr(outer_home, "cuda_usable", lambda t: True)
    session = SimpleNamespace(config=SimpleNamespace(backend="nccl"))
    strategy = SimpleNamespace(name="diloco", params=[torch.zeros(2)], session=session)
    with pytest.raises(ValueError, match=r"NCCL carries device tensors only.*'same'"):
        OuterHome.of(strategy, "cpu")
    assert OuterHome.of(strategy, "same").where == "same"
    assert OuterHome.of(strategy, "auto").where == "same"  # with NCCL: beside the model
    for backend in ("auto", "gloo"):
        session.config.backend = backend
        home = OuterHome.of(strategy, "auto")
        assert home.where == "cpu" and home.pin  # auto picks Gloo for it (below)
    assert OuterHome.of(SimpleNamespace(name="x", params=[], session=None), "auto").host


class _Fake:
    def __init__(self, cuda: bool, floating: bool = True) -> None:
        self.is_cuda = cuda
        self._floating = floating

    def is_floating_point(self) -> bool:
        return self._floating


@pytest.mark.parametrize(
    "tensors,backend",
    [
        ([], "gloo"),
        ([_Fake(False), _Fake(False, floating=False)], "gloo"),  # a CPU model
        ([_Fake(True), _Fake(True), _Fake(False, floating=False)], "nccl"),  # on CUDA, counter
        ([_Fake(False), _Fake(False), _Fake(True), _Fake(False, floating=False)], "gloo"),
    ],
    ids=["empty", "cpu", "cuda", "host-outer-state"],
)
def test_auto_backend_is_nccl_only_when_the_floating_state_is_all_on_cuda(tensors, backend):
    state = SimpleNamespace(items=lambda: iter((f"t{i}", t) for i, t in enumerate(tensors)))
    fake = SimpleNamespace(config=SimpleNamespace(backend="auto"), state=state)
    assert Session._backend(fake) == backend  # type: ignore[arg-type]
    fake.config.backend = "gloo"
    assert Session._backend(fake) == "gloo"  # type: ignore[arg-type]


# -- cpu against same, bit for bit -------------------------------------------------------------


class _Normed(torch.nn.Module):
    """A model with floating buffers (BatchNorm's running statistics) the round averages."""

    def __init__(self, width: int = 6, hidden: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        # numbered layers: Streaming cuts its fragments by them
        self.blocks = torch.nn.ModuleList(
            [
                torch.nn.Sequential(
                    torch.nn.Linear(width, hidden), torch.nn.BatchNorm1d(hidden), torch.nn.ReLU()
                ),
                torch.nn.Linear(hidden, 1),
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](self.blocks[0](x))


FAMILY = [
    ("diloco", DiLoCo, lambda d: DiLoCoConfig(sync_every=3, outer_state_device=d)),
    ("localsgd", LocalSGD, lambda d: LocalSGDConfig(sync_every=3, outer_state_device=d)),
    (
        "streaming",
        StreamingDiLoCo,
        lambda d: StreamingConfig(
            sync_every=4, fragments=2, overlap=1, alpha=0.5, outer_state_device=d
        ),
    ),
    ("eager", EagerDiLoCo, lambda d: EagerConfig(sync_every=3, outer_state_device=d)),
    ("co2", CO2, lambda d: CO2Config(sync_every=3, outer_state_device=d)),
]


def _train(cls, config, steps: int = 11):
    model = _Normed()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    strategy = cls(None, model, opt, config)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 6, generator=gen)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        loss.backward()
        strategy.step()
        opt.zero_grad()
    strategy.finish()
    state = [t.detach().clone() for t in model.state_dict().values()]
    outer = [g.detach().clone() for g in strategy.global_params]
    return strategy, state, outer


@pytest.mark.parametrize("cls,make", [(c, m) for _, c, m in FAMILY], ids=[n for n, _, _ in FAMILY])
def test_outer_state_on_the_host_gives_the_bits_of_outer_state_beside_the_model(cls, make):
    host, state_h, outer_h = _train(cls, make("cpu"))
    same, state_s, outer_s = _train(cls, make("same"))
    auto, state_a, outer_a = _train(cls, make("auto"))  # the default: the host, without NCCL
    assert auto.home.host and state_a + outer_a
    for a, b in zip(state_a + outer_a, state_h + outer_h, strict=True):
        assert torch.equal(a, b)
    assert host.home.stage is not None and host.home.stage.staged_bytes > 0  # the host path ran
    assert same.home.stage is None
    assert isinstance(host.buffers, SharedBuffers) and host.buffers.device == torch.device("cpu")
    for a, b in zip(state_h + outer_h, state_s + outer_s, strict=True):
        assert torch.equal(a, b)
    assert host.outer_rounds == same.outer_rounds > 1


def test_gpt_diloco_with_host_state_keeps_a_bf16_model_on_its_fp32_grid():
    # mixed precision: theta stays fp32 on the host, the model receives it cast
    out = []
    for where in ("cpu", "same"):
        model = GPT(TINY, seed=2).to(torch.bfloat16)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        s = DiLoCo(None, model, opt, DiLoCoConfig(sync_every=2, outer_state_device=where))
        for i in range(4):
            gen = torch.Generator().manual_seed(i)
            x = torch.randint(0, TINY.vocab_size, (2, TINY.block_size), generator=gen)
            model(x, x)[1].backward()
            s.step()
            opt.zero_grad()
        s.finish()
        assert all(g.dtype == torch.float32 for g in s.global_params)
        local = [p.detach().clone() for p in model.parameters()]
        out.append([g.clone() for g in s.global_params] + local)
    for a, b in zip(*out, strict=True):
        assert torch.equal(a, b)
