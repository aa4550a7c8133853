"""Probes over real sockets: a listener that is there connects, a closed port is refused at
once, and (root) a port whose packets are dropped times out within the probe's bound."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from isthmus.comm.reach import ProbeListener, probe
from isthmus.coordinator.partition import How

SRC = Path(__file__).resolve().parents[2] / "src"


def test_a_probe_to_a_listener_connects_and_is_closed_at_once() -> None:
    with ProbeListener("127.0.0.1") as listener:
        assert probe(listener.address, timeout_s=5.0) is None
        assert probe(listener.address, timeout_s=5.0, source="127.0.0.1") is None
        end = time.monotonic() + 10
        while listener.accepted < 2 and time.monotonic() < end:
            time.sleep(0.01)
        assert listener.accepted == 2


def test_a_closed_port_is_refused() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # bound, never listening, now free: nothing answers but the kernel's reset
    assert probe(f"127.0.0.1:{port}", timeout_s=5.0) is How.REFUSED


def test_a_closed_listener_no_longer_connects() -> None:
    listener = ProbeListener("127.0.0.1")
    address = listener.address
    listener.close()
    assert probe(address, timeout_s=5.0) is How.REFUSED


_CHILD = """
import sys
from isthmus.comm.reach import ProbeListener, probe
with ProbeListener("127.0.0.1", int(sys.argv[1])) as l:
    print(probe(l.address, timeout_s=1.0))
"""


@pytest.mark.root
def test_dropped_packets_time_out(prefix: str) -> None:
    if shutil.which("nft") is None:
        pytest.skip("needs nftables (apt-get install nftables)")
    ns = f"{prefix}-probe"
    nft = ["ip", "netns", "exec", ns, "nft"]
    port = "41999"
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True, timeout=20)
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True, timeout=20)
        subprocess.run([*nft, "add", "table", "inet", "f"], check=True, timeout=20)
        chain = "add chain inet f in { type filter hook input priority 0; }"
        subprocess.run([*nft, chain], check=True, timeout=20)
        rule = ["add", "rule", "inet", "f", "in", "tcp", "dport", port, "drop"]
        subprocess.run([*nft, *rule], check=True, timeout=20)
        out = subprocess.run(
            ["ip", "netns", "exec", ns, sys.executable, "-c", _CHILD, port],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(SRC)},
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == str(How.TIMED_OUT)
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
