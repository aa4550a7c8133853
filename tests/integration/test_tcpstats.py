"""The kernel's counters of real TCP connections, read by inode, and the progress rule over them:
counters move while bytes flow, a remote that stops reading shows as queued data behind a closed
window, and (root) a silently dropped path shows as data in flight that nobody acknowledges, for
a plain connection and for a Gloo all-reduce watched by :class:`TcpWatch` (seen long before
Gloo's own timeout)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from isthmus.comm.progress import ProgressConfig, ProgressWatch, State
from isthmus.comm.tcpstats import TcpInfo, TcpWatch, conn_sample, read_fd, read_inodes

SCRIPT = Path(__file__).parent / "scripts" / "stall_peer.py"
SRC = Path(__file__).resolve().parents[2] / "src"


def _pair() -> tuple[socket.socket, socket.socket, socket.socket]:
    srv = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(srv.getsockname(), timeout=10)
    server, _ = srv.accept()
    return srv, client, server


def _inode(s: socket.socket) -> int:
    return os.fstat(s.fileno()).st_ino


def _until(what: str, check: Callable[[], TcpInfo | None], limit_s: float = 20.0) -> TcpInfo:
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        got = check()
        if got is not None:
            return got
        time.sleep(0.02)
    pytest.fail(f"never saw {what} within {limit_s}s")


def test_counters_move_while_bytes_flow() -> None:
    srv, client, server = _pair()
    n = 4 << 20
    with srv, client, server:
        ci, si = _inode(client), _inode(server)
        before = read_inodes({ci, si})
        assert set(before) == {ci, si}
        assert before[ci].established and before[si].established

        def drain() -> None:
            got = 0
            while got < n:
                got += len(server.recv(1 << 16))

        t = threading.Thread(target=drain, daemon=True)
        t.start()
        client.sendall(b"y" * n)
        t.join(20)
        sent = _until(
            "the sender's bytes acknowledged",
            lambda: i if (i := read_inodes({ci})[ci]).bytes_acked >= n else None,
        )
        got = read_inodes({si})[si]
        assert got.bytes_received >= n > before[si].bytes_received
        assert sent.bytes_acked > before[ci].bytes_acked
        w = ProgressWatch(ProgressConfig(stall_s=10.0, late_s=60.0), started=0.0)
        w.sample(0.0, [conn_sample(ci, "server", before[ci])])
        w.sample(9.0, [conn_sample(ci, "server", sent)])
        assert w.verdict(now=18.0).state is State.PROGRESSING


def test_a_remote_that_stops_reading_shows_queued_data_behind_a_closed_window() -> None:
    srv, client, server = _pair()
    with srv, client, server:
        ci = _inode(client)
        client.setblocking(False)
        try:  # fill both kernels' buffers: the server never reads
            while True:
                client.send(b"z" * (1 << 16))
        except BlockingIOError:
            pass

        def blocked() -> TcpInfo | None:
            info = read_inodes({ci})[ci]
            return info if info.unacked == 0 and (info.notsent > 0 or info.snd_wnd == 0) else None

        info = _until("the window close with data queued", blocked)
        s = conn_sample(ci, "127.0.0.1:server", info)
        assert s.queued and not s.in_flight
        w = ProgressWatch(ProgressConfig(stall_s=10.0, late_s=60.0), started=0.0)
        w.sample(0.0, [s])
        w.sample(11.0, [conn_sample(ci, "127.0.0.1:server", read_inodes({ci})[ci])])
        v = w.verdict()
        assert v.state is State.NOT_READING and not v.stuck
        assert v.remote == "127.0.0.1:server"


def test_what_is_not_an_open_tcp_socket_is_not_read() -> None:
    srv, client, server = _pair()
    ci = _inode(client)
    with srv, server:
        client.close()
        assert read_inodes({ci}) == {}
        assert read_inodes(set()) == {}
    r, w = os.pipe()
    try:
        assert read_fd(r) is None
    finally:
        os.close(r)
        os.close(w)
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with u:
        assert read_fd(u.fileno()) is None


def test_tcp_watch_follows_a_reader_that_stops_until_it_is_stuck() -> None:
    srv, client, server = _pair()
    with srv, client, server:
        ci = _inode(client)
        cfg = ProgressConfig(stall_s=0.5, late_s=1.0)
        with TcpWatch(lambda: {ci: "the server"}, cfg, period_s=0.05) as watch:
            client.setblocking(False)
            try:  # the server never reads: the window closes with data queued
                while True:
                    client.send(b"q" * (1 << 16))
            except BlockingIOError:
                pass
            end = time.monotonic() + 20
            v = watch.verdict()
            while not v.stuck and time.monotonic() < end:
                time.sleep(0.05)
                v = watch.verdict()
        assert v.state is State.NOT_READING and v.stuck, v
        assert v.remote == "the server"


def test_tcp_watch_survives_a_failing_view_of_its_sockets() -> None:
    calls = []

    def conns() -> dict[int, str]:
        calls.append(1)
        raise OSError("gone")

    with TcpWatch(conns, period_s=0.01) as watch:
        end = time.monotonic() + 10
        while len(calls) < 3 and time.monotonic() < end:
            time.sleep(0.01)
        assert watch.verdict().state is State.PROGRESSING
    assert len(calls) >= 3
    with pytest.raises(ValueError, match="period_s"):
        TcpWatch(dict, period_s=0)


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=20)


def _veth_pair(*ends: tuple[str, str, str], root_qdisc: list[str] | None = None) -> None:
    """Two new namespaces joined by a veth pair: each end is (namespace, device, address/prefix);
    both devices and both loopbacks up, and ``root_qdisc``, if given, the root qdisc of both
    devices. Raises ``CalledProcessError`` if a command fails."""
    (a, va, _), (b, vb, _) = ends
    _sh("ip", "netns", "add", a)
    _sh("ip", "netns", "add", b)
    _sh("ip", "link", "add", va, "netns", a, "type", "veth", "peer", "name", vb, "netns", b)
    for ns, dev, ip in ends:
        _sh("ip", "-n", ns, "addr", "add", ip, "dev", dev)
        _sh("ip", "-n", ns, "link", "set", dev, "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        if root_qdisc is not None:
            _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *root_qdisc)


def _drop_everything(ns: str, dev: str) -> None:
    """From now on ``dev`` in ``ns`` drops every packet it sends, silently: an htb root whose
    only class feeds a zero-length pfifo. ``dev`` must have no root qdisc."""
    _sh("tc", "-n", ns, *f"qdisc add dev {dev} root handle 1: htb default 10".split())
    _sh("tc", "-n", ns, *f"class add dev {dev} parent 1: classid 1:10 htb rate 1gbit".split())
    _sh("tc", "-n", ns, *f"qdisc add dev {dev} parent 1:10 handle 10: pfifo limit 0".split())


def _stop(procs: list[subprocess.Popen[str]], namespaces: tuple[str, ...]) -> None:
    """Kill what still runs of ``procs`` and delete ``namespaces`` (their veths go with them)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)
    for ns in namespaces:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


