"""Handle.wait's decision with a fake progress watch on a fake clock: a transfer that keeps moving
is waited for however long it takes, a connection that goes silent fails it after ``stall_s``
naming the remote, a transfer where nothing moves fails after ``late_s`` naming nobody, and one
that nothing watches has a bound that grows with its bytes."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from isthmus.comm import group as group_mod
from isthmus.comm import handle as handle_mod
from isthmus.comm.group import CollectiveError, Group, Handle, backstop_s, transfer_info
from isthmus.comm.progress import ConnSample, ProgressConfig, ProgressWatch, Verdict
from isthmus.comm.wires import Wires

REMOTE = "rank 1 at 10.0.0.2:41234"
OLD_COLLECTIVE_TIMEOUT = 60.0  # SessionConfig's collective_timeout, which bounded every wait


class FakeWork:
    """A torch work whose future completes when the test says so."""

    def __init__(self) -> None:
        self.future: torch.futures.Future[None] = torch.futures.Future()

    def get_future(self) -> torch.futures.Future[None]:
        return self.future

    def wait(self) -> None:
        self.future.wait()


class FakeWatch:
    """A real :class:`ProgressWatch` on a fake clock that starts now and advances ``step``
    seconds per sample; ``conns(elapsed)`` gives the connections' counters at each instant."""

    def __init__(
        self, conns: Callable[[float], list[ConnSample]], config: ProgressConfig, step: float
    ) -> None:
        self.t0 = self.now = time.monotonic()
        self.conns, self.step = conns, step
        self.watch = ProgressWatch(config, started=self.t0)
        self.on_sample: Callable[[float], None] = lambda elapsed: None

    @property
    def elapsed(self) -> float:
        return self.now - self.t0

    def sample(self) -> None:
        self.now += self.step
        self.watch.sample(self.now, self.conns(self.elapsed))
        self.on_sample(self.elapsed)

    def verdict(self, *, since: float | None = None) -> Verdict:
        return self.watch.verdict(self.now, since=since)

    def in_flight(self) -> bool:
        return self.watch.in_flight()

    def moved_within(self, floor_s: float) -> bool:
        return self.watch.moved_within(floor_s, self.now)

    def silent(self) -> list[tuple[str, float]]:
        return self.watch.silent(self.now)


@pytest.fixture(autouse=True)
def _sample_every_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    # every poll of the wait samples, and polls come every millisecond: the fake clock runs fast
    monkeypatch.setattr(group_mod, "SAMPLE_PERIOD_S", 0.0)
    monkeypatch.setattr(handle_mod, "POLL_S", 0.001)


def _group(watch: FakeWatch | None, *, stall_s: float = 10.0, late_s: float = 600.0) -> Group:
    return Group(object(), 0, 2, timeout_s=30.0, stall_s=stall_s, late_s=late_s, watch=watch)


def test_a_transfer_that_keeps_moving_outlives_the_old_fixed_timeout() -> None:
    # 1 Mbit/s each way: 125 kB per second acknowledged and received, for 300 s
    def conns(t: float) -> list[ConnSample]:
        n = int(t * 125_000)
        return [ConnSample("c", REMOTE, acked=n, received=n, in_flight=True)]

    watch = FakeWatch(conns, ProgressConfig(stall_s=10.0, late_s=600.0), step=5.0)
    g = _group(watch)
    work = FakeWork()

    def finish_at_300s(elapsed: float) -> None:
        if elapsed >= 300.0 and not work.future.done():
            work.future.set_result(None)

    watch.on_sample = finish_at_300s
    t = torch.ones(4)
    h = Handle(g, work, t, "all_reduce", nbytes=40_000_000)
    assert h.wait() is t
    assert watch.elapsed >= 300.0 > 4 * OLD_COLLECTIVE_TIMEOUT
    assert not g.aborted


def test_a_silent_connection_fails_after_stall_s_naming_the_remote() -> None:
    # moving until 20 s, then data in flight that is never acknowledged (a cut path); a second
    # connection keeps receiving, which must not hide the silent one
    def conns(t: float) -> list[ConnSample]:
        n = int(min(t, 20.0) * 125_000)
        live = int(t * 125_000)
        return [
            ConnSample("dead", REMOTE, acked=n, received=n, in_flight=True),
            ConnSample("live", "rank 2 at 10.0.0.3:41000", acked=0, received=live),
        ]

    watch = FakeWatch(conns, ProgressConfig(stall_s=10.0, late_s=600.0), step=1.0)
    g = _group(watch)
    h = Handle(g, FakeWork(), torch.ones(4), "all_reduce", nbytes=40_000_000)
    with pytest.raises(CollectiveError) as err:
        h.wait()
    assert err.value.unreached == (REMOTE,)
    assert REMOTE in str(err.value)
    # the last acknowledgement came at 20 s: stuck stall_s later, within one more sample
    assert 30.0 <= watch.elapsed <= 32.0
    assert g.aborted and REMOTE in g.abort_reason


