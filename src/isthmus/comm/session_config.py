"""How a peer joins a run (:class:`SessionConfig`) and the errors a session raises to its user."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from isthmus.comm.faults import Fault
from isthmus.coordinator.client import CoordinatorError
from isthmus.coordinator.tls import normalize_fingerprint
from isthmus.spec import coerce

__all__ = [
    "IslandDispatch",
    "RoundFailed",
    "RoundTimeout",
    "RunFinished",
    "SessionConfig",
    "StateMismatch",
]


class IslandDispatch:
    """The base of :class:`~isthmus.comm.session.Session` that picks the session class when one
    is built: ``Session(config)`` on a rank of an island (a process of several local ranks, see
    :mod:`isthmus.comm.island`) builds the island's session, which ``island_factory`` names."""

    island_factory: ClassVar[Callable[[Any], type | None] | None] = None
    """Set by :mod:`isthmus.comm.island`: given ``island=`` (a process group or None), the class
    to build, or None for a plain peer."""

    def __new__(cls, *args: Any, island: Any = None, **kwargs: Any) -> Any:
        make = IslandDispatch.island_factory
        # only ``Session(...)`` itself is redirected, never a subclass someone builds on purpose
        sub = make(island) if make is not None and cls.__mro__[1] is IslandDispatch else None
        return super().__new__(sub or cls)


class StateMismatch(CoordinatorError):
    """This peer's shared state (names, shapes, dtypes) differs from the run's; it was refused."""


class RoundTimeout(CoordinatorError):
    """No round formed (or finished) within ``round_timeout``: too few peers, or a stuck run."""


class RunFinished(CoordinatorError):
    """The run ended (every member left) before this peer could take part."""


class RoundFailed(RuntimeError):
    """A round could not commit within ``max_attempts`` attempts."""


