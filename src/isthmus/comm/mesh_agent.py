"""A peer's side of the run's WireGuard mesh (``SessionConfig(mesh=True)``).

:meth:`MeshAgent.start` makes a key pair (the private key never leaves this process), creates
this process's WireGuard interface (:mod:`isthmus.mesh.wg`), joins the coordinator's mesh over
its TLS API under the peer's token (:mod:`isthmus.coordinator.mesh_room`), takes the overlay
address it is given, configures every member, and waits until WireGuard has completed a
handshake with a member that others can reach. Then a thread long-polls the mesh and applies
each change: a member that joins is added, one that leaves, dies or is evicted (or whose token
is revoked) is removed, so its packets are dropped here from then on.

The session binds Gloo to :attr:`MeshAgent.address`, so tensors travel only inside WireGuard.

Failures raise :class:`~isthmus.mesh.MeshError`: WireGuard missing (naming what to install),
no TUN device, a coordinator without the mesh, and a handshake that never completes (the key
the members hold for this peer is not its key, or UDP to them is blocked).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import threading
import time

from isthmus.comm.reach import local_address
from isthmus.comm.session_config import SessionConfig
from isthmus.coordinator import mesh_protocol as msgs
from isthmus.coordinator.client import AuthError, CoordinatorClient, CoordinatorError
from isthmus.mesh import MeshError
from isthmus.mesh.keys import KeyPair, key_hex
from isthmus.mesh.plan import Node, WgPeer, diff, wg_peers
from isthmus.mesh.wg import Interface

__all__ = ["MeshAgent"]

log = logging.getLogger("isthmus.mesh")


_SERIAL = itertools.count()
"""Numbers this process's interfaces (their names share /var/run/wireguard with every other)."""