def test_nothing_moving_at_all_fails_after_late_s_naming_nobody() -> None:
    def conns(t: float) -> list[ConnSample]:
        return [ConnSample("c", REMOTE, acked=1000, received=1000)]

    watch = FakeWatch(conns, ProgressConfig(stall_s=10.0, late_s=600.0), step=20.0)
    g = _group(watch)
    h = Handle(g, FakeWork(), torch.ones(4), "all_reduce")
    with pytest.raises(CollectiveError, match="no byte moved") as err:
        h.wait()
    assert err.value.unreached == ()
    # one sample (20 s) of slack: the fake clock's sums round (620 s may read 619.99...)
    assert 600.0 <= watch.elapsed <= 640.0


def test_a_remote_that_stops_reading_is_not_reported_as_unreached() -> None:
    # data queued behind a closed window, nothing in flight: its process is stopped or busy
    # (heartbeats evict a stopped one); past late_s the wait ends, blaming no link
    def conns(t: float) -> list[ConnSample]:
        return [ConnSample("c", REMOTE, acked=5000, received=0, queued=True)]

    watch = FakeWatch(conns, ProgressConfig(stall_s=10.0, late_s=60.0), step=5.0)
    g = _group(watch, late_s=60.0)
    h = Handle(g, FakeWork(), torch.ones(4), "all_reduce")
    with pytest.raises(CollectiveError, match="taken no data") as err:
        h.wait()
    assert err.value.unreached == ()
    assert watch.elapsed >= 60.0


def test_an_unwatched_transfer_is_bounded_by_late_s_plus_its_bytes() -> None:
    assert backstop_s(600.0, 0) == 600.0
    # 40 GB at the slowest supported rate (1 Mbit/s): the bound grows with the transfer
    assert backstop_s(600.0, 40 * 10**9) == 600.0 + 320_000.0
    # a group whose abort shuts its connections down (wires) gives Gloo that long backstop
    watch = FakeWatch(lambda t: [], ProgressConfig(), step=1.0)
    g = Group(object(), 0, 2, timeout_s=30.0, wires=Wires("t"), watch=watch)
    assert g.op_bound_s(40 * 10**9) == backstop_s(600.0, 40 * 10**9)


def test_a_group_without_wires_keeps_the_fixed_bound() -> None:
    # nothing can end what Gloo still runs on such a group (in-process test groups), and a
    # process group dropped with a collective in flight blocks the dropping thread until that
    # collective's Gloo timeout: a long backstop there would hang whoever drops it
    g = Group(object(), 0, 2, timeout_s=0.2, stall_s=0.05, late_s=600.0)
    assert g.op_bound_s(40 * 10**9) == 0.2
    h = Handle(g, FakeWork(), torch.ones(4), "all_reduce", nbytes=40 * 10**9)
    with pytest.raises(CollectiveError, match="nothing watches") as err:
        h.wait()
    assert err.value.unreached == ()


def test_an_abort_still_ends_a_progressing_wait() -> None:
    def conns(t: float) -> list[ConnSample]:
        n = int(t * 1000)
        return [ConnSample("c", REMOTE, acked=n, received=n, in_flight=True)]

    watch = FakeWatch(conns, ProgressConfig(), step=1.0)
    g = _group(watch)
    watch.on_sample = lambda elapsed: (
        g.abort("round 3 aborted: peer 2 evicted") if elapsed > 5 else None
    )
    h = Handle(g, FakeWork(), torch.ones(4), "all_reduce")
    with pytest.raises(CollectiveError, match="peer 2 evicted") as err:
        h.wait()
    assert err.value.unreached == ()


def test_collective_error_keeps_unreached_as_a_tuple_of_names() -> None:
    e = CollectiveError("x", unreached=[REMOTE])
    assert e.unreached == (REMOTE,) and isinstance(e, RuntimeError)
    assert CollectiveError("y").unreached == ()


def test_a_live_path_behind_a_deep_queue_is_not_silent_a_dead_one_is() -> None:
    # a slow link with a deep queue: 15 s without an acknowledgement, one retransmission
    # timeout, then the acknowledgements come again; a dead path keeps timing out
    def live(t: float) -> list[ConnSample]:
        n = 1000 if t < 30.0 else int(t * 100)
        r = 1 if 18.0 <= t < 30.0 else 0
        return [ConnSample("c", REMOTE, acked=n, received=n, in_flight=True, retransmits=r)]

    watch = FakeWatch(live, ProgressConfig(stall_s=10.0, late_s=600.0), step=1.0)
    g = _group(watch)
    work = FakeWork()
    watch.on_sample = lambda e: (
        work.future.set_result(None) if e >= 40 and not work.future.done() else None
    )
    Handle(g, work, torch.ones(4), "all_reduce").wait()
    assert not g.aborted

    def dead(t: float) -> list[ConnSample]:
        r = 0 if t < 15.0 else 1 if t < 25.0 else 3
        return [ConnSample("c", REMOTE, acked=1000, received=1000, in_flight=True, retransmits=r)]

    watch = FakeWatch(dead, ProgressConfig(stall_s=10.0, late_s=600.0), step=1.0)
    g = _group(watch)
    with pytest.raises(CollectiveError) as err:
        Handle(g, FakeWork(), torch.ones(4), "all_reduce").wait()
    assert err.value.unreached == (REMOTE,)
    assert 25.0 <= watch.elapsed <= 27.0  # silent once the third timeout in a row came


