"""The emulated WAN: namespaces, links and shaping exist while active and vanish on every exit path.

Tests that build namespaces need root and iproute2; they are skipped with the reason otherwise.
Each test uses its own random prefix and a fixture that removes anything with that prefix, so a
failing test never leaves namespaces behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from isthmus.lab import netns as netns_mod
from isthmus.lab.counters import InterfaceCounters, parse_proc_net_dev, read_counters
from isthmus.lab.netns import (
    LabUnavailable,
    cleanup_stale,
    list_namespaces,
    tbf_parameters,
    unavailable_reason,
)
from isthmus.lab.scenario import parse_scenario
from isthmus.lab.wan import WanNetwork
from isthmus.run import forkserver

REASON = unavailable_reason()
NETNS_EXEC = Path(__file__).resolve().parent / "scripts" / "netns_exec.py"


def _ours(prefix: str) -> list[str]:
    return [n for n in list_namespaces() if n.startswith(prefix + "-")]


def _sh(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=20).stdout


# ---------------------------------------------------------------- no root needed


def test_config_errors_say_what_to_do() -> None:
    with pytest.raises(ValueError, match="positive int"):
        WanNetwork(0)
    with pytest.raises(ValueError, match="one rate or one per peer"):
        WanNetwork(3, rates_mbit=[10, 20])
    with pytest.raises(ValueError, match=r"rates_mbit\[1\]"):
        WanNetwork(2, rates_mbit=[10, -5])
    with pytest.raises(ValueError, match="coordinator_rate_mbit"):
        WanNetwork(2, coordinator_rate_mbit=float("nan"))
    with pytest.raises(ValueError, match="prefix"):
        WanNetwork(2, prefix="Bad-Prefix")
    with pytest.raises(ValueError, match="private"):
        WanNetwork(2, subnet="8.8.8.0/24")
    with pytest.raises(ValueError, match="larger subnet"):
        WanNetwork(10, subnet="10.77.0.0/29")


def test_addresses_and_names_are_planned_before_anything_is_built() -> None:
    net = WanNetwork(3, rates_mbit=[10, None, 1000], coordinator_rate_mbit=100, prefix="abc")
    assert net.coordinator.ip == "10.77.0.1"
    assert [p.ip for p in net.peers] == ["10.77.0.2", "10.77.0.3", "10.77.0.4"]
    assert [p.rate_bps for p in net.peers] == [10e6, None, 1000e6]
    assert net.coordinator.rate_bps == 100e6
    assert net.run_id.startswith(f"abc-{os.getpid()}-")
    assert len(set(net.namespaces)) == 5
    assert net.env(1) == {"GLOO_SOCKET_IFNAME": "wan0"}
    assert net.command("coordinator", ["true"]) == [
        "ip",
        "netns",
        "exec",
        net.coordinator.netns,
        "true",
    ]
    with pytest.raises(IndexError):
        net.node(3)
    # two runs with the same prefix never share names
    assert WanNetwork(3, prefix="abc").run_id != net.run_id


def test_from_scenario_network_section() -> None:
    spec = parse_scenario(
        """
        [run]
        name = "x"
        steps = 1
        [strategy]
        name = "ddp"
        [network]
        peers = 3
        rate = ["1gbit", "unlimited", "2.5mbit"]
        coordinator_rate = "100mbit"
        """
    ).network
    net = WanNetwork.from_spec(spec, prefix="spec")
    assert [p.rate_bps for p in net.peers] == [1e9, None, 2.5e6]
    assert net.coordinator.rate_bps == 100e6
    assert net.run_id.startswith("spec-")


def test_tbf_parameters() -> None:
    burst, limit = tbf_parameters(1e6)
    assert burst == 16 * 1024 and limit == burst + 64 * 1024  # floors at slow rates
    burst, limit = tbf_parameters(1e9)
    assert burst == 1_250_000 and limit == burst + 12_500_000  # 10 ms and 100 ms at 1 Gbit/s
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            tbf_parameters(bad)


def test_without_root_entering_raises_lab_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns_mod.os, "geteuid", lambda: 1000)
    net = WanNetwork(2)
    with pytest.raises(LabUnavailable, match="root"), net:
        pass
    monkeypatch.setattr(netns_mod.shutil, "which", lambda tool: None)
    monkeypatch.setattr(netns_mod.os, "geteuid", lambda: 0)
    with pytest.raises(LabUnavailable, match="iproute2"):
        WanNetwork(2).start()


_PROC_NET_DEV = """Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo:    1000      10    0    0    0     0          0         0     1000      10    0    0    0     0       0          0
  wan0: 5000000    4000    0    3    0     0          0         0  9000000    7000    0    1    0     0       0          0
