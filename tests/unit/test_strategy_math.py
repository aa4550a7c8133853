"""Low-communication strategies in one process (no session): their math against hand-written
references, bit for bit, and Streaming DiLoCo's fragments and schedule.

The hand-written references spell out each paper's update with torch's own operation order (SGD's
single-tensor Nesterov step: ``buf = mu buf + g; p -= lr (g + mu buf)``) so that float rounding
matches exactly; they do not call the strategies' code.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from isthmus.data import Corpus
from isthmus.models import GPT, GPTConfig
from isthmus.strategies.base import Strategy
from isthmus.strategies.co2 import CO2, CO2Config
from isthmus.strategies.diloco import DiLoCo, DiLoCoConfig
from isthmus.strategies.eager import EagerConfig, EagerDiLoCo, preview_sgd
from isthmus.strategies.localsgd import LocalSGD, LocalSGDConfig
from isthmus.strategies.streaming import (
    StreamingConfig,
    StreamingDiLoCo,
    assign_fragments,
    fragment_for_round,
    layer_of,
    sync_schedule,
)

TINY = GPTConfig.tiny()

pytestmark = pytest.mark.usefixtures("one_thread")


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))


def inner_step(model: GPT, opt: torch.optim.Optimizer, corpus: Corpus, step: int) -> None:
    x, y = corpus.batch(step=step, rank=0, world=1, batch_size=4, block_size=TINY.block_size)
    model(x, y)[1].backward()
    opt.step()
    opt.zero_grad()


def drive(strategy: Strategy, opt: torch.optim.Optimizer, corpus: Corpus, steps: int) -> None:
    """The loop of isthmus.job: batches indexed by the strategy's step counter."""
    model = strategy.model
    assert isinstance(model, GPT)
    while strategy.step_count < steps:
        x, y = corpus.batch(
            step=strategy.step_count, rank=0, world=1, batch_size=4, block_size=TINY.block_size
        )
        model(x, y)[1].backward()
        strategy.step()
        opt.zero_grad()
    strategy.finish()


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach() for p in model.parameters()]


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x, y), f"tensor {i} differs (max abs diff {(x - y).abs().max()})"


def nesterov(theta: torch.Tensor, buf: torch.Tensor, d: torch.Tensor, lr: float, mu: float) -> None:
    buf.mul_(mu).add_(d)
    theta.add_(d.add(buf, alpha=mu), alpha=-lr)


# -- fragments and schedule --------------------------------------------------------------------


def test_layer_of_reads_the_first_numbered_component():
    assert layer_of("blocks.3.attn.qkv.weight") == 3
    assert layer_of("layers.12.w") == 12
    assert layer_of("0.weight") == 0
    assert layer_of("tok_emb.weight") is None
    assert layer_of("ln_f.bias") is None
    assert layer_of("conv2d.weight") is None  # a digit inside a name is not a layer


@pytest.mark.parametrize("cfg", [GPTConfig.tiny(), GPTConfig.default()], ids=["tiny", "default"])
@pytest.mark.parametrize("pattern", ["strided", "sequential"])
def test_fragments_partition_every_parameter_exactly_once(cfg, pattern):
    names = [n for n, _ in GPT(cfg, seed=0).named_parameters()]
    for p in range(1, cfg.n_layer + 1):
        frags = assign_fragments(names, p, pattern=pattern, nonlayer_fragment=p - 1)
        flat = sorted(i for f in frags for i in f)
        assert flat == list(range(len(names)))
        assert all(frags)
        for f, idx in enumerate(frags):
            for i in idx:
                layer = layer_of(names[i])
                if layer is None:
                    assert f == p - 1  # placed explicitly
                elif pattern == "strided":
                    assert f == layer % p
                else:
                    assert f == layer * p // cfg.n_layer
    # sequential fragments are contiguous blocks of layers
    frags = assign_fragments(names, 2, pattern="sequential")
    layers = [{layer_of(names[i]) for i in f} - {None} for f in frags]
    assert max(layers[0]) < min(layers[1])