def _line(p: subprocess.Popen[str], start: str, limit_s: float) -> str:
    """The first line of ``p``'s output that begins with ``start`` (bounded by a reader
    thread, so that a child that prints nothing cannot hold the test)."""
    box: list[str] = []

    def read() -> None:
        assert p.stdout is not None
        for line in p.stdout:
            if line.startswith(start):
                box.append(line.strip())
                return

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(limit_s)
    if not box:
        pytest.fail(f"no {start!r} line within {limit_s}s")
    return box[0]


@pytest.mark.root
def test_a_silently_dropped_path_is_silent_and_names_the_remote(prefix: str) -> None:
    a, b = f"{prefix}-a", f"{prefix}-b"
    va, vb = f"{prefix}a", f"{prefix}b"
    procs: list[subprocess.Popen[str]] = []
    try:
        _veth_pair((a, va, "10.79.0.1/24"), (b, vb, "10.79.0.2/24"))
        env = {**os.environ, "PYTHONPATH": str(SRC)}

        def start(ns: str, *argv: str) -> subprocess.Popen[str]:
            cmd = ["ip", "netns", "exec", ns, sys.executable, str(SCRIPT), *argv]
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
            procs.append(p)
            return p

        recv = start(b, "recv", "10.79.0.2", "41234")
        _line(recv, "LISTENING", 60)
        send = start(a, "send", "10.79.0.2", "41234", "--stall", "2", "--give-up", "60")
        _line(send, "MOVING", 60)
        # the path from a to b now drops every packet, silently: htb with a zero-length queue
        _drop_everything(a, va)
        verdict = json.loads(_line(send, "VERDICT ", 90)[len("VERDICT ") :])
        assert verdict["stuck"] and verdict["remote"] == "10.79.0.2:41234", verdict
        if verdict["state"] == State.NOT_READING.value:
            # the receiver fell behind (a loaded machine starves it) and its window was full at
            # the cut: the sender then probes a zero window, which no packet answers, and reads
            # as a stopped reader; stuck and named all the same
            assert "has taken no data" in verdict["why"], verdict
        else:
            assert verdict["state"] == State.SILENT.value, verdict
            assert "no acknowledgement from 10.79.0.2:41234" in verdict["why"]
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