def test_moving_is_what_a_heartbeat_says_of_the_transfer() -> None:
    # Group.moving: bytes within MOVING_WINDOW_S, or data in flight on a path that is not
    # silent (loss recovery behind a slow link's queue); not when nothing moves and nothing
    # is in flight (a stopped partner: its kernel acknowledged what it was sent)
    state: dict[str, object] = {"n": 0, "flight": False}

    def conns(t: float) -> list[ConnSample]:
        n = int(state["n"])  # type: ignore[call-overload]
        return [ConnSample("c", REMOTE, acked=n, received=n, in_flight=bool(state["flight"]))]

    watch = FakeWatch(conns, ProgressConfig(stall_s=10.0, late_s=600.0), step=1.0)
    g = _group(watch)
    assert not g.moving()  # nothing in flight on the group
    h = Handle(g, FakeWork(), torch.ones(4), "all_reduce")
    state["n"] = 1000
    assert g.moving()  # bytes moved just now
    for _ in range(3):
        watch.sample()
    assert not g.moving()  # 4 s without a byte, nothing in flight
    state["flight"] = True
    assert g.moving()  # data awaits its acknowledgement: a live path in loss recovery
    h._work.future.set_result(None)  # type: ignore[union-attr]
    assert not g.moving()  # the operation ended


def test_a_member_that_only_receives_is_moving_while_segments_arrive() -> None:
    # the tail of a long sync on a thin link: this member sent everything (nothing in flight)
    # and waits for its partner's last bytes behind a lost segment; the later segments arrive
    # out of order, "received" stands still. It vouches for the partner until they stop.
    state = {"segs": 0}

    def conns(t: float) -> list[ConnSample]:
        return [ConnSample("c", REMOTE, acked=900, received=500, segs_in=state["segs"])]

    watch = FakeWatch(conns, ProgressConfig(stall_s=10.0, late_s=600.0), step=1.0)
    g = _group(watch)
    h = Handle(g, FakeWork(), torch.ones(4), "all_reduce")
    for _ in range(8):
        state["segs"] += 3
        assert g.moving()
    for _ in range(2):
        watch.sample()
    assert not g.moving()  # nothing arrived for 3 s: the partner sends nothing any more
    h._work.future.set_result(None)  # type: ignore[union-attr]


def test_a_member_whose_collective_completed_names_the_member_its_data_does_not_reach() -> None:
    # the collective completed once its last data was in the kernel; the link to rank 1 is
    # cut, so that data stays in flight, retransmitted, never acknowledged: the heartbeat
    # names rank 1 once the stall rule holds, and stops as soon as the data is acknowledged
    state = {"acked": 0, "flight": False, "rtx": 0}

    def conns(t: float) -> list[ConnSample]:
        return [
            ConnSample(
                "c",
                REMOTE,
                acked=state["acked"],
                received=0,
                in_flight=bool(state["flight"]),
                retransmits=state["rtx"],
            )
        ]

    watch = FakeWatch(conns, ProgressConfig(stall_s=10.0, late_s=600.0), step=1.0)
    g = Group(object(), 0, 2, timeout_s=30.0, watch=watch, epoch=4)
    assert transfer_info(None, g) is None and watch.elapsed == 0.0  # nothing issued: no sample
    h = Handle(g, FakeWork(), torch.ones(4), "all_reduce")
    state.update(acked=1000, flight=True)  # the last data handed to the kernel
    h._work.future.set_result(None)  # type: ignore[union-attr]
    state["rtx"] = 6
    infos = [transfer_info(None, g) for _ in range(12)]  # one heartbeat a second
    assert infos[:9] == [None] * 9, infos  # within stall_s: nothing said
    assert infos[-1] == {"silent": [{"epoch": 4, "rank": 1, "for_s": 11.0}]}, infos
    # inside a round (before this member reported) it rides along with "moving"
    plan = type("Plan", (), {"epoch": 4, "round": 9})()
    info = transfer_info(plan, g)
    assert info is not None and info["silent"][0]["rank"] == 1 and info["round"] == 9
    state.update(acked=2000, flight=False, rtx=0)  # the link healed: acknowledged
    assert transfer_info(None, g) is None
    sampled = watch.elapsed
    assert transfer_info(None, g) is None and watch.elapsed == sampled  # settled: no sampling
    g.abort("the round aborted")
    state.update(acked=2000, flight=True, rtx=9)
    Handle(g, FakeWork(), torch.ones(4), "all_reduce")
    assert all(transfer_info(None, g) is None for _ in range(15))  # an aborted group says none