@pytest.mark.parametrize("cfg", [GPTConfig.tiny(), GPTConfig.default()], ids=["tiny", "default"])
def test_balanced_fragments_pack_whole_tensors_to_about_one_pth(cfg):
    model = GPT(cfg, seed=0)
    names = [n for n, _ in model.named_parameters()]
    sizes = [p.numel() for p in model.parameters()]
    total = sum(sizes)
    for p in (2, 3, 4):
        frags = assign_fragments(names, p, pattern="balanced", sizes=sizes)
        assert sorted(i for f in frags for i in f) == list(range(len(names)))
        loads = [sum(sizes[i] for i in f) for f in frags]
        # greedy largest-first packing: no fragment exceeds 1/P by more than one tensor
        assert max(loads) <= total / p + max(sizes)
        assert frags == assign_fragments(names, p, pattern="balanced", sizes=sizes)
    frags = assign_fragments(names, 2, pattern="balanced", sizes=sizes)
    assert max(sum(sizes[i] for i in f) for f in frags) / total < 0.51
    with pytest.raises(ValueError, match="element count"):
        assign_fragments(names, 2, pattern="balanced")


def test_fragment_errors_say_what_to_do():
    names = [n for n, _ in GPT(TINY, seed=0).named_parameters()]
    with pytest.raises(ValueError, match="fragments <= 2"):
        assign_fragments(names, 3)
    with pytest.raises(ValueError, match="unknown fragment pattern"):
        assign_fragments(names, 2, pattern="random")
    with pytest.raises(ValueError, match="nonlayer_fragment"):
        assign_fragments(names, 2, nonlayer_fragment=2)
    with pytest.raises(ValueError, match="returned 5"):
        assign_fragments(names, 2, fragment_of=lambda n: 5)
    with pytest.raises(ValueError, match="fragment 1 of 2 would hold no parameters"):
        assign_fragments(names, 2, fragment_of=lambda n: 0)
    custom = assign_fragments(names, 2, fragment_of=lambda n: int("mlp" in n))
    assert all(("mlp" in names[i]) == (f == 1) for f, idx in enumerate(custom) for i in idx)


def test_schedule_is_a_function_of_the_round_and_covers_each_fragment_once_per_h():
    h, p, tau = 12, 3, 2
    sched = sync_schedule(h, p, tau, 36)
    assert sched == [(a - tau, a) for a in (4, 8, 12, 16, 20, 24, 28, 32, 36)]
    # any P consecutive committed rounds (one H of steps) sync every fragment exactly once
    for start in range(0, 20):
        assert sorted(fragment_for_round(r, p) for r in range(start, start + p)) == [0, 1, 2]


def test_streaming_syncs_every_parameter_exactly_once_per_h_steps(corpus):
    h, p, tau = 4, 2, 1
    model = GPT(TINY, seed=7)
    opt = adamw(model)
    st = StreamingDiLoCo(None, model, opt, StreamingConfig(sync_every=h, fragments=p, overlap=tau))
    drive(st, opt, corpus, 3 * h)
    regular = st.sync_log[: 3 * p]
    # applied every H/P steps, fragments in round order
    assert [s for s, _ in regular] == [2, 4, 6, 8, 10, 12]
    assert [f for _, f in regular] == [0, 1, 0, 1, 0, 1]
    n = len(st.names)
    for k in range(3):
        window = [f for s, f in regular if k * h < s <= (k + 1) * h]
        covered = sorted(i for f in window for i in st.fragments[f])
        assert covered == list(range(n)), f"steps {k * h}..{(k + 1) * h}"
    # the end: the fragment applied at the last step is clean, the other one is synced once more
    assert st.sync_log[3 * p :] == [(12, 0)]
    assert_same(params(model), st.global_params)


