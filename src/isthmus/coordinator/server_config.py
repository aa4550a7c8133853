"""How one coordinator is set up: where it listens, its credentials and TLS, its limits, and the
rules of its run (:class:`CoordinatorConfig`). Checked when made: a bad value raises ValueError
naming it."""

from __future__ import annotations

from dataclasses import dataclass, field

from isthmus.coordinator.limits import Limits
from isthmus.coordinator.peers import MembershipConfig
from isthmus.coordinator.protocol import RestorePoint
from isthmus.coordinator.stragglers import StragglerConfig
from isthmus.coordinator.tls import TLSFiles

__all__ = ["CoordinatorConfig"]


@dataclass(kw_only=True)
class CoordinatorConfig:
    """Where the coordinator listens and the rules of the run."""

    token: str
    """The admin credential: required; use a long random string. Peers may present it (a
    single-token run) or a join token derived from it (see :mod:`isthmus.coordinator.auth`)."""
    tls: TLSFiles | None = None
    """Serve everything over TLS with this certificate (None: plain HTTP)."""
    rendezvous: str = "coordinator"
    """Where process groups meet: ``coordinator`` (the authenticated store of this API) or
    ``tcpstore`` (torch's TCPStore on ``store_port``: no authentication; for comparison)."""
    limits: Limits = field(default_factory=Limits)
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    """When a peer's reported timings make it a straggler, and the policy then."""
    revoked: tuple[str, ...] = ()
    """Join token names refused from the start (revocations survive a restart this way)."""
    host: str = "127.0.0.1"
    """Address to listen on. Use 0.0.0.0 (and a firewall) to accept peers from other hosts."""
    port: int = 29400
    """HTTP port; 0 picks a free one (see :attr:`Coordinator.port`)."""
    store_port: int = 0
    """Port of the rendezvous TCPStore; 0 picks a free one."""
    membership: MembershipConfig = field(default_factory=MembershipConfig)
    checkpoint_dir: str | None = None
    """Where the run's checkpoints go (shown in ``/v1/status``; peers write them)."""
    restore_from: RestorePoint | None = None
    """A complete checkpoint the run continues from (``isthmus coordinator --resume DIR``):
    peers without one of their own load it before their first round. Later checkpoints the
    peers write replace it; whenever no live peer holds the run's state, it restarts from the
    latest (see :mod:`isthmus.coordinator.membership`)."""
    heartbeat_interval: float = 1.0
    """How often peers should send heartbeats (told to them at registration)."""
    poll_s: float = 2.0
    """How long a begin/commit request is held before answering ``wait``."""
    tick_s: float = 0.1
    """How often timeouts are checked."""
    metrics_port: int | None = None
    """Also serve ``/metrics`` on this port *without* the token (0 picks a free one; None: only
    on the main port, behind the token). Bind it where only your monitoring can reach it."""
    metrics_host: str | None = None
    """Address of ``metrics_port`` (default: ``host``)."""

    def __post_init__(self) -> None:
        if not self.token:
            raise ValueError("a coordinator needs a non-empty token (peers must present it)")
        if self.rendezvous not in ("coordinator", "tcpstore"):
            raise ValueError(
                f"rendezvous must be 'coordinator' or 'tcpstore', not {self.rendezvous!r}"
            )
        if not 0 <= self.port < 65536 or not 0 <= self.store_port < 65536:
            raise ValueError(f"ports must be in 0..65535, got {self.port} and {self.store_port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in 0..65535, got {self.metrics_port}")
        if self.heartbeat_interval <= 0 or self.poll_s <= 0 or self.tick_s <= 0:
            raise ValueError("heartbeat_interval, poll_s and tick_s must be positive")
        if self.heartbeat_interval * 2 > self.membership.heartbeat_timeout:
            raise ValueError(
                f"heartbeat_timeout ({self.membership.heartbeat_timeout}s) must be at least twice "
                f"heartbeat_interval ({self.heartbeat_interval}s), or live peers get evicted"
            )