@dataclass(kw_only=True)
class SessionConfig:
    """How a peer joins a run. Times are seconds; every wait in the session is bounded by one."""

    coordinator: str
    """The coordinator's ``host:port`` (``https://host:port`` when it serves TLS; a bare
    ``host:port`` with a fingerprint or CA file means https)."""
    token: str
    """The run's token: a join token of this peer's own (``isthmus token new --name NAME``), or
    the admin token in a single-token run."""
    coordinator_fingerprint: str | None = None
    """Pin the coordinator's TLS certificate: the SHA-256 fingerprint it printed at start. Any
    other certificate is refused (:class:`~isthmus.coordinator.client.TLSRefused` names both)."""
    coordinator_ca: str | None = None
    """Verify the coordinator's TLS certificate against this CA file (PEM) instead."""
    name: str | None = None
    """A name for logs and ``/status`` (default: ``hostname-pid``)."""
    interface: str | None = None
    """Network interface Gloo should use (e.g. ``eth0``); default: resolve the hostname."""
    hostname: str | None = None
    """Address Gloo should bind and advertise (alternative to ``interface``)."""
    backend: str = "auto"
    """``gloo``, ``nccl``, or ``auto`` (NCCL when the shared state's floating tensors are all on
    CUDA, else Gloo: a DiLoCo-family outer state kept on the host goes over Gloo)."""
    connections: int = 1
    """TCP connections per peer pair (Gloo only): each epoch builds this many process groups and
    all-reduce, all-gather and the exchange of the quantized all-reduce split their bytes over
    them (:mod:`isthmus.comm.stripes`). More help over long fat links (a bandwidth-delay product
    of several MB), where one connection is held back by its window; they gain nothing where
    that product is small (docs/BENCHMARKS.md, "Issue 19: the default K from measurement, and
    what a link probe costs"). 1 by default: more only cost connections there, and K decides how
    a plain sum is cut, so its last bits (every run's results) would change with the default."""
    probe_links: bool = False
    """Measure the round trip and sending rate to every other member when the membership changes
    (Gloo, epochs of 4 or more: :mod:`isthmus.comm.probe`) and report them, so that the
    coordinator orders the ring by them. Off by default: ordering by a measurement makes the
    ranks, and so each peer's data shard, depend on the measurement's noise (a run is no longer
    repeated bit for bit), and on one machine or one LAN there is nothing to gain. Rates reported
    with :meth:`Session.report` (``links=``) win over probed ones. When members disagree, none
    probes."""
    probe_bytes: int = 1024 * 1024
    """The largest transfer a probe sends to measure one pair's rate (16 KiB to 64 MiB). A probe
    sends less on a thin link: its transfers grow from 16 KiB only until one takes 50 ms."""
    connect_timeout: float = 30.0
    """How long calls keep retrying while the coordinator cannot be reached."""
    collective_timeout: float = 60.0
    """The connect bound: how long building an epoch's process group (every pair of members
    connected) may take, and Gloo's timeout of the handshake there. It no longer bounds a
    collective: a transfer may take as long as it needs while its bytes move (``stall_s`` and
    ``late_s`` decide when one is stuck)."""
    round_timeout: float = 600.0
    """Bound on waiting for a round to form (e.g. fewer than ``min_peers`` alive) or finish."""
    checkpoint_dir: str | None = None
    """Write checkpoints of the run here (a directory or an fsspec URL; see
    :mod:`isthmus.checkpoint`): the strategy writes them between steps, in the background."""
    checkpoint_every: int = 0
    """A checkpoint every this many committed rounds (0: only when the strategy finishes)."""
    checkpoint_keep: int = 3
    """How many complete checkpoints to keep."""
    resume: str | None = None
    """Before the first round, load the latest complete checkpoint here (the shared state, and
    this peer's own local state if the checkpoint has its slot)."""
    max_attempts: int = 100
    """How many times one round may abort and retry before :class:`RoundFailed`."""
    pipeline_commit: bool = True
    """Send a round's commit vote and the next round's begin from a background thread while
    the next step computes, instead of waiting for them between steps (one request carrying
    both where the coordinator offers it, else two: :mod:`isthmus.comm.vote`). A strategy that
    can (DDP, DiLoCo, local SGD: the shared state changes only in rounds) applies the result
    tentatively, with an undo copy of the shared state, and learns the verdict at its next
    round: committed, it goes on; aborted, its shared state is restored bit for bit and its
    local work since counts in no round. Costs one copy of the shared state per round; a
    corrupted tensor is caught one round later than on the waiting path (the hashes sent with a
    vote are taken when its round is applied). False: every round waits for its verdict.
    Every peer may choose on its own."""
    tensorboard: str | None = None
    """Write :meth:`Session.log_scalars` (loss, learning rate, ...) with the world size and bytes
    sent as TensorBoard event files under ``DIR/<name>/`` (one run per peer). Needs the
    ``tensorboard`` package (``pip install 'isthmus[tensorboard]'``): without it the first
    logged step raises ImportError saying so."""
    stall_s: float = 10.0
    """How long a connection of a collective or state transfer may hold data that its remote
    does not acknowledge before the transfer counts as stuck: the path or the remote host is
    gone. The attempt then fails naming the member at the other end
    (:attr:`~isthmus.comm.group.CollectiveError.unreached`), and the round is retried. A slow
    link whose bytes keep moving is never stuck, however long the transfer takes."""
    late_s: float = 600.0
    """How long a collective or state transfer may move no byte at all, on any of its
    connections, while none is silent, before it counts as stuck: a member late to the
    collective, one whose process takes no data, or this member waiting for one that does not
    send. A stopped or dead member is evicted by heartbeat long before (the coordinator then
    aborts the round). Also the backstop of Gloo's own per-operation timeout, and (plus the
    bytes at 1 Mbit/s) the whole bound of a transfer whose connections cannot be watched
    (NCCL). At least ``stall_s``."""
    probe_timeout: float = 3.0
    """How long one reachability probe (a TCP connect to another member's probe listener) may
    take: after a group fails to connect or a collective fails without naming a remote, the
    members are probed to name the ones not reached; the coordinator's probes of a broken pair
    take as long. Two SYN retransmissions fit in the default."""

    mesh: bool = False
    """Carry this peer's tensors inside the run's WireGuard mesh (:mod:`isthmus.comm.mesh_agent`):
    the peer makes a key pair, joins the coordinator's mesh, brings up its own WireGuard
    interface and binds Gloo to the overlay address it is given, so every byte between peers is
    encrypted and authenticated and a peer behind NAT needs no open port. Needs root (or
    CAP_NET_ADMIN) and WireGuard (the kernel's, or ``wireguard-go``, which runs as a child of
    the thread that creates the session and ends with it); ``interface`` and ``hostname`` then
    say where WireGuard itself is reached. Fails with :class:`~isthmus.mesh.MeshError` saying
    what is missing or refused."""
    mesh_port: int = 0
    """The UDP port this peer's WireGuard listens on (0: any free port)."""
    mesh_endpoint: str | None = None
    """``host:port`` others send this peer's WireGuard to, when it is not what the coordinator
    sees (a forwarded port on a router); default: the local address toward the coordinator and
    ``mesh_port``, taken as behind NAT when the coordinator sees another address."""
    mesh_relay: bool = False
    """Offer to forward between members behind NAT (a reachable peer only)."""
    mesh_handshake_timeout: float = 10.0
    """How long joining the mesh waits for a first WireGuard handshake with a reachable member."""
    faults: tuple[str, ...] = ()
    """Faults this peer injects into itself (:mod:`isthmus.comm.faults` specs such as
    ``fail@collective:round=3`` or ``kill@step:step=40``) when the Session is given no injector
    of its own: the lab hands a user's script its peer's ``[[fault]]`` entries this way
    (``ISTHMUS_FAULTS``). For testing a run's recovery; empty in a real run."""

    def __post_init__(self) -> None:
        if not self.token:
            raise ValueError("SessionConfig.token is empty: pass the run's token")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {self.backend!r}")
        for n in (
            "connect_timeout",
            "collective_timeout",
            "round_timeout",
            "stall_s",
            "late_s",
            "probe_timeout",
        ):
            v = getattr(self, n)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
                raise ValueError(f"{n} must be a positive number of seconds, got {v!r}")
        if isinstance(self.faults, str):
            raise ValueError(
                f"faults must be a sequence of fault specs, got one string {self.faults!r}"
            )
        self.faults = tuple(self.faults)
        for spec in self.faults:
            Fault.parse(spec)  # a SpecError naming the spec and what is wrong with it
        if self.late_s < self.stall_s:
            raise ValueError(f"late_s ({self.late_s}) must be at least stall_s ({self.stall_s})")
        if not isinstance(self.connections, int) or not 1 <= self.connections <= 64:
            raise ValueError(f"connections must be an int from 1 to 64, got {self.connections!r}")
        if not isinstance(self.probe_links, bool):
            raise ValueError(f"probe_links must be True or False, got {self.probe_links!r}")
        if (
            isinstance(self.probe_bytes, bool)
            or not isinstance(self.probe_bytes, int)
            or not 16 * 1024 <= self.probe_bytes <= 64 * 1024 * 1024
        ):
            raise ValueError(
                f"probe_bytes must be an int from 16384 (16 KiB) to 67108864 (64 MiB), got "
                f"{self.probe_bytes!r}"
            )
        if not isinstance(self.pipeline_commit, bool):
            raise ValueError(f"pipeline_commit must be True or False, got {self.pipeline_commit!r}")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if self.checkpoint_every < 0 or self.checkpoint_keep < 1:
            raise ValueError(
                f"checkpoint_every must be >= 0 and checkpoint_keep >= 1, got "
                f"{self.checkpoint_every} and {self.checkpoint_keep}"
            )
        if self.interface and self.hostname:
            raise ValueError("give either interface or hostname for Gloo, not both")
        if self.coordinator_fingerprint and self.coordinator_ca:
            raise ValueError("give either coordinator_fingerprint or coordinator_ca, not both")
        if not isinstance(self.mesh_port, int) or not 0 <= self.mesh_port < 65536:
            raise ValueError(f"mesh_port must be a port number (0: any), got {self.mesh_port!r}")
        if self.mesh_handshake_timeout <= 0:
            raise ValueError("mesh_handshake_timeout must be positive")
        if self.coordinator_fingerprint:
            normalize_fingerprint(self.coordinator_fingerprint)  # raises saying what it expects

    def client_options(self) -> dict[str, Any]:
        """Keyword arguments of the session's :class:`CoordinatorClient`."""
        return {
            "connect_timeout": self.connect_timeout,
            "fingerprint": self.coordinator_fingerprint,
            "cafile": self.coordinator_ca,
        }

    @classmethod
    def from_env(cls, **overrides: Any) -> SessionConfig:
        """The config ``isthmus run`` hands a script through the environment:
        ``ISTHMUS_COORDINATOR`` (host:port), ``ISTHMUS_TOKEN`` (or ``ISTHMUS_TOKEN_FILE``),
        ``ISTHMUS_NAME``, ``ISTHMUS_COORDINATOR_FINGERPRINT`` or ``ISTHMUS_COORDINATOR_CA`` for
        TLS, ``ISTHMUS_HOSTNAME`` or ``ISTHMUS_INTERFACE`` for Gloo, and the run's
        ``ISTHMUS_CONNECTIONS`` (an integer: ``connections``) and ``ISTHMUS_PROBE_LINKS`` (``1``
        or ``0``: ``probe_links``), which ``isthmus run`` sets from ``--connections`` and
        ``--probe-links`` so that every peer of the run agrees, ``ISTHMUS_STALL_S`` and
        ``ISTHMUS_LATE_S`` (seconds: ``stall_s``, ``late_s``, from ``--stall-s`` and
        ``--late-s``), ``ISTHMUS_PIPELINE_COMMIT`` (``0`` from ``--no-pipeline-commit``:
        ``pipeline_commit``), ``ISTHMUS_MESH`` (``1``: ``mesh``) and ``ISTHMUS_FAULTS`` (fault specs
        separated by ``;``: ``faults``, what the lab gives a script from its scenario's
        ``[[fault]]`` entries). Keyword arguments win over the
        environment (which never overrides what the script says).

        Raises ValueError naming the missing variable when the script was not started by
        ``isthmus run`` and none is given, and naming the variable that holds a malformed value.
        """
        env = os.environ
        values: dict[str, Any] = {}
        for key, var in (
            ("coordinator", "ISTHMUS_COORDINATOR"),
            ("token", "ISTHMUS_TOKEN"),
            ("name", "ISTHMUS_NAME"),
            ("coordinator_fingerprint", "ISTHMUS_COORDINATOR_FINGERPRINT"),
            ("coordinator_ca", "ISTHMUS_COORDINATOR_CA"),
            ("hostname", "ISTHMUS_HOSTNAME"),
            ("interface", "ISTHMUS_INTERFACE"),
        ):
            if env.get(var):
                values[key] = env[var]
        if "token" not in values and env.get("ISTHMUS_TOKEN_FILE"):
            try:
                values["token"] = Path(env["ISTHMUS_TOKEN_FILE"]).read_text().strip()
            except OSError as e:
                raise ValueError(f"cannot read ISTHMUS_TOKEN_FILE: {e}") from None
        for key, var, hint in (
            ("connections", "ISTHMUS_CONNECTIONS", int),
            ("probe_links", "ISTHMUS_PROBE_LINKS", bool),
            ("pipeline_commit", "ISTHMUS_PIPELINE_COMMIT", bool),
            ("mesh", "ISTHMUS_MESH", bool),
            ("stall_s", "ISTHMUS_STALL_S", float),
            ("late_s", "ISTHMUS_LATE_S", float),
        ):
            if env.get(var):
                values[key] = coerce(env[var].strip(), hint, key=var)  # SpecError names var
        if env.get("ISTHMUS_FAULTS", "").strip():
            values["faults"] = tuple(
                f.strip() for f in env["ISTHMUS_FAULTS"].split(";") if f.strip()
            )
        values.update(overrides)
        for key, var in (("coordinator", "ISTHMUS_COORDINATOR"), ("token", "ISTHMUS_TOKEN")):
            if not values.get(key):
                raise ValueError(
                    f"{var} is not set: start this script with `isthmus run --peers N script.py`, "
                    f"or set {var} (or pass {key}=...)"
                )
        return cls(**values)
