"""The progress rule: a transfer is stuck when its bytes stop moving, never because it is long.
Samples are written by hand in the shapes the kernel's counters took in the lab (a shaped link,
a silently dropped path, a stopped remote); one process, no sockets."""

from __future__ import annotations

from typing import Any

import pytest

from isthmus.comm.progress import ConnSample, ProgressConfig, ProgressWatch, State
from isthmus.comm.tcpstats import TcpInfo, conn_sample, parse_tcp_info

CFG = ProgressConfig(stall_s=10.0, late_s=60.0)


def conn(
    acked: int, received: int = 0, *, key: int = 1, remote: str = "10.0.0.4:41234", **kw: Any
) -> ConnSample:
    return ConnSample(key=key, remote=remote, acked=acked, received=received, **kw)


def test_a_slow_transfer_that_keeps_moving_is_never_stuck() -> None:
    w = ProgressWatch(CFG, started=0.0)
    # an hour at a trickle: a few bytes every 9 s, data always in flight
    for i in range(400):
        w.sample(i * 9.0, [conn(i * 1000, i * 1000, in_flight=True)])
        v = w.verdict()
        assert v.state is State.PROGRESSING and not v.stuck
    assert w.verdict().for_s < CFG.stall_s


def test_data_in_flight_without_acknowledgement_is_silent_after_stall_s() -> None:
    w = ProgressWatch(CFG, started=0.0)
    w.sample(0.0, [conn(0, in_flight=True)])
    w.sample(1.0, [conn(5_000_000, 5_000_000, in_flight=True)])
    for t in (2.0, 5.0, 10.5):  # the cut: counters frozen, segments in flight
        w.sample(t, [conn(5_000_000, 5_000_000, in_flight=True)])
        assert not w.verdict().stuck
    w.sample(11.0, [conn(5_000_000, 5_000_000, in_flight=True)])
    v = w.verdict()
    assert v.state is State.SILENT and v.stuck
    assert v.remote == "10.0.0.4:41234"
    assert v.for_s == pytest.approx(10.0)
    assert "no acknowledgement from 10.0.0.4:41234 for 10.0s" in v.why


def test_one_dead_connection_is_caught_while_another_still_moves() -> None:
    w = ProgressWatch(CFG, started=0.0)
    for t in range(0, 13):
        w.sample(
            float(t),
            [
                conn(1000, key=1, remote="10.0.0.3:1", in_flight=True),  # dead since t=0
                conn(t * 10**6, key=2, remote="10.0.0.5:2", in_flight=True),
            ],
        )
    v = w.verdict()
    assert v.state is State.SILENT and v.remote == "10.0.0.3:1" and v.for_s == 12.0


def test_a_remote_that_stops_reading_is_not_a_link_failure_and_waits_late_s() -> None:
    w = ProgressWatch(CFG, started=0.0)
    w.sample(0.0, [conn(0, in_flight=True)])
    w.sample(2.0, [conn(10_000_000, 10_000_000, in_flight=True)])
    # SIGSTOP: everything sent is acknowledged, the rest is queued behind a closed window
    for t in range(3, 62):
        w.sample(float(t), [conn(10_000_000, 10_000_000, queued=True)])
        v = w.verdict()
        if t - 2 < CFG.stall_s:
            assert v.state is State.PROGRESSING
        else:
            assert v.state is State.NOT_READING and v.remote == "10.0.0.4:41234"
            assert v.stuck is (t - 2 >= CFG.late_s)
    assert "has taken no data" in w.verdict().why
    # it resumes: progress again, and the clock starts over
    w.sample(63.0, [conn(12_000_000, 12_000_000, in_flight=True)])
    assert w.verdict().state is State.PROGRESSING


def test_queued_data_whose_probes_go_unanswered_is_silent_a_stopped_reader_is_not() -> None:
    # the same counters with the kernel's probe streak: a stopped reader's kernel answers each
    # window probe (the streak stays at 0 or 1); a sender whose own firewall drops what it
    # sends (or whose path died behind a closed window) holds its data queued, nothing in
    # flight, and its probes keep going unanswered
    for probes, silent in ((1, False), (3, True)):
        w = ProgressWatch(CFG, started=0.0)
        w.sample(0.0, [conn(10_000_000, 10_000_000, in_flight=True)])
        for t in range(1, 13):
            streak = min(probes, t)
            w.sample(float(t), [conn(10_000_000, 10_000_000, queued=True, probes=streak)])
        v = w.verdict()
        if silent:
            assert v.state is State.SILENT and v.stuck and v.for_s == 11.0, v
            assert "no acknowledgement from 10.0.0.4:41234 for 11.0s with data queued" in v.why
            assert w.silent() == [("10.0.0.4:41234", 11.0)]
        else:
            assert v.state is State.NOT_READING and not v.stuck, v
            assert w.silent() == []


