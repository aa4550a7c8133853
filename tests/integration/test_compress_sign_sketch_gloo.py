"""1-bit sign compression with error feedback and count-sketch aggregation over real in-process
Gloo groups."""

from __future__ import annotations

import torch

from isthmus.reduce.compress.compressor import derive_seed
from isthmus.reduce.compress.sign import SignConfig, SignEF
from isthmus.reduce.compress.sketch import CountSketch, SketchConfig, SketchReducer
from isthmus.testing import local_groups, run_parallel


def test_sign_exact_on_sign_representable_inputs():
    # x_i = a_i * v with v in {-1, +1}^d: compression is lossless and so is the sum
    groups = local_groups(3)
    v = torch.where(torch.arange(50) % 3 == 0, -1.0, 1.0)

    def body(g):
        return SignEF().reduce_sum(g, "w", (g.rank + 1.0) * v)

    outs = run_parallel(groups, body)
    for o in outs:
        assert torch.allclose(o, 6.0 * v, atol=1e-5)
        assert torch.equal(o, outs[0])


def test_sign_error_feedback_tracks_the_running_sum():
    groups = local_groups(3)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(301, generator=gen) for _ in range(3)]
    true = sum(xs)

    def body(g):
        out = {}
        for server_error in (True, False):
            c = SignEF(SignConfig(server_error=server_error))
            acc = torch.zeros(301)
            first = None
            for _ in range(40):
                o = c.reduce_sum(g, "w", xs[g.rank])
                c.commit()
                first = o if first is None else first
                acc += o
            out[server_error] = (
                float((first - true).norm() / true.norm()),
                float((acc - 40 * true).norm() / (40 * true).norm()),
            )
        return out

    res = run_parallel(groups, body)[0]
    one_shot, tracked = res[True]
    assert one_shot > 0.5  # a single 1-bit round is crude
    assert tracked < 0.1  # but with error feedback the running sum follows the truth
    # without the owner's (server) error the second compression's bias is never corrected
    assert tracked < 0.5 * res[False][1]


def test_sketch_reducer_recovers_shared_heavy_coordinates_and_keeps_error():
    world, d, rounds = 3, 2000, 4
    groups = local_groups(world)
    cfg = SketchConfig(k=0.005, rows=5, width=0.1, seed=1)  # 10 coordinates, 200 columns
    heavy = torch.arange(0, 2000, 200)  # 10 coordinates

    def inputs(rank, rnd):
        gen = torch.Generator().manual_seed(10 * rnd + rank)
        x = torch.randn(d, generator=gen) * 0.01
        x[heavy] += 1.0 + rank
        return x

    def body(g):
        c = SketchReducer(cfg)
        outs, sent = [], []
        for rnd in range(rounds):
            before = g.stats.bytes_sent
            outs.append(c.reduce_sum(g, "w", inputs(g.rank, rnd)))
            sent.append(g.stats.bytes_sent - before)
            c.commit()
        return outs, sent, c.state_dict()["shared"]["w"]["err"]

    out = run_parallel(groups, body)
    for rnd in range(rounds):
        o = out[0][0][rnd]
        assert torch.equal(o, out[1][0][rnd]) and torch.equal(o, out[2][0][rnd])
        assert int((o != 0).sum()) == 10
        assert set(o.nonzero().reshape(-1).tolist()) == set(heavy.tolist())
        assert torch.allclose(o[heavy], torch.full((10,), 6.0), atol=0.3)
    # invariant of sketch-space error feedback: sketch(sum of results) + err == sum of sketches
    table = CountSketch(d, cfg.rows, cfg.columns(d), derive_seed(cfg.seed, "sketch", "w", d))
    total_in = sum(table.sketch(inputs(r, rnd)) for r in range(world) for rnd in range(rounds))
    returned = table.sketch(sum(out[0][0]))
    assert torch.allclose(returned + out[0][2], total_in, atol=1e-3)
    expect_bytes = SketchReducer(cfg).predict_bytes(d, world)
    assert out[0][1] == [expect_bytes] * rounds
    assert expect_bytes < d * 4  # 5 x 200 fp32 instead of 2000 fp32