def test_streaming_peak_sync_is_a_fraction_of_the_model():
    model = GPT(GPTConfig.default(), seed=0)
    st = StreamingDiLoCo(None, model, adamw(model), StreamingConfig(sync_every=8, fragments=4))
    sizes = st.fragment_sizes()
    assert sum(sizes) == model.num_parameters()
    # layers are equal; the embeddings and the final norm ride with fragment 0
    assert sizes[1] == sizes[2] == sizes[3] < sizes[0]
    assert max(sizes) / model.num_parameters() < 0.3


# -- Streaming DiLoCo --------------------------------------------------------------------------


def test_streaming_with_one_fragment_and_no_overlap_is_diloco_bit_for_bit(corpus):
    h, steps = 3, 8  # the last phase is partial: finish() syncs it
    a, b = GPT(TINY, seed=3), GPT(TINY, seed=3)
    oa, ob = adamw(a), adamw(b)
    dl = DiLoCo(None, a, oa, DiLoCoConfig(sync_every=h))
    st = StreamingDiLoCo(
        None, b, ob, StreamingConfig(sync_every=h, fragments=1, overlap=0, alpha=0.0)
    )
    drive(dl, oa, corpus, steps)
    drive(st, ob, corpus, steps)
    assert dl.step_count == st.step_count == steps
    assert_same(dl.global_params, st.global_params)
    assert_same(params(a), params(b))
    bufs = [[o.outer.state[g]["momentum_buffer"] for g in o.global_params] for o in (dl, st)]
    assert_same(*bufs)
    assert [f for _, f in st.sync_log] == [0, 0, 0]