def test_waiting_for_others_is_idle_and_bounded_by_late_s() -> None:
    w = ProgressWatch(CFG, started=100.0)
    w.sample(100.0, [conn(500, 500)])
    w.sample(120.0, [conn(500, 500)])
    v = w.verdict()
    assert v.state is State.IDLE and not v.stuck and v.for_s == 20.0
    assert w.verdict(now=160.0).stuck
    assert "waiting for another member" in w.verdict(now=160.0).why


def test_nothing_to_watch_is_idle_and_only_stuck_after_late_s() -> None:
    w = ProgressWatch(CFG, started=0.0)
    assert w.verdict(now=5.0).state is State.PROGRESSING
    v = w.verdict(now=30.0)
    assert v.state is State.IDLE and not v.stuck
    assert w.verdict(now=60.0).stuck


def test_min_bytes_ignores_a_trickle_below_it() -> None:
    w = ProgressWatch(ProgressConfig(stall_s=10.0, late_s=60.0, min_bytes=1000), started=0.0)
    for t in range(12):
        w.sample(float(t), [conn(t * 10, in_flight=True)])  # 10 B/s: retransmitted probes
    assert w.verdict().state is State.SILENT
    w.sample(12.0, [conn(10_000, in_flight=True)])
    assert w.verdict().state is State.PROGRESSING


def test_a_connection_that_disappears_or_restarts_is_forgotten() -> None:
    w = ProgressWatch(CFG, started=0.0)
    w.sample(0.0, [conn(100, key=1, in_flight=True), conn(100, key=2, in_flight=True)])
    w.sample(11.0, [conn(100, key=2, in_flight=True)])  # key 1 closed: no verdict on it
    assert w.verdict().remote == "10.0.0.4:41234"
    w.sample(12.0, [conn(5, key=2, in_flight=True)])  # counters went back: a new connection
    assert w.verdict().state is State.PROGRESSING
    w.sample(3.0, [conn(0, key=2, in_flight=True)])  # older than the last sample: ignored
    assert w.at == 12.0


def test_the_same_samples_give_the_same_verdict() -> None:
    samples = [
        (float(t), [conn(min(t, 4) * 100, key=k, in_flight=True) for k in (3, 1, 2)])
        for t in range(20)
    ]
    a, b = ProgressWatch(CFG), ProgressWatch(CFG)
    for t, s in samples:
        a.sample(t, s)
        b.sample(t, list(reversed(s)))
    assert a.verdict() == b.verdict()


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"stall_s": 0.0}, "stall_s"),
        ({"late_s": float("inf")}, "late_s"),
        ({"stall_s": 20.0, "late_s": 10.0}, "late_s"),
        ({"min_bytes": 0}, "min_bytes"),
        ({"min_bytes": 1.5}, "min_bytes"),
    ],
)
def test_config_errors_name_the_field(kw: dict[str, float], msg: str) -> None:
    with pytest.raises(ValueError, match=f"ProgressConfig.{msg}"):
        ProgressConfig(**kw)  # type: ignore[arg-type]


def _tcp_info(**fields: int) -> bytes:
    """A struct tcp_info as the kernel lays it out, with the fields given set."""
    import struct

    buf = bytearray(232)
    struct.pack_into(
        "=BBBBB",
        buf,
        0,
        fields.get("state", 1),
        0,
        fields.get("retransmits", 0),
        0,
        fields.get("backoff", 0),
    )
    for off, name in (
        (8, "rto"),
        (24, "unacked"),
        (52, "last_data"),
        (56, "last_ack"),
        (68, "rtt"),
        (100, "total_retrans"),
        (144, "notsent"),
        (152, "data_segs_in"),
        (228, "snd_wnd"),
    ):
        struct.pack_into("=I", buf, off, fields.get(name, 0))
    struct.pack_into("=QQ", buf, 120, fields.get("acked", 0), fields.get("received", 0))
    return bytes(buf)


