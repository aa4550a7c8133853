"""SparseLoCo's math and one-peer strategy, without a network: the codec's bytes, quantizer and
packing, the rank-order sum, and one peer against hand-written SparseLoCo rounds (whole model,
Streaming fragments, overlapped rounds), with its local state saved and loaded mid-round."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from isthmus.data import Corpus
from isthmus.models import GPT, GPTConfig
from isthmus.strategies import SparseLoCo, SparseLoCoConfig, make_strategy
from isthmus.strategies.sparseloco.math import (
    SparseCodec,
    pack_codes,
    quantize,
    sum_messages,
    unpack_codes,
)
from isthmus.strategies.streaming import layer_of

TINY = GPTConfig.tiny()


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_codes_pack_into_the_documented_bytes_and_back(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (37,), generator=g, dtype=torch.int64).to(torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.numel() == math.ceil(bits * 37 / 8)
    assert torch.equal(unpack_codes(packed, bits, 37), codes)
    if bits == 2:  # little-endian within a byte: code j at bits 2j..2j+1
        assert int(pack_codes(torch.tensor([1, 2, 3, 0], dtype=torch.uint8), 2)[0]) == (
            1 | 2 << 2 | 3 << 4
        )


def test_quantizer_by_hand():
    v = torch.tensor([4.0, -4.0, 3.0, -2.0, 0.5])
    codes, table = quantize(v, 2)
    shift = v.mean()
    c = v - shift
    scale = 6.0 * float(c.norm() / 2.0) / 4  # std with n - 1 = 4
    want = [min(3, max(0, round(float(x) / scale + 2))) for x in c]
    assert codes.tolist() == want
    assert table[0] == shift
    for level in range(4):
        members = [float(x) for x, k in zip(c, want, strict=True) if k == level]
        expect = sum(members) / len(members) if members else 0.0
        assert table[1 + level].item() == pytest.approx(expect, rel=1e-6)
    # a constant vector: std 0, scale 1, everything at the middle level, decoded exactly
    codes, table = quantize(torch.full((3,), 2.5), 2)
    assert codes.tolist() == [2, 2, 2] and table[0] == 2.5 and table[3] == 0.0


def test_one_bit_splits_at_the_mean_and_decodes_each_side_to_its_mean():
    v = torch.tensor([3.0, -1.0, 2.0, -4.0, 0.5, -0.5])
    codes, table = quantize(v, 1)
    c = v - v.mean()
    want = [1 if float(x) >= 0 else 0 for x in c]
    assert codes.tolist() == want
    for level in (0, 1):
        members = [float(x) for x, k in zip(c, want, strict=True) if k == level]
        assert table[1 + level].item() == pytest.approx(sum(members) / len(members), rel=1e-6)
    # every value decodes to its own side of the mean
    decoded = table[1:][codes.long()] + table[0]
    assert torch.equal(torch.sign(decoded - v.mean()), torch.sign(c).where(c != 0, 1.0))


def test_a_parameter_without_elements_sends_only_its_table():
    shapes = [torch.Size([0]), torch.Size([5])]
    codec = SparseCodec(shapes, chunk=4, k=2, bits=2, exact=0)
    msg = codec.encode([torch.zeros(0), torch.arange(5.0)], None)
    assert msg.numel() == codec.payload_bytes == _expected_bytes(shapes, 4, 2, 2, exact=0)
    dense = codec.dense(codec.decode(msg))
    assert dense[0].numel() == 0 and dense[1].count_nonzero() == 3  # top 2 of [0:4], 1 of [4:5]


def _expected_bytes(shapes, chunk, k, bits, exact):
    total = 4 * (1 + exact)
    for s in shapes:
        n = math.prod(s)
        kept = (n // chunk) * min(k, chunk) + min(k, n % chunk)
        if bits == 32:
            total += 6 * kept
        else:
            total += 2 * kept + math.ceil(bits * kept / 8) + 4 * (2**bits + 1)
    return total


@pytest.mark.parametrize("bits", [1, 2, 32])
def test_message_is_exactly_the_documented_bytes(bits):
    model = GPT(TINY, seed=3)
    opt = torch.optim.AdamW(model.parameters())
    st = SparseLoCo(None, model, opt, SparseLoCoConfig(bits=bits))
    shapes = [p.shape for p in st.params]
    want = _expected_bytes(shapes, 4096, 64, bits, exact=1)  # the step count, no buffers
    assert st.payload_bytes == want
    msg = st.groups[0].codec.encode(
        [torch.randn(p.numel()) for p in st.params], torch.tensor([5.0])
    )
    assert msg.dtype == torch.uint8 and msg.numel() == want
    # the tiny GPT in figures: 34,688 parameters, 2 bits -> 3,736 bytes a round, 1 bit (the
    # default) -> 3,336
    assert sum(p.numel() for p in st.params) == 34_688
    assert want == {1: 3_336, 2: 3_736}.get(bits, want)


def test_messages_sum_in_rank_order_and_skip_absent_ones():
    codec = SparseCodec([torch.Size([10]), torch.Size([3, 3])], chunk=4, k=2, bits=32, exact=1)
    g = torch.Generator().manual_seed(0)
    tensors = [[torch.randn(10, generator=g), torch.randn(9, generator=g)] for _ in range(3)]
    msgs = [codec.encode(t, torch.tensor([float(r + 1)])) for r, t in enumerate(tensors)]
    absent = torch.zeros(codec.payload_bytes, dtype=torch.uint8)
    sums, exact, n = sum_messages(codec, [msgs[0], absent, msgs[1], msgs[2]])
    assert n == 3 and exact.tolist() == [6.0]
    dense = [codec.dense(codec.decode(m)) for m in msgs]
    for i in range(2):
        want = torch.zeros_like(dense[0][i])
        for d in dense:  # rank order
            want = want + d[i]
        assert torch.equal(sums[i], want)
    # chunk-wise top-2 of the first tensor of rank 0: chunks [0:4], [4:8], [8:10]
    t = tensors[0][0]
    keep = set()
    for lo, hi in ((0, 4), (4, 8), (8, 10)):
        keep |= set(sorted(range(lo, hi), key=lambda j: -abs(float(t[j])))[:2])
    d0 = dense[0][0]
    assert {j for j in range(10) if d0[j] != 0} == keep
    assert all(d0[j] == t[j] for j in keep)  # 32 bits: the values themselves


def _hand_round(acc: torch.Tensor, chunk: int, k: int, bits: int = 2) -> torch.Tensor:
    """What one accumulator sends at 2 bits (or 1), written out chunk by chunk."""
    positions = []
    for lo in range(0, acc.numel(), chunk):
        hi = min(lo + chunk, acc.numel())
        order = sorted(range(lo, hi), key=lambda j: -abs(float(acc[j])))
        positions += sorted(order[: min(k, hi - lo)])
    vals = acc[positions]
    shift = vals.mean()
    c = vals - shift
    n = c.numel()
    std = float(c.norm()) / math.sqrt(n - 1) if n > 1 else 0.0
    scale = 6.0 * std / 4 if std > 0 else 1.0
    if bits == 1:  # each value's side of the mean
        codes = torch.tensor([1 if float(x) >= 0 else 0 for x in c])
    else:
        codes = torch.clamp(torch.round(c / scale + 2), 0, 3).long()
    means = torch.zeros(2**bits)
    for level in range(2**bits):
        s, cnt = torch.zeros(()), 0
        for x, q in zip(c, codes, strict=True):  # in order, in fp32, as index_add_ sums
            if int(q) == level:
                s, cnt = s + x, cnt + 1
        means[level] = s / cnt if cnt else 0.0
    sent = torch.zeros_like(acc)
    sent[positions] = means[codes] + shift
    return sent


@pytest.mark.parametrize("bits", [1, 2])
def test_one_peer_equals_a_hand_written_sparseloco(bits):
    corpus = Corpus.from_stdlib(max_bytes=50_000)
    torch.set_num_threads(1)
    h, rounds, chunk, k, beta, alpha = 3, 3, 64, 4, 0.9, 0.8
    model = GPT(TINY, seed=5)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    cfg = SparseLoCoConfig(
        sync_every=h, chunk=chunk, top_k=k, outer_lr=alpha, error_decay=beta, bits=bits
    )
    st = SparseLoCo(None, model, opt, cfg)
    theta = [p.detach().clone() for p in ref.parameters()]
    error = [torch.zeros(t.numel()) for t in theta]
    for step in range(h * rounds):
        x, y = corpus.batch(step=step, rank=0, world=1, batch_size=2, block_size=TINY.block_size)
        model(x, y)[1].backward()
        st.step()
        opt.zero_grad()
        ref(x, y)[1].backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if (step + 1) % h == 0:  # the hand-written round
            with torch.no_grad():
                for i, p in enumerate(ref.parameters()):
                    acc = error[i] * beta + (theta[i] - p).reshape(-1)
                    sent = _hand_round(acc, chunk, k, bits)
                    error[i] = acc - sent
                    # theta - alpha * sent as one fused operation (torch's add with alpha), as
                    # any implementation that scales and adds in one pass rounds it
                    theta[i] = torch.add(theta[i], sent.view(theta[i].shape), alpha=-alpha)
                    p.copy_(theta[i])
    assert st.step_count == h * rounds and st.outer_rounds == rounds
    for i, (g, t) in enumerate(zip(st.global_params, theta, strict=True)):
        assert torch.equal(g, t), f"theta {st.names[i]} differs"
        assert torch.equal(st.error[i], error[i]), f"accumulator {st.names[i]} differs"
    for p, t in zip(model.parameters(), theta, strict=True):
        assert torch.equal(p, t)


def test_options_and_refusals():
    model = GPT(TINY, seed=1)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="bits"):
        SparseLoCoConfig(bits=3)
    with pytest.raises(ValueError, match="top_k"):
        SparseLoCoConfig(top_k=5000)
    with pytest.raises(ValueError, match="chunk"):
        SparseLoCoConfig(chunk=40000, top_k=10)
    with pytest.raises(ValueError, match="no outer momentum"):
        SparseLoCoConfig(outer_momentum=0.9)
    with pytest.raises(ValueError, match="no time budget"):
        SparseLoCoConfig(inner_budget="time")
    with pytest.raises(ValueError, match="compression"):
        make_strategy("sparseloco", None, model, opt, compression="int8")
    st = make_strategy("sparseloco", None, model, opt, top_k="32", bits="4")
    assert isinstance(st, SparseLoCo) and st.groups[0].codec.bits == 4
    # Streaming's options: checked as streaming checks them; mixing does not compose
    with pytest.raises(ValueError, match="alpha must be 0"):
        SparseLoCoConfig(fragments=2, alpha=0.5)
    with pytest.raises(ValueError, match=r"overlap \(tau=10\) must be in 0\.\.9"):
        SparseLoCoConfig(sync_every=20, fragments=2, overlap=10)
    with pytest.raises(ValueError, match="multiple of fragments"):
        SparseLoCoConfig(fragments=3)
    st = make_strategy("sparseloco", None, model, opt, fragments="2", overlap="1")
    assert isinstance(st, SparseLoCo) and len(st.groups) == 2


def test_a_nonfinite_accumulator_sends_nothing_and_keeps_the_residual():
    model = GPT(TINY, seed=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    st = SparseLoCo(None, model, opt, SparseLoCoConfig(sync_every=1))
    st.error[0].fill_(1.0)
    before = [g.clone() for g in st.global_params]
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    st.step()  # no gradients: the optimizer leaves the parameters; the round at step 1 runs
    assert st.reducer.nonfinite_skips == 1 and st.absent_rounds == 1
    assert all(torch.equal(a, b) for a, b in zip(before, st.global_params, strict=True))
    assert torch.equal(st.error[0], torch.ones_like(st.error[0]))
    assert all(torch.equal(p, g) for p, g in zip(st.params, st.global_params, strict=True))


def test_the_accumulators_travel_in_the_local_state():
    corpus = Corpus.from_stdlib(max_bytes=50_000)
    model = GPT(TINY, seed=4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    st = SparseLoCo(None, model, opt, SparseLoCoConfig(sync_every=2, top_k=4, chunk=64))
    for step in range(5):
        x, y = corpus.batch(step=step, rank=0, world=1, batch_size=2, block_size=TINY.block_size)
        model(x, y)[1].backward()
        st.step()
        opt.zero_grad()
    saved = copy.deepcopy(st.local_state())
    assert any(bool(e.abs().sum() > 0) for e in st.error)
    fresh_model = GPT(TINY, seed=4)
    fresh = SparseLoCo(None, fresh_model, torch.optim.AdamW(fresh_model.parameters(), lr=3e-3))
    fresh.load_local_state(saved)
    assert all(torch.equal(a, b) for a, b in zip(st.error, fresh.error, strict=True))
    assert fresh.since == st.since == 1
    bad = {k: v for k, v in saved.items() if k != "error"}
    with pytest.raises(ValueError, match="error"):
        fresh.load_local_state(bad)
    # a misshapen accumulator is refused before anything is loaded, Streaming's part included
    other_model = GPT(TINY, seed=5)
    other = SparseLoCo(None, other_model, torch.optim.AdamW(other_model.parameters(), lr=3e-3))
    before = copy.deepcopy(other.local_state())
    misshapen = copy.deepcopy(saved)
    first = next(iter(misshapen["error"]))
    misshapen["error"][first] = torch.zeros(3)
    with pytest.raises(ValueError, match=f"error/{first}"):
        other.load_local_state(misshapen)
    assert _same(other.local_state(), before) and not _same(saved, before)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_each_fragment_sends_its_own_documented_bytes():
    model = GPT(TINY, seed=3)
    st = SparseLoCo(
        None, model, torch.optim.AdamW(model.parameters()), SparseLoCoConfig(fragments=2, bits=2)
    )
    whole = _expected_bytes([p.shape for p in st.params], 4096, 64, 2, exact=1)
    for f, idx in enumerate(st.fragments):
        want = _expected_bytes([st.params[i].shape for i in idx], 4096, 64, 2, exact=1)
        assert st.fragment_payload_bytes[f] == want
        tensors = [torch.randn(st.params[i].numel()) for i in idx]
        assert st.groups[f].codec.encode(tensors, torch.tensor([1.0])).numel() == want
    # every tensor's bytes go in its fragment's round, plus one 8-byte header per fragment
    assert sum(st.fragment_payload_bytes) == whole + 8
    # the tiny GPT, strided: layer 0 with the embeddings, then layer 1 (small tensors cost their
    # table and up to 64 entries each, so bytes do not split like elements)
    assert st.fragment_payload_bytes == [2_200, 1_544] and st.payload_bytes == 2_200 < whole
    assert st.metrics()["fragment_payload_bytes"] == [2_200, 1_544]


def _hand_fragments(
    corpus: Corpus, h: int, p: int, tau: int, steps: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """SparseLoCo on Streaming's schedule by hand (one peer): fragments by layer parity (the tiny
    GPT's two layers, the rest with layer 0), fragment = round % P; a round's accumulator and
    message are built when it is issued and applied tau steps later, when the fragment restarts
    from theta. Returns theta, the accumulators and the model at the end (after finish)."""
    chunk, k, beta, lr = 64, 4, 0.9, 0.8
    model = GPT(TINY, seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    frags = [[i for i, n in enumerate(names) if (layer_of(n) or 0) % p == f] for f in range(p)]
    theta = [t.detach().clone() for t in x]
    error = [torch.zeros(t.numel()) for t in x]
    rounds, last_apply = 0, 0

    def issue() -> tuple[int, dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        frag = rounds % p
        acc = {i: error[i] * beta + (theta[i] - x[i].detach()).reshape(-1) for i in frags[frag]}
        return frag, acc, {i: _hand_round(a, chunk, k) for i, a in acc.items()}

    def apply(frag: int, acc: dict[int, torch.Tensor], sent: dict[int, torch.Tensor]) -> None:
        nonlocal rounds
        with torch.no_grad():
            for i in frags[frag]:
                error[i] = acc[i] - sent[i]
                theta[i] = torch.add(theta[i], sent[i].view(theta[i].shape), alpha=-lr)
                x[i].copy_(theta[i])
        rounds += 1

    flight = None
    for s in range(1, steps + 1):
        xb, yb = corpus.batch(step=s - 1, rank=0, world=1, batch_size=2, block_size=TINY.block_size)
        model(xb, yb)[1].backward()
        opt.step()
        opt.zero_grad()
        if flight is not None and s >= flight[1]:
            apply(*flight[0])
            flight, last_apply = None, s
        if flight is None and (s + tau) % (h // p) == 0:
            flight = (issue(), s + tau)
            if tau == 0:
                apply(*flight[0])
                flight, last_apply = None, s
    # finish: the round in flight, then each fragment with progress, then the model on theta
    just = flight is not None or last_apply == steps
    if flight is not None:
        apply(*flight[0])
    for _ in range(p - 1 if just else p):
        apply(*issue())
    with torch.no_grad():
        for xi, t in zip(x, theta, strict=True):
            xi.copy_(t)
    return theta, error, [t.detach() for t in x]


# Every round follows at least two inner steps of its fragment: after one AdamW step many
# entries of a tensor move by the same magnitude, and top-k's choice among ties is torch's own.
@pytest.mark.parametrize(
    "h,p,tau,steps",
    [(4, 2, 0, 7), (3, 1, 1, 8), (6, 2, 1, 8)],
    ids=["fragments", "overlap", "fragments-overlap"],
)
def test_one_peer_with_fragments_and_overlap_equals_a_hand_written_reference(h, p, tau, steps):
    corpus = Corpus.from_stdlib(max_bytes=50_000)
    torch.set_num_threads(1)
    theta, error, local = _hand_fragments(corpus, h, p, tau, steps)
    model = GPT(TINY, seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    cfg = SparseLoCoConfig(
        sync_every=h,
        fragments=p,
        overlap=tau,
        chunk=64,
        top_k=4,
        outer_lr=0.8,
        error_decay=0.9,
        bits=2,
    )
    st = SparseLoCo(None, model, opt, cfg)
    for step in range(steps):
        x, y = corpus.batch(step=step, rank=0, world=1, batch_size=2, block_size=TINY.block_size)
        model(x, y)[1].backward()
        st.step()
        opt.zero_grad()
    st.finish()
    assert st.step_count == steps and st.absent_rounds == 0
    for i, (g, t) in enumerate(zip(st.global_params, theta, strict=True)):
        assert torch.equal(g, t), f"theta {st.names[i]} differs"
        assert torch.equal(st.error[i], error[i]), f"accumulator {st.names[i]} differs"
    for got, want in zip(model.parameters(), local, strict=True):
        assert torch.equal(got, want)


def test_a_round_in_flight_survives_the_local_state_bit_for_bit():
    """A checkpoint taken while a fragment's round is in flight: the loaded peer re-issues it
    (the same message, from the same accumulators and snapshot) and ends on the same bits."""
    corpus = Corpus.from_stdlib(max_bytes=50_000)
    torch.set_num_threads(1)
    cfg = SparseLoCoConfig(sync_every=6, fragments=2, overlap=1, chunk=64, top_k=4)

    def build() -> SparseLoCo:
        model = GPT(TINY, seed=6)
        return SparseLoCo(None, model, torch.optim.AdamW(model.parameters(), lr=3e-3), cfg)

    def run(st: SparseLoCo, upto: int) -> None:
        while st.step_count < upto:
            x, y = corpus.batch(
                step=st.step_count, rank=0, world=1, batch_size=2, block_size=TINY.block_size
            )
            st.model(x, y)[1].backward()
            st.step()
            st.optimizer.zero_grad()

    a = build()
    run(a, 5)  # the round issued at step 5 (fragment 1, applied at 6) is in flight
    assert a.pipeline.in_flight and any(bool(e.abs().sum() > 0) for e in a.error)
    saved = copy.deepcopy(a.local_state())
    assert saved["flight"]["present"] == 1 and saved["flight"]["fragment"] == 1
    b = build()
    with torch.no_grad():  # the shared state, as a checkpoint restores it
        for gb, ga in zip(b.global_params, a.global_params, strict=True):
            gb.copy_(ga)
        b.global_step.copy_(a.global_step)
    b.load_local_state(saved)
    assert all(torch.equal(x, y) for x, y in zip(a.error, b.error, strict=True))
    for st in (a, b):
        run(st, 13)
        st.finish()
    assert a.outer_rounds == b.outer_rounds and a.sync_log[-len(b.sync_log) :] == b.sync_log
    ends = [(a.global_params, b.global_params), (a.error, b.error), (a.params, b.params)]
    for xs, ys in ends:
        assert all(torch.equal(x, y) for x, y in zip(xs, ys, strict=True))