def _endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class MeshAgent:
    """This peer's interface in the mesh and the thread that keeps it in step."""

    def __init__(self, client: CoordinatorClient, config: SessionConfig, name: str) -> None:
        self.client = client
        self.config = config
        self.name = name
        self.keys = KeyPair.generate()
        self.iface: Interface | None = None
        self.address = ""
        """This peer's overlay address (Gloo binds it)."""
        self.nat = False
        """The coordinator saw this peer behind NAT: it sends first, with keepalives."""
        self.keepalive = 10
        self.version = ""
        self.peers: dict[str, WgPeer] = {}
        """This interface's WireGuard peers now, by key."""
        self.members: tuple[msgs.MeshMember, ...] = ()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def public_key(self) -> str:
        """The key this peer is known by in the mesh (the one it reported)."""
        return self.reported_key()

    def reported_key(self) -> str:
        """The public key this peer tells the coordinator (its own)."""
        return self.keys.public

    @classmethod
    def start(cls, client: CoordinatorClient, config: SessionConfig, name: str) -> MeshAgent:
        """Bring this peer into the mesh (see the module). Raises :class:`MeshError`, or the
        client's error when the coordinator refuses the token; nothing is left behind."""
        agent = cls(client, config, name)
        try:
            agent._start()
        except BaseException:
            agent.close()
            raise
        return agent

    @classmethod
    def for_session(
        cls, client: CoordinatorClient, config: SessionConfig, name: str
    ) -> tuple[MeshAgent | None, SessionConfig]:
        """For a session with ``config``: the agent (None without ``mesh``) and the config its
        groups use (Gloo bound to the overlay address). On failure the client is closed and
        the error raised."""
        if not config.mesh:
            return None, config
        try:
            agent = cls.start(client, config, name)
        except BaseException:
            client.close()
            raise
        return agent, dataclasses.replace(config, hostname=agent.address, interface=None)

    @staticmethod
    def info_of(agent: MeshAgent | None) -> dict[str, str]:
        """What a session registers with: its mesh key (nothing without the mesh)."""
        return {} if agent is None else {"mesh_key": agent.public_key}

    @staticmethod
    def close_if(agent: MeshAgent | None) -> None:
        """Close ``agent`` unless it is None."""
        if agent is not None:
            agent.close()

    def _start(self) -> None:
        cfg = self.config
        self.iface = iface = Interface.create(f"ism{os.getpid()}.{next(_SERIAL)}")
        iface.configure(private_key=self.keys.private, listen_port=cfg.mesh_port)
        port = iface.listen_port()
        host = local_address(cfg.coordinator, hostname=cfg.hostname, interface=cfg.interface)
        endpoints = (cfg.mesh_endpoint,) if cfg.mesh_endpoint else (_endpoint(host, port),)
        join = msgs.MeshJoin(
            name=self.name,
            public_key=self.reported_key(),
            endpoints=endpoints,
            public=cfg.mesh_endpoint is not None,
            relay=cfg.mesh_relay,
        )
        try:
            joined = self.client.call("/v1/mesh/join", join, msgs.MeshJoined)
        except AuthError:
            raise
        except CoordinatorError as e:
            if "404" in str(e) or "Not Found" in str(e):
                raise MeshError(
                    f"the coordinator at {cfg.coordinator} has no mesh (/v1/mesh/join): run an "
                    f"isthmus coordinator of this version"
                ) from None
            raise
        self.address, self.nat, self.keepalive = (
            joined.address,
            joined.endpoint is None,
            (joined.keepalive),
        )
        iface.set_address(joined.address, joined.prefix)
        if cfg.mesh_relay and not self.nat:
            iface.forward()
        self.apply(joined.view)
        log.info(
            "%s joined the mesh as %s (%s; endpoint %s)",
            self.name,
            self.address,
            "behind NAT" if self.nat else "reachable",
            joined.endpoint,
        )
        self._await_handshake(cfg.mesh_handshake_timeout)
        self._thread = threading.Thread(target=self._follow, name="isthmus-mesh", daemon=True)
        self._thread.start()

    # -- the mesh's changes ---------------------------------------------------------------------
    def apply(self, view: msgs.MeshView) -> None:
        """Configure the interface for ``view``: add and change the members it lists, remove
        the others. Raises :class:`MeshError` when WireGuard refuses the change."""
        assert self.iface is not None
        nodes = [Node(m.public_key, m.address, m.endpoint, m.relay) for m in view.members]
        with self._lock:
            new = wg_peers(self.public_key, nodes, keepalive=self.keepalive)
            removed, changed = diff(self.peers, new)
            if removed or changed:
                self.iface.configure(remove=removed, upsert=changed)
            self.peers, self.version, self.members = new, view.version, view.members
        if removed or changed:
            names = {m.public_key: m.name or m.address for m in view.members}
            log.info(
                "%s: mesh now %s; removed %d, added or changed %s",
                self.name,
                view.version,
                len(removed),
                sorted(names.get(p.key, p.key[:8]) for p in changed),
            )

    def _follow(self) -> None:
        while not self._stop.is_set():
            poll = msgs.MeshPoll(public_key=self.public_key, version=self.version)
            try:
                view = self.client.call("/v1/mesh/view", poll, msgs.MeshView, read_timeout=60.0)
            except AuthError as e:  # revoked: talk to no one
                log.warning(
                    "%s: the mesh refused this peer (%s): dropping every member", self.name, e
                )
                with contextlib.suppress(Exception):
                    self.apply(msgs.MeshView(version="", members=()))
                return
            except Exception as e:
                if self._stop.is_set():
                    return
                log.warning("%s: cannot read the mesh: %s", self.name, e)
                self._stop.wait(1.0)
                continue
            if view.version != self.version:
                try:
                    self.apply(view)
                except MeshError as e:
                    log.warning("%s: %s", self.name, e)

    def _await_handshake(self, timeout: float) -> None:
        """Wait until WireGuard completed a handshake with a member that has an endpoint (none:
        return at once). Raises :class:`MeshError` after ``timeout`` seconds."""
        assert self.iface is not None
        targets = {key_hex(k): p for k, p in self.peers.items() if p.endpoint}
        if not targets:
            return
        # A keepalive is the one packet WireGuard sends by itself, and the first one starts a
        # handshake: ask for one every second until a handshake completed, then restore.
        probing = [dataclasses.replace(p, keepalive=1) for p in targets.values()]
        self.iface.configure(upsert=probing)
        deadline = time.monotonic() + timeout
        try:
            while not any(self.iface.handshakes().get(h, 0.0) > 0 for h in targets):
                if time.monotonic() > deadline:
                    where = ", ".join(sorted(p.endpoint or "?" for p in targets.values()))
                    raise MeshError(
                        f"no WireGuard handshake with any member ({where}) within "
                        f"{timeout:.0f}s: the members refuse this peer's key (the key they were "
                        f"given is not its key, or its token was revoked), or UDP to their "
                        f"WireGuard ports is blocked"
                    )
                time.sleep(0.05)
        finally:
            with self._lock:
                restore = [self.peers[p.key] for p in probing if p.key in self.peers]
                with contextlib.suppress(MeshError):
                    self.iface.configure(upsert=restore)

    def close(self) -> None:
        """Leave the mesh: stop following it and remove the interface. Idempotent."""
        self._stop.set()
        if self.iface is not None:
            self.iface.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(1.0)
