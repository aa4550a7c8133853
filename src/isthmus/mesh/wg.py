"""One WireGuard interface: created with the kernel module where the kernel has it, else with
``wireguard-go`` (userspace, over ``/dev/net/tun``), configured through its control socket (or
``wg`` for the kernel's), given its overlay address, and removed.

Every failure raises :class:`~isthmus.mesh.MeshError` saying what is missing and what to install.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

from isthmus.mesh import MeshError
from isthmus.mesh.keys import key_hex
from isthmus.mesh.plan import WgPeer

__all__ = ["Interface", "uapi_set"]

SOCKET_DIR = Path("/var/run/wireguard")
"""Where ``wireguard-go`` puts its control sockets (one per interface, shared by namespaces)."""


def uapi_set(
    *,
    private_key: str | None = None,
    listen_port: int | None = None,
    remove: Iterable[str] = (),
    upsert: Iterable[WgPeer] = (),
) -> str:
    """The control-socket request that applies these changes (keys in base64). Peers not named
    keep what they have, including an endpoint learned from their packets."""
    lines = ["set=1"]
    if private_key is not None:
        lines.append(f"private_key={key_hex(private_key)}")
    if listen_port is not None:
        lines.append(f"listen_port={listen_port}")
    for key in remove:
        lines += [f"public_key={key_hex(key)}", "remove=true"]
    for p in upsert:
        lines += [f"public_key={key_hex(p.key)}", "replace_allowed_ips=true"]
        if p.endpoint:
            lines.append(f"endpoint={p.endpoint}")
        lines.append(f"persistent_keepalive_interval={p.keepalive}")
        lines += [f"allowed_ip={ip}" for ip in p.allowed_ips]
    return "\n".join(lines) + "\n\n"


def _accepts(sock: Path) -> bool:
    """Something listens on control socket ``sock``."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(sock))
    except OSError:
        return False
    finally:
        s.close()
    return True


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the thread that started it ends (a peer that
    is SIGKILLed takes its wireguard-go, and so its interface, with it)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


_PR_SET_PDEATHSIG = 1


def _run(argv: list[str], what: str) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise MeshError(f"{what} failed: {' '.join(argv)}: {r.stderr.strip() or r.stdout.strip()}")