def _hand_streaming(
    corpus: Corpus, seed: int, h: int, p: int, tau: int, alpha: float, steps: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Streaming DiLoCo by hand (one peer): fragments by layer parity, fragment = round % P."""
    lr, mu = 0.7, 0.9
    model = GPT(TINY, seed=seed)
    opt = adamw(model)
    x = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]

    def frag_of(name: str) -> int:
        layer = layer_of(name)
        return 0 if layer is None else layer % p

    frags = [[i for i, n in enumerate(names) if frag_of(n) == f] for f in range(p)]
    theta = [t.detach().clone() for t in x]
    buf: list[torch.Tensor | None] = [None] * len(x)
    rounds = 0
    flight: tuple[int, list[torch.Tensor], int] | None = None

    def apply(frag: int, delta: list[torch.Tensor]) -> None:
        nonlocal rounds
        with torch.no_grad():
            for i, d in zip(frags[frag], delta, strict=True):
                b = buf[i]
                if b is None:  # torch's SGD creates the buffer from the first gradient
                    b = buf[i] = d.clone()
                else:
                    b.mul_(mu).add_(d)
                theta[i].add_(d.add(b, alpha=mu), alpha=-lr)
                x[i].mul_(alpha).add_(theta[i], alpha=1 - alpha)
        rounds += 1

    for s in range(1, steps + 1):
        inner_step(model, opt, corpus, s - 1)
        if flight is not None and s >= flight[2]:
            apply(flight[0], flight[1])
            flight = None
        if flight is None and (s + tau) % (h // p) == 0:
            frag = rounds % p
            flight = (frag, [theta[i] - x[i].detach() for i in frags[frag]], s + tau)
            if tau == 0:
                apply(flight[0], flight[1])
                flight = None
    # finish: the fragment in flight, then the other fragments, then everyone on theta
    assert flight is not None, "choose steps so that the run ends inside an overlap window"
    apply(flight[0], flight[1])
    for _ in range(p - 1):
        frag = rounds % p
        apply(frag, [theta[i] - x[i].detach() for i in frags[frag]])
    with torch.no_grad():
        for xi, t in zip(x, theta, strict=True):
            xi.copy_(t)
    return theta, [t.detach() for t in x]


def test_streaming_one_peer_equals_hand_computed_update(corpus):
    h, p, tau, alpha, steps = 8, 2, 2, 0.5, 19  # step 19 is inside the window of the sync at 20
    theta, local = _hand_streaming(corpus, 11, h, p, tau, alpha, steps)
    model = GPT(TINY, seed=11)
    opt = adamw(model)
    cfg = StreamingConfig(sync_every=h, fragments=p, overlap=tau, alpha=alpha)
    st = StreamingDiLoCo(None, model, opt, cfg)
    drive(st, opt, corpus, steps)
    assert_same(st.global_params, theta)
    assert_same(params(model), local)
    assert st.step_count == steps


# -- eager DiLoCo ------------------------------------------------------------------------------


def _hand_eager(
    corpus: Corpus, seed: int, h: int, phases: int, start: str, lr: float, mu: float
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The paper's scheme (anchor 0) and the naive delayed one, with one peer."""
    model = GPT(TINY, seed=seed)
    opt = adamw(model)
    x = list(model.parameters())
    theta = [t.detach().clone() for t in x]
    buf = [torch.zeros_like(t) for t in x]
    begin = [t.detach().clone() for t in x]
    pending: list[torch.Tensor] | None = None
    step = 0
    for _ in range(phases):
        for _ in range(h):
            inner_step(model, opt, corpus, step)
            step += 1
        with torch.no_grad():
            delta = [s - xi for s, xi in zip(begin, x, strict=True)]  # this phase's progress
            if pending is not None:  # the previous phase's mean arrives one phase late
                for t, b, d in zip(theta, buf, pending, strict=True):
                    nesterov(t, b, d, lr, mu)
            pending = delta
            for s, t, d, xi in zip(begin, theta, delta, x, strict=True):
                # paper: own fresh outer step on top of the delayed theta (M = 1)
                s.copy_(t.add(d, alpha=-lr * (1 + mu)) if start == "paper" else t)
                xi.copy_(s)
    with torch.no_grad():
        assert pending is not None
        for t, b, d in zip(theta, buf, pending, strict=True):
            nesterov(t, b, d, lr, mu)
        for xi, t in zip(x, theta, strict=True):
            xi.copy_(t)
    return theta, [t.detach() for t in x]


@pytest.mark.parametrize(
    "start,lr,mu",
    [("paper", 0.7, 0.9), ("theta", 0.7, 0.9), ("paper", 1.0, 0.0)],
    ids=["paper-nesterov", "delayed-nesterov", "paper-plain"],
)
def test_eager_diloco_one_peer_equals_hand_computed_update(corpus, start, lr, mu):
    h, phases = 3, 3
    theta, local = _hand_eager(corpus, 5, h, phases, start, lr, mu)
    model = GPT(TINY, seed=5)
    opt = adamw(model)
    cfg = EagerConfig(sync_every=h, start=start, anchor=0.0, outer_lr=lr, outer_momentum=mu)
    st = EagerDiLoCo(None, model, opt, cfg)
    drive(st, opt, corpus, h * phases)
    assert_same(st.global_params, theta)
    assert_same(params(model), local)
    assert st.outer_rounds == phases  # phases - 1 at boundaries + the last one at finish()


@pytest.mark.parametrize(
    "lr,mu,nesterov,anchor",
    [(0.7, 0.9, True, 0.5), (0.7, 0.9, False, 1.0), (1.0, 0.0, True, 0.5)],
    ids=["defaults", "heavy-ball", "no-momentum"],
)
def test_eager_predicted_start_with_one_peer_is_diloco_bit_for_bit(
    corpus, lr, mu, nesterov, anchor
):
    # With one peer the prediction of the mean in flight is the mean itself: every phase starts
    # exactly where DiLoCo's does, the anchor moves nothing, and the last settle catches theta up.
    h, steps = 3, 11  # three boundaries and a partial phase synced at finish()
    outer = {"outer_lr": lr, "outer_momentum": mu, "nesterov": nesterov}
    ref_model = GPT(TINY, seed=7)
    ref_opt = adamw(ref_model)
    ref = DiLoCo(None, ref_model, ref_opt, DiLoCoConfig(sync_every=h, **outer))
    drive(ref, ref_opt, corpus, steps)
    model = GPT(TINY, seed=7)
    opt = adamw(model)
    st = EagerDiLoCo(None, model, opt, EagerConfig(sync_every=h, anchor=anchor, **outer))
    drive(st, opt, corpus, steps)
    assert_bits(params(model), params(ref_model))
    assert_bits(st.global_params, ref.global_params)


def assert_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.dtype == y.dtype
        assert x.view(torch.int32).equal(y.view(torch.int32)), f"tensor {i}: bits differ"


@pytest.mark.parametrize("mu,nesterov", [(0.9, True), (0.5, False), (0.0, False)])
def test_preview_sgd_gives_the_bits_of_the_step_and_changes_nothing(mu, nesterov):
    g = torch.Generator().manual_seed(3)
    theta = torch.randn(257, generator=g)
    buf = torch.randn(257, generator=g) if mu > 0 else None
    grad = torch.randn(257, generator=g) * 1e-3
    before = (theta.clone(), None if buf is None else buf.clone())
    out = torch.empty_like(theta)
    preview_sgd(theta, buf, grad, 0.7, mu, nesterov, out=out)
    assert theta.equal(before[0]) and (buf is None or buf.equal(before[1]))
    p = theta.clone()
    opt = torch.optim.SGD([p], lr=0.7, momentum=mu, nesterov=nesterov)
    if buf is not None:
        opt.state[p]["momentum_buffer"] = buf.clone()
    p.grad = grad.clone()
    opt.step()
    assert_bits([out], [p])


@pytest.mark.parametrize("start", ["predicted", "paper", "theta"])
def test_eager_remeasure_and_restart_with_four_contributors(start):
    # The per-peer arithmetic of one boundary with M = 4, against the formulas in eager.py.
    model = GPT(TINY, seed=8)
    cfg = EagerConfig(sync_every=3, start=start, anchor=0.5)
    st = EagerDiLoCo(None, model, adamw(model), cfg)
    g = torch.Generator().manual_seed(9)
    lr, mu = cfg.outer_lr, cfg.outer_momentum
    with torch.no_grad():
        for t in st.global_params:
            t.copy_(torch.randn(t.shape, generator=g))
        bufs = [st.outer.state[t]["momentum_buffer"] for t in st.global_params]
        for b in bufs:
            b.copy_(torch.randn(b.shape, generator=g) * 1e-2)
        for s in st.start:
            s.copy_(torch.randn(s.shape, generator=g))
    theta = [t.clone() for t in st.global_params]
    begin = [s.clone() for s in st.start]
    delta = [torch.randn(t.shape, generator=g) * 1e-2 for t in theta]
    measured = [d + 0.5 * (t - s) for d, t, s in zip(delta, theta, begin, strict=True)]
    st.remeasure(delta)
    for d, want in zip(delta, measured, strict=True):
        torch.testing.assert_close(d, want)
    with torch.no_grad():
        st.restart(delta, contributors=4)
    for s, t, d, b in zip(st.start, theta, measured, bufs, strict=True):
        if start == "predicted":  # Nesterov on the own outer gradient, momentum included
            want = t - lr * (d + mu * (mu * b + d))
        elif start == "paper":  # the fresh own share
            want = t - lr * (1 + mu) * d / 4
        else:
            want = t
        torch.testing.assert_close(s, want)
    assert all(t.equal(u) for t, u in zip(st.global_params, theta, strict=True))  # unchanged


def test_eager_partial_last_phase_is_synced_at_finish(corpus):
    model = GPT(TINY, seed=6)
    opt = adamw(model)
    st = EagerDiLoCo(None, model, opt, EagerConfig(sync_every=4))
    drive(st, opt, corpus, 10)  # boundaries at 4 and 8, then 2 steps
    assert st.step_count == 10
    assert st.outer_rounds == 3  # round of 4 at 8, round of 8 and the partial round at finish
    assert_same(params(model), st.global_params)


# -- CO2 ---------------------------------------------------------------------------------------


def _hand_co2(
    corpus: Corpus, seed: int, tau: int, rounds: int, cfg: CO2Config
) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    model = GPT(TINY, seed=seed)
    opt = adamw(model)
    x = list(model.parameters())
    x_old = [t.detach().clone() for t in x]
    m = [torch.zeros_like(t) for t in x]
    pending: list[torch.Tensor] | None = None
    clipped = 0

    def outer(d_mean: list[torch.Tensor]) -> None:
        nonlocal clipped
        for xo, mi, d in zip(x_old, m, d_mean, strict=True):
            mi.mul_(cfg.outer_momentum).add_(d, alpha=1.0 / cfg.gap_penalty)
            assert cfg.clip is not None
            clipped += int((mi.abs() > cfg.clip).sum())
            mi.clamp_(-cfg.clip, cfg.clip)
            xo.add_(mi, alpha=-cfg.outer_lr)

    step = 0
    for _ in range(rounds):
        for _ in range(tau):
            inner_step(model, opt, corpus, step)
            step += 1
        with torch.no_grad():
            d_now = [xo - xi for xo, xi in zip(x_old, x, strict=True)]  # x_old(t) - x_i
            if pending is not None:
                outer(pending)  # one round stale
            pending = d_now
            for xi, xo in zip(x, x_old, strict=True):
                xi.copy_(xo)
    with torch.no_grad():
        assert pending is not None
        outer(pending)
        for xi, xo in zip(x, x_old, strict=True):
            xi.copy_(xo)
    return x_old, m, clipped


def test_co2_one_peer_equals_hand_computed_update_and_clips_for_real(corpus):
    # a tiny clip so that it bites; a gap penalty other than 1
    cfg = CO2Config(sync_every=3, outer_lr=1.0, outer_momentum=0.5, gap_penalty=2.0, clip=1e-3)
    x_old, m, clipped = _hand_co2(corpus, 9, 3, 3, cfg)
    model = GPT(TINY, seed=9)
    opt = adamw(model)
    st = CO2(None, model, opt, cfg)
    drive(st, opt, corpus, 9)
    assert_same(st.global_params, x_old)
    assert_same(st.momentum, m)
    assert_same(params(model), x_old)
    assert st.clipped == clipped > 0
    bound = torch.tensor(1e-3, dtype=torch.float32)
    assert all(bool((t.abs() <= bound).all()) for t in st.momentum)


def test_co2_without_clipping_differs_from_clipped(corpus):
    def run(clip: float | None) -> list[torch.Tensor]:
        model = GPT(TINY, seed=9)
        opt = adamw(model)
        st = CO2(None, model, opt, CO2Config(sync_every=3, clip=clip))
        drive(st, opt, corpus, 9)
        return st.momentum

    unclipped, clipped = run(None), run(1e-3)
    assert max(float(t.abs().max()) for t in unclipped) > 1e-3
    assert any(not torch.equal(a, b) for a, b in zip(unclipped, clipped, strict=True))


# -- local SGD ---------------------------------------------------------------------------------


def test_localsgd_one_peer_equals_hand_computed_average(corpus):
    h, steps = 4, 8
    plain = GPT(TINY, seed=2)
    opt = adamw(plain)
    theta = [t.detach().clone() for t in plain.parameters()]
    for s in range(steps):
        inner_step(plain, opt, corpus, s)
        if (s + 1) % h == 0:
            with torch.no_grad():
                for t, xi in zip(theta, plain.parameters(), strict=True):
                    t.add_(t - xi, alpha=-1.0)  # theta - mean(theta - x_i), one peer
                    xi.copy_(t)
    model = GPT(TINY, seed=2)
    o = adamw(model)
    ls = LocalSGD(None, model, o, LocalSGDConfig(sync_every=h))
    drive(ls, o, corpus, steps)
    assert_same(ls.global_params, theta)
    assert_same(params(model), params(plain))
    # averaging a single peer is the identity up to rounding (which AdamW then carries on)
    reference = GPT(TINY, seed=2)
    ro = adamw(reference)
    for s in range(steps):
        inner_step(reference, ro, corpus, s)
    for a, b in zip(params(model), params(reference), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


# -- configs -----------------------------------------------------------------------------------

BAD: list[tuple[Callable[[], object], str]] = [
    (lambda: StreamingConfig(sync_every=10, fragments=3), "multiple of fragments"),
    (lambda: StreamingConfig(sync_every=10, fragments=2, overlap=5), "below H/P"),
    (lambda: StreamingConfig(alpha=1.0), "alpha"),
    (lambda: StreamingConfig(pattern="zigzag"), "pattern"),
    (lambda: StreamingConfig(fragments=2, nonlayer_fragment=2), "nonlayer_fragment"),
    (lambda: StreamingConfig(fragments=0), "fragments"),
    (lambda: EagerConfig(sync_every=0), "sync_every"),
    (lambda: EagerConfig(outer_momentum=1.0), "outer_momentum"),
    (lambda: EagerConfig(start="eager"), "start must be one of predicted, paper, theta"),
    (lambda: EagerConfig(anchor=1.5), "anchor"),
    (lambda: CO2Config(gap_penalty=0.0), "gap_penalty"),
    (lambda: CO2Config(clip=0.0), "clip"),
    (lambda: CO2Config(outer_lr=-1.0), "outer_lr"),
    (lambda: LocalSGDConfig(sync_every=0), "sync_every"),
]


@pytest.mark.parametrize("make,what", BAD, ids=[w for _, w in BAD])
def test_bad_configs_are_rejected_with_the_field_named(make, what):
    with pytest.raises(ValueError, match=what):
        make()


def test_options_build_each_strategy_by_name():
    from isthmus.reduce.reducer import Reducer

    model = GPT(TINY, seed=0)
    for cls, opts in [
        (StreamingDiLoCo, {"sync_every": 4, "fragments": 2, "overlap": 1}),
        (EagerDiLoCo, {"sync_every": 4, "start": "theta"}),
        (CO2, {"sync_every": 4, "clip": None}),
        (LocalSGD, {"sync_every": 4}),
    ]:
        st = cls.from_options(None, model, adamw(model), Reducer(), **opts)
        assert isinstance(st, cls)
        with pytest.raises(ValueError, match="unknown option"):
            cls.from_options(None, model, adamw(model), Reducer(), bogus=1)


@pytest.mark.parametrize("cls", [EagerDiLoCo, CO2], ids=["eager", "co2"])
def test_non_finite_outer_gradient_is_dropped_and_the_peer_restarts_from_theta(corpus, cls):
    model = GPT(TINY, seed=4)
    opt = adamw(model)
    st = cls(
        None,
        model,
        opt,
        EagerConfig(sync_every=3) if cls is EagerDiLoCo else CO2Config(sync_every=3),
    )
    for step in range(6):
        x, y = corpus.batch(step=step, rank=0, world=1, batch_size=4, block_size=TINY.block_size)
        model(x, y)[1].backward()
        if step == 5:  # the last step of the second phase: its outer gradient becomes NaN
            with torch.no_grad():
                next(model.parameters())[0, 0] = float("nan")
        st.step()
        opt.zero_grad()
    assert st.reducer is not None and st.reducer.nonfinite_skips == 1
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    # restarted without its own outer gradient: from theta (CO2), from theta plus the outer
    # momentum's step (eager's prediction with nothing of its own)
    expected = [g.clone() for g in st.global_params]
    if isinstance(st, EagerDiLoCo):
        for e, g in zip(expected, st.global_params, strict=True):
            buf = st.outer.state[g]["momentum_buffer"]
            preview_sgd(g, buf, torch.zeros_like(g), 0.7, 0.9, True, out=e)
        assert not all(e.equal(g) for e, g in zip(expected, st.global_params, strict=True))
    assert_same(params(model), expected)
    st.finish()
    assert all(bool(torch.isfinite(g).all()) for g in st.global_params)


def test_steady_overlap_leaves_out_the_blocking_start_and_end():
    from isthmus.reduce.reducer import OverlapTiming
    from isthmus.strategies.pipeline import SteadyOverlap

    t = OverlapTiming()
    steady = SteadyOverlap(t)
    t.add(comm=1.0, blocked=1.0)  # a blocking catch-up round
    steady.mark_start()
    for _ in range(4):
        t.add(comm=0.5, blocked=0.05)  # overlapped rounds: 10% blocked
    steady.mark_end()
    t.add(comm=2.0, blocked=2.0)  # the final flush
    assert steady.fraction == pytest.approx(0.9)
    assert t.overlap_fraction == pytest.approx(1 - 3.2 / 5.0)


def test_a_peer_resynced_by_the_last_retry_takes_part_in_the_final_round_contributing_nothing(
    corpus,
):
    """finish(): if settling the round in flight resynced this peer (a retry repaired it), its
    partial last phase started from a stale state. Every member issues the final round (their
    step counters agree), so this peer must issue it too, but with nothing of its own in it."""
    import dataclasses

    model = GPT(TINY, seed=8)
    opt = adamw(model)
    st = EagerDiLoCo(None, model, opt, EagerConfig(sync_every=4))
    pipeline = st.pipeline
    settle, issue = pipeline.settle, pipeline.issue
    contributed: list[bool] = []

    def settle_resynced():
        s = settle()
        return dataclasses.replace(s, resynced_late=True, retried=True)

    def issue_spy(build):
        flight = issue(build)
        contributed.append(flight.plan.contribute)
        return flight

    for step in range(10):  # boundaries at 4 and 8 (a round in flight), then 2 steps
        inner_x, inner_y = corpus.batch(
            step=step, rank=0, world=1, batch_size=4, block_size=TINY.block_size
        )
        model(inner_x, inner_y)[1].backward()
        st.step()
        opt.zero_grad()
    pipeline.settle = settle_resynced  # type: ignore[method-assign]
    pipeline.issue = issue_spy  # type: ignore[method-assign]
    st.finish()
    assert contributed == [False]  # issued (the members do), but not contributed
    assert st.step_count == 10
    assert_same(params(model), st.global_params)


def test_streaming_step_counter_is_exact_beyond_float32_integers(corpus):
    """The apply step rides in the reduction's exact values, which are float32: it must travel
    as a small offset from the shared counter, or a run past 2**24 steps loses count."""
    model = GPT(TINY, seed=9)
    opt = adamw(model)
    st = StreamingDiLoCo(
        None, model, opt, StreamingConfig(sync_every=4, fragments=2, overlap=1, alpha=0.5)
    )
    start = 2**25 + 1  # odd: float32 cannot hold it
    st.global_step.fill_(start)
    for step in range(9):  # without a session the first step trains; syncs at 2, 4, 6, 8
        x, y = corpus.batch(step=step, rank=0, world=1, batch_size=4, block_size=TINY.block_size)
        model(x, y)[1].backward()
        st.step()
        opt.zero_grad()
    assert st.step_count == start + 9
    st.finish()
    assert st.step_count == start + 9
    assert all(at - start in range(0, 10) for at, _ in st.sync_log), st.sync_log


def test_one_peer_diloco_drops_a_non_finite_outer_gradient(corpus):
    """The reducer's policy (a non-finite update contributes nothing) also holds without a
    session: theta stays finite and the peer restarts from it."""
    model = GPT(TINY, seed=10)
    opt = adamw(model)
    st = DiLoCo(None, model, opt, DiLoCoConfig(sync_every=3))
    before = [g.clone() for g in st.global_params]
    for step in range(3):
        x, y = corpus.batch(step=step, rank=0, world=1, batch_size=4, block_size=TINY.block_size)
        model(x, y)[1].backward()
        if step == 2:
            with torch.no_grad():
                next(model.parameters())[0, 0] = float("inf")
        st.step()
        opt.zero_grad()
    assert st.reducer is not None and st.reducer.nonfinite_skips == 1
    assert_same(st.global_params, before)
    assert_same(params(model), st.global_params)