"""


def test_parse_proc_net_dev_and_deltas() -> None:
    table = parse_proc_net_dev(_PROC_NET_DEV)
    assert table["wan0"] == InterfaceCounters(
        rx_bytes=5_000_000,
        rx_packets=4000,
        rx_dropped=3,
        tx_bytes=9_000_000,
        tx_packets=7000,
        tx_dropped=1,
    )
    later = InterfaceCounters(
        rx_bytes=5_000_100,
        rx_packets=4001,
        tx_bytes=9_000_500,
        tx_packets=7002,
        tx_dropped=1,
        rx_dropped=3,
    )
    assert (later - table["wan0"]).tx_bytes == 500
    with pytest.raises(ValueError, match="went backwards"):
        _ = table["wan0"] - later
    with pytest.raises(ValueError, match="header"):
        parse_proc_net_dev("lo: 1 2 3")
    with pytest.raises(ValueError, match="unexpected"):
        parse_proc_net_dev(_PROC_NET_DEV + "  eth9: 1 2 3\n")


def test_read_counters_in_our_own_namespace_needs_no_root() -> None:
    lo = read_counters("lo")
    assert lo.tx_bytes >= 0 and lo.rx_packets >= 0
    with pytest.raises(KeyError, match="present"):
        read_counters("no-such-if0")


# ---------------------------------------------------------------- root


@pytest.mark.root
def test_congestion_control_is_set_in_every_namespace_or_refused_by_name(prefix: str) -> None:
    with WanNetwork(2, rates_mbit=10, prefix=prefix, congestion_control="reno") as net:
        assert net.tcp_congestion_control() == "reno"
        key = "net.ipv4.tcp_congestion_control"
        for ns in (net.peers[1].netns, net.coordinator.netns):
            assert _sh("ip", "netns", "exec", ns, "sysctl", "-n", key).strip() == "reno"
    with pytest.raises(netns_mod.LabError, match=r"'nosuchcc' cannot be used.*allowed: "):
        WanNetwork(2, prefix=prefix, congestion_control="nosuchcc").start()
    assert _ours(prefix) == []
    with pytest.raises(ValueError, match="congestion control name"):
        WanNetwork(2, prefix=prefix, congestion_control="reno bbr")


@pytest.mark.root
def test_everything_exists_while_active_and_is_gone_after(prefix: str) -> None:
    with WanNetwork(2, rates_mbit=[50, None], prefix=prefix) as net:
        assert sorted(_ours(prefix)) == sorted(net.namespaces)
        p0, p1 = net.peers
        assert f"{p0.ip}/24" in _sh("ip", "-n", p0.netns, "-br", "addr", "show", "dev", "wan0")
        assert "tbf" in _sh("tc", "-n", p0.netns, "qdisc", "show", "dev", "wan0")
        assert "tbf" in _sh("tc", "-n", net.bridge_netns, "qdisc", "show", "dev", "p0")
        assert "tbf" not in _sh("tc", "-n", p1.netns, "qdisc", "show", "dev", "wan0")
        bridge_ports = _sh("ip", "-n", net.bridge_netns, "-br", "link", "show", "master", "br0")
        assert {line.split("@")[0] for line in bridge_ports.splitlines()} == {"c", "p0", "p1"}
        # the coordinator is reachable from a peer over the emulated network
        code = "import socket; socket.create_connection((%r, 7000), timeout=5).close()"
        srv = net.popen(
            "coordinator",
            [
                sys.executable,
                "-c",
                f"import socket; s=socket.create_server(({net.coordinator.ip!r}, 7000)); print('up', flush=True); s.accept()",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert srv.stdout is not None and srv.stdout.readline().strip() == "up"
        assert net.run(1, [sys.executable, "-c", code % net.coordinator.ip]).returncode == 0
        assert srv.wait(timeout=10) == 0
        # the host namespace cannot see the lab's interfaces
        assert "wan0" not in _sh("ip", "-br", "link")
    assert _ours(prefix) == []


@pytest.mark.root
def test_exception_in_body_tears_down_and_propagates(prefix: str) -> None:
    with (
        pytest.raises(RuntimeError, match="boom"),
        WanNetwork(2, rates_mbit=10, prefix=prefix) as net,
    ):
        sleeper = net.popen(0, ["sleep", "60"])
        assert len(_ours(prefix)) == 4
        raise RuntimeError("boom")
    assert _ours(prefix) == []
    assert sleeper.poll() is not None  # processes inside the namespaces were ended


_CHILD = textwrap.dedent(
    """
    import json, sys, time
    from isthmus.lab.wan import WanNetwork
    with WanNetwork(2, rates_mbit=20, prefix=sys.argv[1]) as net:
        sleeper = net.popen(1, ["sleep", "120"])
        print(json.dumps({"names": net.namespaces, "sleeper": sleeper.pid}), flush=True)
        while True:
            time.sleep(0.1)
    """
)


def _start_child(prefix: str) -> tuple[subprocess.Popen[str], list[str], int]:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, prefix],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    line = child.stdout.readline()
    if not line:
        child.wait(timeout=10)
        pytest.fail(
            f"child did not build the network: {child.stderr.read() if child.stderr else ''}"
        )
    info = json.loads(line)
    return child, info["names"], info["sleeper"]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie still answers kill(0); its state letter is Z
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.root
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_the_owning_process_tears_down(prefix: str, signum: int) -> None:
    child, names, sleeper = _start_child(prefix)
    assert set(names) <= set(list_namespaces())
    child.send_signal(signum)
    _, err = child.communicate(timeout=30)
    if signum == signal.SIGINT:
        assert "KeyboardInterrupt" in err  # the previous handler (Python's) still ran
    else:
        assert child.returncode == -signal.SIGTERM  # and the process died of SIGTERM as before
    assert not set(names) & set(list_namespaces())
    assert _gone(sleeper)


@pytest.mark.root
def test_cleanup_stale_removes_a_killed_run_and_keeps_a_live_one(prefix: str) -> None:
    with WanNetwork(1, prefix=prefix) as live:
        child, names, sleeper = _start_child(prefix)
        child.kill()  # SIGKILL: no handler runs, the namespaces stay
        child.wait(timeout=10)
        assert set(names) <= set(list_namespaces())
        removed = cleanup_stale(prefix)
        assert sorted(removed) == sorted(names)
        assert not set(names) & set(list_namespaces())
        assert set(live.namespaces) <= set(list_namespaces())
        deadline = time.monotonic() + 5
        while not _gone(sleeper) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(sleeper)
    assert _ours(prefix) == []


_SERVER = textwrap.dedent(
    """
    import socket, sys, time
    s = socket.create_server((sys.argv[1], 7001))
    print("up", flush=True)
    c, _ = s.accept()
    n, t0 = 0, None
    while True:
        b = c.recv(1 << 20)
        if not b:
            break
        if t0 is None:
            t0 = time.perf_counter()
        n += len(b)
    print(n, time.perf_counter() - t0, flush=True)
    """
)
_CLIENT = textwrap.dedent(
    """
    import socket, sys
    c = socket.create_connection((sys.argv[1], 7001), timeout=30)
    left, buf = int(sys.argv[2]), b"x" * (1 << 16)
    while left > 0:
        c.sendall(buf[: min(left, len(buf))])
        left -= len(buf)
    c.close()
    """
)


def _transfer(net: WanNetwork, src: int, dst: int, nbytes: int) -> float:
    """Bulk TCP transfer src -> dst; returns the payload rate the receiver saw, in bit/s."""
    ip = net.peers[dst].ip
    srv = net.popen(dst, [sys.executable, "-c", _SERVER, ip], stdout=subprocess.PIPE, text=True)
    assert srv.stdout is not None and srv.stdout.readline().strip() == "up"
    assert net.run(src, [sys.executable, "-c", _CLIENT, ip, str(nbytes)]).returncode == 0
    got, seconds = srv.stdout.readline().split()
    srv.wait(timeout=10)
    assert int(got) == nbytes
    return 8 * nbytes / float(seconds)


@pytest.mark.root
def test_tbf_shapes_a_bulk_transfer_and_counters_see_it(prefix: str) -> None:
    # This checks that the kernel's shaper is in place, not how fast our code is: a 50 Mbit/s link
    # must not carry a bulk flow much faster than 50 Mbit/s (1.5x allows for the initial burst and
    # timer slack), while the unshaped pair carries it far faster.
    rate = 50e6
    with WanNetwork(4, rates_mbit=[50, 50, None, None], prefix=prefix) as net:
        before = net.counters()
        shaped = _transfer(net, 0, 1, 4_000_000)  # about 0.65 s at 50 Mbit/s
        mid = net.counters()
        unshaped = _transfer(net, 2, 3, 4_000_000)
        after = net.counters()
    assert shaped <= 1.5 * rate
    assert unshaped > 3 * shaped
    sent0 = mid[0] - before[0]
    got1 = mid[1] - before[1]
    assert sent0.tx_bytes >= 4_000_000 and got1.rx_bytes >= 4_000_000
    assert sent0.tx_bytes < 1.1 * 4_000_000  # headers and a few control packets only
    quiet = mid[2] - before[2]
    assert quiet.tx_bytes < 10_000  # peer 2 was not part of the first transfer
    assert (after[2] - mid[2]).tx_bytes >= 4_000_000


_GLOO = textwrap.dedent(
    """
    import datetime, os, sys
    import torch, torch.distributed as dist
    from isthmus.comm.group import build_process_group
    rank, host, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    store = dist.TCPStore(host, 29511, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    # GLOO_SOCKET_IFNAME (from WanNetwork.env) is honoured by init_process_group only; a group
    # built directly must be handed the interface
    pg = build_process_group(store, rank, 2, timeout_s=30, interface=os.environ["GLOO_SOCKET_IFNAME"])
    t = torch.full((n,), float(rank + 1))
    pg.allreduce([t]).wait()
    print("RESULT", float(t.min()), float(t.max()), flush=True)
    store.set(f"done{rank}", "1")
    store.wait([f"done{1 - rank}"])  # both have their result before either leaves
    # rank 0 hosts the store: it leaves only after rank 1's last wait has been answered (it
    # says so with "bye"), else that wait can meet a closed store (connection reset, exit 1)
    if rank == 1:
        store.set("bye", "1")
    else:
        store.wait(["bye"])
    # leave without destroying the group and the store: tearing them down at interpreter exit
    # while the other rank is still closing once aborted rank 0 (std::terminate, exit -6) after
    # its result was printed
    os._exit(0)
    """
)


@pytest.mark.root
def test_gloo_all_reduce_across_namespaces_and_counters_match_its_volume(
    prefix: str, tmp_path: Path
) -> None:
    n = 1 << 20  # 4 MiB of float32
    script = tmp_path / "gloo_rank.py"
    script.write_text(_GLOO)
    with WanNetwork(2, rates_mbit=200, prefix=prefix) as net:
        host = net.peers[0].ip
        before = net.counters()
        # each rank forked from the warm server (torch imported) into its node's namespace,
        # not a fresh interpreter under `ip netns exec`
        logs = [tmp_path / f"rank{r}.log" for r in range(2)]

        def args(r: int) -> list[str]:
            return [str(r), host, str(n)]

        procs = [
            forkserver.popen(
                [sys.executable, str(NETNS_EXEC), net.peers[r].netns, str(script), *args(r)],
                env={**os.environ, **net.env(r)},
                log_path=logs[r],
            )
            for r in range(2)
        ]
        codes = [p.wait(60) for p in procs]
        after = net.counters()
    outs = [f.read_text() for f in logs]
    assert codes == [0, 0], outs
    results = [[ln.split()[1:] for ln in o.splitlines() if ln.startswith("RESULT ")] for o in outs]
    assert results == [[["3.0", "3.0"]], [["3.0", "3.0"]]], outs
    # ring all-reduce, 2 ranks: each sends 2(n-1)/n = 1x the buffer; the interfaces carry that
    # plus headers, acknowledgements and the store's rendezvous traffic
    for r in range(2):
        tx = (after[r] - before[r]).tx_bytes
        assert 4 * n <= tx < 1.1 * 4 * n


@pytest.mark.root
def test_inside_namespace_moves_only_this_thread_and_comes_back(prefix: str) -> None:
    import socket
    import threading

    from isthmus.lab.netns import LabError, inside_namespace

    def devices() -> set[str]:
        with open("/proc/thread-self/net/dev") as f:
            text = f.read()
        return set(parse_proc_net_dev(text))

    home = devices()
    with WanNetwork(1, prefix=prefix) as net:
        seen: list[set[str]] = []
        with inside_namespace(net.coordinator.netns):
            assert "wan0" in devices()
            # a socket made here, and a thread started here, live in the coordinator's namespace
            listener = socket.socket()
            listener.bind((net.coordinator.ip, 0))
            t = threading.Thread(target=lambda: seen.append(devices()))
            t.start()
            t.join()
        assert devices() == home and "wan0" in seen[0]
        listener.listen(1)
        port = listener.getsockname()[1]
        code = f"import socket; socket.create_connection(('{net.coordinator.ip}', {port}), 5)"
        r = net.run(0, [sys.executable, "-c", code], timeout_s=30)
        assert r.returncode == 0, r.stderr
        listener.close()
    with pytest.raises(LabError, match="no network namespace"), inside_namespace(f"{prefix}-x"):
        pass
    assert devices() == home