class Interface:
    """A WireGuard interface this process created; :meth:`close` removes it."""

    def __init__(self, name: str, *, process: subprocess.Popen[bytes] | None) -> None:
        self.name = name
        self.process = process
        """The ``wireguard-go`` process, or None for the kernel's WireGuard."""
        self._closed = False

    @property
    def kernel(self) -> bool:
        return self.process is None

    @classmethod
    def create(cls, name: str, *, timeout: float = 10.0) -> Interface:
        """Create interface ``name`` (at most 15 characters): the kernel's WireGuard if it has
        it, else ``wireguard-go``. Raises :class:`MeshError` naming what to install when
        ``ip`` or ``wireguard-go`` is missing, when there is no TUN device, or when this process
        may not create interfaces (it needs root or CAP_NET_ADMIN)."""
        if len(name) > 15:
            raise MeshError(f"interface name {name!r} is over 15 characters")
        if shutil.which("ip") is None:
            raise MeshError("the mesh needs the `ip` command: apt-get install iproute2")
        r = subprocess.run(
            ["ip", "link", "add", "dev", name, "type", "wireguard"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if r.returncode == 0:
            if shutil.which("wg") is None:
                subprocess.run(["ip", "link", "del", name], capture_output=True, timeout=30)
                raise MeshError(
                    "the kernel has WireGuard but `wg` is missing: apt-get install wireguard-tools"
                )
            return cls(name, process=None)
        if "Operation not permitted" in r.stderr:
            raise MeshError(
                "the mesh needs to create a network interface: run the peer as root or give it "
                "CAP_NET_ADMIN"
            )
        return cls._userspace(name, timeout)

    @classmethod
    def _userspace(cls, name: str, timeout: float) -> Interface:
        exe = shutil.which("wireguard-go")
        if exe is None:
            raise MeshError(
                "the mesh needs WireGuard: this kernel has no WireGuard module and wireguard-go "
                "is not installed (apt-get install wireguard-go wireguard-tools)"
            )
        if not os.path.exists("/dev/net/tun"):
            raise MeshError(
                "wireguard-go needs a TUN device and /dev/net/tun is missing: load the module "
                "(modprobe tun) or, in a container, pass --device /dev/net/tun (and "
                "--cap-add NET_ADMIN)"
            )
        sock = SOCKET_DIR / f"{name}.sock"
        if _accepts(sock):
            raise MeshError(f"a WireGuard interface named {name} is running already ({sock})")
        with contextlib.suppress(OSError):
            sock.unlink()  # left by a process that was killed: nothing listens on it
        env = {**os.environ, "WG_PROCESS_FOREGROUND": "1", "LOG_LEVEL": "error"}
        proc = subprocess.Popen(
            [exe, "-f", name],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,  # a Ctrl-C of the peer's terminal is the peer's to handle
            preexec_fn=_die_with_parent,
        )
        iface = cls(name, process=proc)
        deadline = time.monotonic() + timeout
        while not _accepts(sock):
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
                raise MeshError(f"wireguard-go could not create {name}: {err or 'it exited'}")
            if time.monotonic() > deadline:
                iface.close()
                raise MeshError(f"wireguard-go did not open {sock} within {timeout:.0f}s")
            time.sleep(0.02)
        return iface

    # -- configuration --------------------------------------------------------------------------
    def _uapi(self, request: str) -> dict[str, list[str]]:
        """Send one control-socket request; its answer's fields. Raises :class:`MeshError`."""
        out: dict[str, list[str]] = {}
        for line in self._uapi_lines(request):
            k, _, v = line.partition("=")
            if k:
                out.setdefault(k, []).append(v)
        if out.get("errno", ["0"])[-1] != "0":
            raise MeshError(f"wireguard-go refused the configuration of {self.name}: {out}")
        return out

    def configure(
        self,
        *,
        private_key: str | None = None,
        listen_port: int | None = None,
        remove: Iterable[str] = (),
        upsert: Iterable[WgPeer] = (),
    ) -> None:
        """Apply these changes (see :func:`uapi_set`). Raises :class:`MeshError` if refused."""
        remove, upsert = list(remove), list(upsert)
        if not self.kernel:
            self._uapi(
                uapi_set(
                    private_key=private_key, listen_port=listen_port, remove=remove, upsert=upsert
                )
            )
            return
        argv = ["wg", "set", self.name]
        if listen_port is not None:
            argv += ["listen-port", str(listen_port)]
        if private_key is not None:
            argv += ["private-key", "/dev/stdin"]
        for key in remove:
            argv += ["peer", key, "remove"]
        for p in upsert:
            argv += ["peer", p.key, "persistent-keepalive", str(p.keepalive or "off")]
            argv += ["allowed-ips", ",".join(p.allowed_ips)]
            if p.endpoint:
                argv += ["endpoint", p.endpoint]
        r = subprocess.run(
            argv, input=private_key or "", capture_output=True, text=True, timeout=30
        )
        if r.returncode != 0:
            raise MeshError(f"wg set {self.name} failed: {r.stderr.strip()}")

    def listen_port(self) -> int:
        """The UDP port this interface listens on."""
        if self.kernel:
            r = subprocess.run(
                ["wg", "show", self.name, "listen-port"], capture_output=True, text=True, timeout=30
            )
            return int(r.stdout.strip() or 0)
        return int(self._uapi("get=1\n\n").get("listen_port", ["0"])[-1])

    def handshakes(self) -> dict[str, float]:
        """Each peer's last completed handshake (Unix seconds; 0: never), by key in hex."""
        if self.kernel:
            r = subprocess.run(
                ["wg", "show", self.name, "latest-handshakes"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            out = {}
            for line in r.stdout.splitlines():
                key, _, t = line.partition("\t")
                out[key_hex(key)] = float(t or 0)
            return out
        peers: dict[str, float] = {}
        current = None
        for line in self._uapi_lines("get=1\n\n"):
            k, _, v = line.partition("=")
            if k == "public_key":
                current = v
                peers[v] = 0.0
            elif k == "last_handshake_time_sec" and current is not None:
                peers[current] = float(v)
        return peers

    def _uapi_lines(self, request: str) -> list[str]:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10.0)
        try:
            s.connect(str(SOCKET_DIR / f"{self.name}.sock"))
            s.sendall(request.encode())
            buf = b""
            while not buf.endswith(b"\n\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
        except OSError as e:
            raise MeshError(f"cannot talk to wireguard-go of {self.name}: {e}") from None
        finally:
            s.close()
        return buf.decode().splitlines()

    def set_address(self, address: str, prefix: int, *, mtu: int = 1420) -> None:
        """Give the interface ``address/prefix`` and bring it up. Raises :class:`MeshError`."""
        _run(["ip", "address", "add", f"{address}/{prefix}", "dev", self.name], "ip address add")
        _run(["ip", "link", "set", self.name, "mtu", str(mtu), "up"], "ip link set up")

    def forward(self) -> None:
        """Forward IPv4 packets that arrive on this interface (a relay between NATed members):
        only this interface's setting changes, not the host's."""
        path = Path(f"/proc/sys/net/ipv4/conf/{self.name}/forwarding")
        try:
            path.write_text("1\n")
        except OSError as e:
            raise MeshError(f"cannot enable forwarding on {self.name} (relay): {e}") from None

    def close(self) -> None:
        """Remove the interface (and stop its ``wireguard-go``). Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            subprocess.run(["ip", "link", "del", self.name], capture_output=True, timeout=10)
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
            if self.process.stderr is not None:
                self.process.stderr.close()
        with contextlib.suppress(OSError):
            (SOCKET_DIR / f"{self.name}.sock").unlink()