GLOO_SCRIPT = Path(__file__).parent / "scripts" / "gloo_stall_peer.py"


def _collect(p: subprocess.Popen[str], into: list[str]) -> threading.Thread:
    def read() -> None:
        assert p.stdout is not None
        for line in p.stdout:
            into.append(line.strip())

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t


@pytest.mark.root
def test_a_gloo_all_reduce_over_a_cut_link_is_seen_silent_before_gloo_gives_up(
    prefix: str,
) -> None:
    a, b = f"{prefix}-a", f"{prefix}-b"
    va, vb = f"{prefix}a", f"{prefix}b"
    procs: list[subprocess.Popen[str]] = []
    try:
        # slow enough that the all-reduce is still running when the link is cut
        tbf = ["tbf", "rate", "20mbit", "burst", "32kbit", "latency", "400ms"]
        _veth_pair((a, va, "10.79.1.1/24"), (b, vb, "10.79.1.2/24"), root_qdisc=tbf)
        env = {**os.environ, "PYTHONPATH": str(SRC)}
        for rank, ns, ip in ((0, a, "10.79.1.1"), (1, b, "10.79.1.2")):
            cmd = ["ip", "netns", "exec", ns, sys.executable, str(GLOO_SCRIPT)]
            cmd += [str(rank), "10.79.1.1", ip, "256"]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env))
        _line(procs[1], "MOVING", 120)
        # every packet from b to a is now dropped, silently
        _sh("tc", "-n", b, "qdisc", "del", "dev", vb, "root")
        _drop_everything(b, vb)
        seen: dict[int, list[str]] = {0: [], 1: []}
        for rank, p in enumerate(procs):
            _collect(p, seen[rank])

        def silent() -> list[dict[str, object]]:
            return [
                json.loads(x[len("VERDICT ") :])
                for lines in seen.values()
                for x in list(lines)
                if x.startswith("VERDICT ") and '"silent"' in x
            ]

        end = time.monotonic() + 90  # Gloo's own timeout is 120 s
        while not silent() and time.monotonic() < end:
            time.sleep(0.1)
        found = silent()
        assert found, seen  # at least one end of the cut link names the other
        assert all(v["stuck"] and str(v["remote"]).startswith("10.79.1.") for v in found), found
        # the verdict came while the collective was still running: Gloo had not given up
        assert not any(x.startswith(("DONE", "FAILED")) for lines in seen.values() for x in lines)
    finally:
        _stop(procs, (a, b))


GROUP_SCRIPT = Path(__file__).parent / "scripts" / "group_stall_peer.py"