def test_parse_tcp_info_reads_the_fields_at_the_kernels_offsets() -> None:
    raw = _tcp_info(
        acked=16779616,
        received=16805320,
        unacked=40,
        retransmits=5,
        backoff=5,
        last_ack=13044,
        notsent=990800,
        snd_wnd=413696,
        rtt=1234,
        rto=7_204_000,
        data_segs_in=3911,
    )
    info = parse_tcp_info(raw)
    assert info == TcpInfo(
        established=True,
        bytes_acked=16779616,
        bytes_received=16805320,
        unacked=40,
        notsent=990800,
        last_ack_ms=13044,
        last_data_ms=0,
        retransmits=5,
        backoff=5,
        total_retrans=0,
        rtt_us=1234,
        snd_wnd=413696,
        rto_us=7_204_000,
        data_segs_in=3911,
    )
    assert parse_tcp_info(raw[:200]) is not None and parse_tcp_info(raw[:200]).snd_wnd is None  # type: ignore[union-attr]
    assert parse_tcp_info(raw[:150]).data_segs_in is None  # type: ignore[union-attr]
    assert parse_tcp_info(raw[:100]) is None  # a kernel without byte counters


def test_conn_sample_maps_the_kernel_states() -> None:
    flight = parse_tcp_info(_tcp_info(acked=1, unacked=3, snd_wnd=1000))
    closed_window = parse_tcp_info(_tcp_info(acked=1, notsent=770368, snd_wnd=0))
    assert flight is not None and closed_window is not None
    s = conn_sample(7, "a:1", flight)
    assert (s.in_flight, s.queued, s.acked) == (True, False, 1)
    s = conn_sample(7, "a:1", closed_window)
    assert (s.in_flight, s.queued) == (False, True)
    receiving = parse_tcp_info(_tcp_info(received=9, data_segs_in=12, rto=7_204_000))
    assert receiving is not None
    s = conn_sample(7, "a:1", receiving)
    assert (s.segs_in, s.rto_s) == (12, 7.204)


def test_a_connection_idle_between_collectives_is_not_silent_when_it_sends_again() -> None:
    w = ProgressWatch(CFG, started=0.0)
    w.sample(0.0, [conn(1000)])
    w.sample(100.0, [conn(1000)])  # a hundred seconds between rounds: nothing in flight
    w.sample(100.3, [conn(1000, in_flight=True)])  # the next collective's first bytes
    v = w.verdict(since=100.0)
    assert v.state is not State.SILENT and not v.stuck
    w.sample(110.2, [conn(1000, in_flight=True)])
    assert not w.verdict(since=100.0).stuck  # 9.9 s since the data was first seen in flight
    w.sample(110.3, [conn(1000, in_flight=True)])
    v = w.verdict(since=100.0)
    assert v.state is State.SILENT and v.for_s == pytest.approx(10.0)


def test_bytes_arriving_do_not_hide_bytes_that_are_never_acknowledged() -> None:
    w = ProgressWatch(CFG, started=0.0)
    for t in range(12):  # one direction dead: what we send is never acknowledged
        w.sample(float(t), [conn(1000, 1000 + t * 10**6, in_flight=True)])
    v = w.verdict()
    assert v.state is State.SILENT and v.for_s == 11.0


