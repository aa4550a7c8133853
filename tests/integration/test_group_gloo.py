"""Collectives over real in-process Gloo groups: results, byte accounting, bounded waits."""

import pytest
import torch

from isthmus.comm.group import CollectiveError, wire_bytes
from isthmus.testing import local_groups, run_parallel


def test_collectives_results_and_bytes():
    groups = local_groups(3)

    def body(g):
        t = torch.full((6,), float(g.rank + 1))
        g.all_reduce(t, "sum")
        a = torch.full((6,), float(g.rank + 1))
        g.all_reduce(a, "avg")
        b = torch.full((4,), float(g.rank))
        g.broadcast(b, src=2)
        gathered = g.all_gather(torch.tensor([g.rank]))
        a2a = g.all_to_all(torch.arange(3, dtype=torch.int64) + 10 * g.rank)
        return t, a, b, gathered, a2a, g.stats.bytes_sent

    out = run_parallel(groups, body)
    for rank, (t, a, b, gathered, a2a, sent) in enumerate(out):
        assert torch.equal(t, torch.full((6,), 6.0))
        assert torch.equal(a, torch.full((6,), 2.0))
        assert torch.equal(b, torch.full((4,), 2.0))
        assert [int(x) for x in gathered] == [0, 1, 2]
        assert a2a.tolist() == [rank, 10 + rank, 20 + rank]
        expected = (
            2 * wire_bytes("all_reduce", 24, 3)
            + wire_bytes("broadcast", 16, 3, rank, 2)
            + wire_bytes("all_gather", 8, 3)
            + wire_bytes("all_to_all", 24, 3)
        )
        assert sent == expected


def test_abort_wakes_a_waiting_collective():
    groups = local_groups(2, timeout_s=5)
    t = torch.ones(4)
    h = groups[0].all_reduce(t, async_op=True)  # rank 1 never joins
    groups[0].abort("test abort")
    with pytest.raises(CollectiveError, match="test abort"):
        h.wait()
    with pytest.raises(CollectiveError):
        groups[0].all_reduce(torch.ones(1))


def test_wait_is_bounded_by_timeout():
    groups = local_groups(2, timeout_s=5)
    h = groups[0].all_reduce(torch.ones(4), async_op=True)
    with pytest.raises(CollectiveError, match="did not complete"):
        h.wait(timeout=0.3)
    assert groups[0].aborted


def test_send_recv_point_to_point():
    # Gloo's send/recv works have no future; the handle must still complete and count bytes.
    groups = local_groups(3, timeout_s=10)

    def body(g):
        if g.rank == 0:
            g.send(torch.arange(10, dtype=torch.uint8), dst=2, tag=7)
            return g.stats.bytes_sent
        if g.rank == 2:
            buf = torch.empty(10, dtype=torch.uint8)
            g.recv(buf, src=0, tag=7)
            return buf.tolist()
        return None

    sent, _, got = run_parallel(groups, body)
    assert sent == 10
    assert got == list(range(10))


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_exchange_is_all_to_all_bit_for_bit_with_one_way_connections(world):
    """Group.exchange moves each slice where all_to_all does (several in flight at once, as the
    quantized all-reduce's pipeline issues them), sends the same bytes, and builds the reverse
    connection set it needs on first use."""
    from isthmus.comm.group import forward

    groups = local_groups(world, timeout_s=20)

    def body(g):
        x = torch.randint(0, 256, (world * 1000,), dtype=torch.uint8)
        x[:world] = g.rank  # distinct per rank
        ref = g.all_to_all(x.clone())
        after_ref = g.stats.bytes_sent
        handles = [g.exchange(x.roll(i), async_op=True) for i in range(3)]
        outs = [h.wait() for h in handles]
        same_bytes = g.stats.bytes_sent - after_ref == 3 * after_ref
        refs = [ref] + [g.all_to_all(x.roll(i)) for i in (1, 2)]
        return (
            all(torch.equal(o, r) for o, r in zip(outs, refs, strict=True)),
            same_bytes,
            g._reverse is not None,
        )

    assert run_parallel(groups, body) == [(True, True, True)] * world
    for a in range(world):
        assert forward(a, (a + 1) % world, world) or world == 2  # a ring's direction is forward
        for b in range(world):
            if a != b:  # every pair's connection in each set carries data one way only
                assert forward(a, b, world) != forward(b, a, world)


def test_exchange_without_a_reverse_set_is_all_to_all_and_an_aborted_group_refuses_it():
    from isthmus.comm.group import Group

    groups = local_groups(2, timeout_s=10)
    plain = [
        Group(g.pg, g.rank, g.world, timeout_s=10, name=f"plain{g.rank}") for g in groups
    ]  # built without connect_reverse: exchange falls back to Gloo's all_to_all

    def body(g):
        return g.exchange(torch.arange(6, dtype=torch.float32) + 10 * g.rank).tolist()

    assert run_parallel(plain, body) == [
        [0.0, 1.0, 2.0, 10.0, 11.0, 12.0],
        [3.0, 4.0, 5.0, 13.0, 14.0, 15.0],
    ]
    assert all(g._reverse is None for g in plain)
    groups[0].abort("test abort")
    with pytest.raises(CollectiveError, match="test abort"):
        groups[0].exchange(torch.ones(4))


def test_exchange_with_a_silent_peer_fails_within_the_timeout():
    groups = local_groups(3, timeout_s=3)
    # rank 0 exchanges; ranks 1 and 2 never do (the reverse set cannot even be built)
    with pytest.raises(CollectiveError):
        groups[0].exchange(torch.ones(6))
    assert groups[0].aborted


def test_a_resync_of_mixed_dtypes_lands_on_aligned_storage() -> None:
    """A float32 tensor of odd length followed by int64 ones (a sampler's position after the
    model): the int64 values start at an offset not divisible by 8 in the packed bytes."""
    from isthmus.comm.state import SharedState, tensor_hash
    from isthmus.comm.transfer import apply_transfers
    from isthmus.coordinator.protocol import RoundPlan, Transfer
    from isthmus.testing import local_groups, run_parallel

    groups = local_groups(2)
    states = []
    for rank in range(2):
        st = SharedState()
        st.register("w", torch.arange(5, dtype=torch.float32) * (rank + 1))
        st.register("pos", torch.tensor([7, 9], dtype=torch.int64) * (rank + 1))
        st.register("half", torch.ones(3, dtype=torch.bfloat16) * (rank + 1))
        states.append(st)
    names = ("w", "pos", "half")
    expected = {n: tensor_hash(states[0][n]) for n in names}
    plan = RoundPlan(0, 1, (0, 1), (Transfer(0, 1, names),), expected, True)
    run_parallel(groups, lambda g: apply_transfers(g, plan, states[g.rank], g.rank))
    for n in names:
        assert torch.equal(states[1][n], states[0][n]), n