@pytest.mark.root
@pytest.mark.skipif(shutil.which("nft") is None, reason="needs nftables (apt-get install nftables)")
def test_a_group_wait_over_a_cut_link_fails_after_stall_s_naming_the_member(prefix: str) -> None:
    # the same cut as above, seen through Group.wait with the connections a session records:
    # the end that holds unacknowledged data gives up after stall_s (3 s) and names the other
    # member by rank and listener, long before late_s (300 s) or Gloo's own backstop
    a, b = f"{prefix}-a", f"{prefix}-b"
    va, vb = f"{prefix}a", f"{prefix}b"
    procs: list[subprocess.Popen[str]] = []
    try:
        _sh("ip", "netns", "add", a)
        _sh("ip", "netns", "add", b)
        _sh("ip", "link", "add", va, "netns", a, "type", "veth", "peer", "name", vb, "netns", b)
        for ns, dev, ip in ((a, va, "10.79.2.1/24"), (b, vb, "10.79.2.2/24")):
            _sh("ip", "-n", ns, "addr", "add", ip, "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            tbf = ["root", "tbf", "rate", "20mbit", "burst", "32kbit", "latency", "400ms"]
            _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, *tbf)
        env = {**os.environ, "PYTHONPATH": str(SRC)}
        for rank, ns, ip in ((0, a, "10.79.2.1"), (1, b, "10.79.2.2")):
            cmd = ["ip", "netns", "exec", ns, sys.executable, str(GROUP_SCRIPT)]
            cmd += [str(rank), "10.79.2.1", ip, "256"]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env))
        labels = [json.loads(_line(p, "LABELS ", 120)[len("LABELS ") :]) for p in procs]
        assert [len(x) for x in labels] == [1, 1], labels
        assert labels[0][0].startswith("rank 1 at 10.79.2.2:"), labels
        assert labels[1][0].startswith("rank 0 at 10.79.2.1:"), labels
        # a heartbeat now says the transfer moves (the coordinator then waits longer for one)
        assert _line(procs[1], "MOVING", 60) == "MOVING True"
        # every packet from b to a is now dropped, silently, where it arrives: b's kernel sends
        # it as usual (a drop in b's own qdisc would be local congestion to b's TCP, which then
        # holds new data unsent and reads as "not reading" rather than silent)
        hook = "type filter hook input priority 0"
        rule = f"table inet cut {{\n  chain in {{ {hook}; ip saddr 10.79.2.2 drop;\n  }}\n}}\n"
        subprocess.run(
            ["ip", "netns", "exec", a, "nft", "-f", "-"],
            input=rule,
            text=True,
            check=True,
            capture_output=True,
            timeout=20,
        )
        seen: dict[int, list[str]] = {0: [], 1: []}
        for rank, p in enumerate(procs):
            _collect(p, seen[rank])

        def ended(rank: int) -> str:
            return next((x for x in seen[rank] if x.startswith(("DONE", "FAILED"))), "")

        def named(rank: int) -> bool:
            return '"unreached": ["' in ended(rank)

        # a's acknowledgements of b's data are dropped, and so are b's of a's (they travel from
        # b to a): whichever end has data in flight sees it go unacknowledged and gives up after
        # stall_s, naming the other. An end with nothing in flight at the cut (it had sent its
        # part and waits to receive) may go on waiting: in a run, the other end's report makes
        # the coordinator abort the round for it.
        end = time.monotonic() + 90
        while time.monotonic() < end and not (named(0) or named(1)):
            time.sleep(0.1)
        time.sleep(0.5)  # the other end, if it gives up too, says so at about the same time
        ends = {rank: ended(rank) for rank in (0, 1)}
        assert not any(e.startswith("DONE") for e in ends.values()), seen  # none over the cut
        assert all(e.startswith("FAILED ") for e in ends.values() if e), seen
        failed = {r: json.loads(e[len("FAILED ") :]) for r, e in ends.items() if e}
        naming = {r: f for r, f in failed.items() if f["unreached"]}
        assert naming, seen  # the end that saw its connection silent first names the other
        for r, f in naming.items():  # by rank and listener, and nobody else
            assert f["unreached"] == labels[r], failed
            other = "rank 0 at 10.79.2.1:" if r == 1 else "rank 1 at 10.79.2.2:"
            assert f"no acknowledgement from {other}" in f["error"], failed
    finally:
        _stop(procs, (a, b))


HANDOFF_SCRIPT = Path(__file__).parent / "scripts" / "handoff_peer.py"


def _cut_then_send(ns: str, other_ip: str, sender: subprocess.Popen[str]) -> None:
    """Drop everything between ``ns`` and ``other_ip`` (both ways, in ``ns``), then tell the
    handoff peer ``sender`` to hand its data to its kernel."""
    hook = "filter hook"
    rule = (
        f"table inet cut {{\n  chain in {{ type {hook} input priority 0; "
        f"ip saddr {other_ip} drop; }}\n  chain out {{ type {hook} output priority 0; "
        f"ip daddr {other_ip} drop; }}\n}}\n"
    )
    subprocess.run(
        ["ip", "netns", "exec", ns, "nft", "-f", "-"],
        input=rule,
        text=True,
        check=True,
        capture_output=True,
        timeout=20,
    )
    assert sender.stdin is not None
    sender.stdin.write("SEND\n")
    sender.stdin.flush()