def test_silent_lists_every_connection_whose_data_goes_unacknowledged_longest_first() -> None:
    # what a member whose collective completed tells the coordinator (Group.silent_members):
    # the same rule as a silent verdict, for every connection, with or without a wait
    w = ProgressWatch(CFG, started=0.0)

    def at(t: int) -> list[ConnSample]:
        return [
            ConnSample(1, "rank 1 at a:1", 1000, 0, in_flight=True, retransmits=t // 2),
            ConnSample(
                2,
                "rank 2 at b:1",
                5000 if t < 2 else 6000,
                0,
                in_flight=True,
                retransmits=max(0, t - 2),
            ),
            ConnSample(3, "rank 3 at c:1", 1000 * t, 0, in_flight=True, retransmits=0),
            # a live path behind a deep queue: one retransmission timeout, then the ack
            ConnSample(4, "rank 4 at d:1", 700, 0, in_flight=True, retransmits=1),
        ]

    for t in range(11):
        w.sample(float(t), at(t))
        assert w.silent() == [] or t == 10, (t, w.silent())
    assert w.silent() == [("rank 1 at a:1", 10.0)]
    w.sample(12.0, at(12))
    assert w.silent() == [("rank 1 at a:1", 12.0), ("rank 2 at b:1", 10.0)]
    assert w.verdict().remote == "rank 1 at a:1"  # the verdict names the longest of them
    w.sample(13.0, [*at(12)[1:], ConnSample(1, "rank 1 at a:1", 2000, 0)])  # acknowledged
    assert [r for r, _ in w.silent()] == ["rank 2 at b:1"]


def test_the_bounds_of_a_transfer_count_from_when_it_began() -> None:
    w = ProgressWatch(CFG, started=0.0)
    w.sample(0.0, [conn(500, 500, queued=True)])
    w.sample(200.0, [conn(500, 500, queued=True)])
    assert w.verdict().stuck  # watched since 0: nothing moved for 200 s
    v = w.verdict(since=195.0)  # a transfer issued at 195 s
    assert v.state is State.PROGRESSING and not v.stuck
    v = w.verdict(now=235.0, since=195.0)
    assert v.state is State.NOT_READING and v.for_s == 40.0 and not v.stuck
    assert w.verdict(now=795.0, since=195.0).stuck


# -- moved_within: what a heartbeat's "moving" is made of (Group.moving) ------------------------


def test_segments_arriving_behind_a_lost_one_count_as_the_remote_sending() -> None:
    # the tail of a sync at 90 kbit/s: this member has sent everything (nothing in flight) and
    # waits for the partner's last bytes; one segment was lost, so the later ones arrive out of
    # order for seconds (the queue in front of the retransmission) and "received" stands still
    w = ProgressWatch(CFG, started=0.0)
    segs = 100
    for i in range(41):  # 10 s at 0.25 s
        w.sample(i * 0.25, [conn(5000, 8000, segs_in=segs)])
        segs += 1
    assert w.moved_within(2.0)
    assert w.verdict().state is State.PROGRESSING
    # the partner stops sending (it stopped, or it is done): nothing arrives any more
    for i in range(41, 50):
        w.sample(i * 0.25, [conn(5000, 8000, segs_in=segs)])
    assert not w.moved_within(2.0, now=12.5)
    # without the segment count the same wait looked like a stopped partner at once
    w = ProgressWatch(CFG, started=0.0)
    for i in range(41):
        w.sample(i * 0.25, [conn(5000, 8000)])
    assert not w.moved_within(2.0)


def test_a_stopped_remote_sends_no_segment_and_stops_counting_as_moving() -> None:
    # its kernel acknowledges into the receive buffer until the window closes, then nothing
    w = ProgressWatch(CFG, started=0.0)
    for i in range(10):
        w.sample(float(i), [conn(1000 * min(i, 3), 0, queued=i >= 3, segs_in=0, rto_s=0.2)])
        assert w.moved_within(2.0) == (i < 5)  # the last advance at 3 s; no segment arrives


def test_the_window_grows_to_the_connections_retransmission_timeout_at_most_late_s() -> None:
    def watch(rto_s: float | None) -> ProgressWatch:
        w = ProgressWatch(CFG, started=0.0)
        w.sample(0.0, [conn(0, 0, rto_s=rto_s)])
        w.sample(1.0, [conn(1000, 0, rto_s=rto_s)])  # the last movement
        return w

    short, deep, absurd = watch(0.2), watch(19.0), watch(900.0)
    assert not short.moved_within(2.0, now=3.5)  # a fast path: 2 s without a byte says stop
    # 90 kbit/s behind a 7 s queue, in loss recovery: the sender's timer is at 19 s
    assert deep.moved_within(2.0, now=19.5)
    assert not deep.moved_within(2.0, now=20.5)
    assert absurd.moved_within(2.0, now=60.5)
    assert not absurd.moved_within(2.0, now=61.5)  # capped at late_s (60 s here)
    assert not watch(None).moved_within(2.0, now=3.5)  # a source that does not say


def test_a_segment_count_that_goes_back_is_a_new_connection() -> None:
    w = ProgressWatch(CFG, started=0.0)
    w.sample(0.0, [conn(10, 10, segs_in=500)])
    w.sample(5.0, [conn(10, 10, segs_in=500)])
    assert not w.moved_within(2.0)
    w.sample(6.0, [conn(10, 10, segs_in=3)])  # the key names another socket now
    assert w.moved_within(2.0)