@pytest.mark.root
@pytest.mark.skipif(shutil.which("nft") is None, reason="needs nftables (apt-get install nftables)")
def test_data_handed_to_the_kernel_over_a_cut_link_aborts_the_round_naming_the_pair(
    prefix: str,
) -> None:
    # The cut lands after the receiver told the sender it is ready and before the sender's data
    # arrives: the sender's send completes (its data is in its kernel) and it reports; the
    # receiver waits with nothing in flight, which on its side looks like a late sender. The
    # sender's heartbeat names the receiver once its data has gone unacknowledged past the
    # stall rule (stall_s 2 s, and retransmitted), the receiver's says nothing moves, and the
    # coordinator's rules, fed those real heartbeats, abort the round naming the pair.
    from isthmus.coordinator.membership import Membership, MembershipConfig
    from isthmus.coordinator.protocol import TensorSpec

    a, b = f"{prefix}-a", f"{prefix}-b"
    va, vb = f"{prefix}a", f"{prefix}b"
    procs: list[subprocess.Popen[str]] = []
    try:
        _veth_pair((a, va, "10.79.3.1/24"), (b, vb, "10.79.3.2/24"))
        m = Membership(MembershipConfig(start_peers=2, heartbeat_timeout=30.0))
        ids = [
            m.register(n, time.monotonic(), {"probe": f"{ip}:4100"})
            for n, ip in (("a", "10.79.3.1"), ("b", "10.79.3.2"))
        ]
        schema = [TensorSpec("w", (2048,), "torch.float32")]
        for pid in ids:
            m.begin(pid, time.monotonic(), nonce="1", revision=0, hashes={"w": "0"}, schema=schema)
        plan = m.poll_begin(ids[0], "1").plan
        assert plan is not None and plan.members == tuple(ids)  # rank 0 is a, rank 1 is b
        env = {**os.environ, "PYTHONPATH": str(SRC)}
        for rank, ns, ip in ((0, a, "10.79.3.1"), (1, b, "10.79.3.2")):
            cmd = ["ip", "netns", "exec", ns, sys.executable, str(HANDOFF_SCRIPT)]
            cmd += [str(rank), "10.79.3.1", ip, str(plan.epoch)]
            procs.append(
                subprocess.Popen(
                    cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
                )
            )
        _line(procs[0], "POSTED", 120)
        time.sleep(1.0)  # the receiver's "ready" reaches the sender and is acknowledged
        _cut_then_send(a, "10.79.3.2", procs[1])
        _line(procs[1], "SENT", 60)  # handed to the kernel: the sender reports its round
        assert (
            m.commit(ids[1], time.monotonic(), epoch=plan.epoch, round=plan.round, ok=True).kind
            == "wait"
        )
        seen: dict[int, list[str]] = {0: [], 1: []}
        for rank, p in enumerate(procs):
            _collect(p, seen[rank])

        def last_info(rank: int) -> dict[str, object] | None:
            infos = [x for x in list(seen[rank]) if x.startswith("INFO ")]
            return json.loads(infos[-1][len("INFO ") :]) if infos else None

        end = time.monotonic() + 60
        while time.monotonic() < end and m.poll_commit(plan.epoch, plan.round).kind == "wait":
            now = time.monotonic()
            for rank, pid in enumerate(ids):
                m.heartbeat(pid, now, {"transfer": last_info(rank)})
            m.tick(now)
            time.sleep(0.1)
        assert m.poll_commit(plan.epoch, plan.round).kind == "aborted", seen
        said = [json.loads(x[len("INFO ") :]) for x in seen[1] if x.startswith("INFO ")]
        silent = [s for s in said if s is not None]
        assert silent and said[0] is None, said  # nothing named until the stall rule held
        first = silent[0]["silent"]
        assert [(e["epoch"], e["rank"]) for e in first] == [(plan.epoch, 0)], first
        assert first[0]["for_s"] >= 2.0, first
        assert not any(x.startswith(("DONE", "FAILED")) for x in seen[0]), seen  # still waits
        unreachable = [e for e in m.events if e["kind"] == "unreachable"]
        assert [(e["name"], e["remote_name"], e["how"]) for e in unreachable] == [
            ("b", "a", "stalled")
        ], unreachable
        abort = [e for e in m.events if e["kind"] == "abort"][-1]
        assert "link between them is cut" in abort["reason"], abort
    finally:
        _stop(procs, (a, b))


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.skipif(shutil.which("nft") is None, reason="needs nftables (apt-get install nftables)")
def test_a_cut_between_island_followers_aborts_the_round_naming_the_islands(prefix: str) -> None:
    # The handed-over cut of the test above, between the followers (rank 1) of two islands of
    # two ranks whose leaders' connections are clean: the processes in the namespaces are the
    # followers' cross-island groups, each follower's transfer goes to its leader over a real
    # island watch (UDP), and the leaders' heartbeats carry the island's merge
    # (island_watch.island_transfer): the receiving island's leader has reached the outcome
    # (nothing moves), the sending island reported. The coordinator's unchanged rule aborts
    # the round and marks the pair of islands down.
    from isthmus.comm.island_watch import IslandWatch, bind_watch, island_transfer
    from isthmus.coordinator.membership import Membership, MembershipConfig
    from isthmus.coordinator.protocol import TensorSpec

    a, b = f"{prefix}-a", f"{prefix}-b"
    va, vb = f"{prefix}a", f"{prefix}b"
    procs: list[subprocess.Popen[str]] = []
    watches: list[IslandWatch] = []
    try:
        _veth_pair((a, va, "10.79.4.1/24"), (b, vb, "10.79.4.2/24"))
        m = Membership(MembershipConfig(start_peers=2, heartbeat_timeout=30.0))
        ids = [
            m.register(n, time.monotonic(), {"probe": f"{ip}:4100", "island": {"size": 2}})
            for n, ip in (("island-a", "10.79.4.1"), ("island-b", "10.79.4.2"))
        ]
        schema = [TensorSpec("w", (2048,), "torch.float32")]
        for pid in ids:
            m.begin(pid, time.monotonic(), nonce="1", revision=0, hashes={"w": "0"}, schema=schema)
        plan = m.poll_begin(ids[0], "1").plan
        assert plan is not None and plan.members == tuple(ids)
        env = {**os.environ, "PYTHONPATH": str(SRC)}
        for rank, ns, ip in ((0, a, "10.79.4.1"), (1, b, "10.79.4.2")):
            cmd = ["ip", "netns", "exec", ns, sys.executable, str(HANDOFF_SCRIPT)]
            cmd += [str(rank), "10.79.4.1", ip, str(plan.epoch)]
            procs.append(
                subprocess.Popen(
                    cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
                )
            )
        _line(procs[0], "POSTED", 120)
        seen: dict[int, list[str]] = {0: [], 1: []}
        for rank, p in enumerate(procs):
            _collect(p, seen[rank])

        def follower(member: int) -> dict[str, object] | None:
            infos = [x for x in list(seen[member]) if x.startswith("INFO ")]
            return json.loads(infos[-1][len("INFO ") :]) if infos else None

        for member in (0, 1):  # each island's watch: leader (rank 0) and follower (rank 1)
            bound = [bind_watch(), bind_watch()]
            for r, (sock, _) in enumerate(bound):
                watches.append(
                    IslandWatch(
                        r,
                        sock,
                        [address for _, address in bound],
                        interval=0.1,
                        timeout=30.0,
                        on_lost=print,
                        status=lambda member=member: follower(member),
                    )
                )
        time.sleep(1.0)  # the receiver's "ready" reaches the sender and is acknowledged
        _cut_then_send(a, "10.79.4.2", procs[1])
        end = time.monotonic() + 60  # read by the collector: "SENT" is among its lines
        while "SENT" not in list(seen[1]) and time.monotonic() < end:
            time.sleep(0.05)
        assert "SENT" in seen[1], seen
        assert (
            m.commit(ids[1], time.monotonic(), epoch=plan.epoch, round=plan.round, ok=True).kind
            == "wait"
        )
        # the leaders' own word: island-a's leader reached the outcome, island-b's reported
        own = [{"epoch": plan.epoch, "round": plan.round, "moving": False}, None]
        sent: list[dict[str, object] | None] = []
        end = time.monotonic() + 60
        while time.monotonic() < end and m.poll_commit(plan.epoch, plan.round).kind == "wait":
            now = time.monotonic()
            for member, pid in enumerate(ids):
                leader = watches[2 * member]
                info = island_transfer(own[member], leader.transfers(), 2)
                m.heartbeat(pid, now, {"transfer": info})
                if member == 1:
                    sent.append(info)
            m.tick(now)
            time.sleep(0.1)
        assert m.poll_commit(plan.epoch, plan.round).kind == "aborted", (sent[-3:], seen)
        claims = [s["silent"] for s in sent if s is not None]
        assert claims and sent[0] is None, sent  # nothing named until the stall rule held
        assert [(e["epoch"], e["rank"]) for e in claims[0]] == [(plan.epoch, 0)], claims[0]
        unreachable = [e for e in m.events if e["kind"] == "unreachable"]
        assert [(e["name"], e["remote_name"], e["how"]) for e in unreachable] == [
            ("island-b", "island-a", "stalled")
        ], unreachable
        abort = [e for e in m.events if e["kind"] == "abort"][-1]
        assert "link between them is cut" in abort["reason"], abort
    finally:
        for w in watches:
            w.close()
        _stop(procs, (a, b))
