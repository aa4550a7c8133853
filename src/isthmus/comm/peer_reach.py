"""A peer's part in the partition rule: its probe listener, the probes the coordinator asks for,
and naming the members it could not reach when an attempt fails.

:class:`PeerReach` belongs to a :class:`~isthmus.comm.session.Session`. It opens a
:class:`~isthmus.comm.reach.ProbeListener` on the address this peer's Gloo device binds (sent
with ``register``, so the coordinator can put it into round plans and ask others to probe it),
runs the probes the coordinator pushes (:class:`~isthmus.coordinator.protocol.ProbePush`) on
threads and hands their outcomes to the next heartbeat, and turns a failed attempt into the
``unreached`` entries of its failure report:

1. what the error names itself (``CollectiveError.unreached``: a stalled connection's remote,
   or the members an epoch could not connect to), when it maps to members (an address is
   mapped by its host, which must be one member's alone);
2. else, unless the coordinator aborted the epoch (the failure then came from elsewhere), a
   probe of every other member of the round, in parallel, bounded by ``probe_timeout``.

The remote that Gloo's own texts name (``Connection reset by peer [10.0.0.4]:41234``) is not
taken at its word: a member that aborts cuts its connections, and the others then read exactly
that text about a member that is fine. A probe tells the two apart.

Nothing here raises: a listener that cannot bind means no probes (logged once), and a failure
that names nobody is reported without names.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

from isthmus.comm.reach import ProbeListener, local_address, probe, probe_all
from isthmus.comm.session_config import SessionConfig
from isthmus.coordinator.partition import How
from isthmus.coordinator.protocol import ProbePush, RoundPlan, Unreached

__all__ = ["PeerReach", "named_unreached", "plan_addresses"]

log = logging.getLogger("isthmus.session")


def plan_addresses(plan: RoundPlan, peer_id: int) -> dict[int, str]:
    """The probe listeners of ``plan``'s other members (peer id -> ``host:port``)."""
    out: dict[int, str] = {}
    for k, a in (plan.reach or {}).items():
        if k.isdigit() and int(k) != peer_id and int(k) in plan.members:
            out[int(k)] = a
    return out


_RANKED = re.compile(r"rank (\d+) at (\S+)")
"""How a group names the remote of a connection (``comm/connect.py`` labels each socket so)."""


def _host(address: str) -> str:
    return address.rpartition(":")[0].strip("[]")


class PeerReach:
    """See the module doc. ``coordinator``: the coordinator's address (the route to it picks
    the local address when neither ``hostname`` nor ``interface`` is given)."""

    def __init__(
        self,
        *,
        coordinator: str,
        hostname: str | None,
        interface: str | None,
        probe_timeout: float,
        owner: str,
    ) -> None:
        self.owner = owner
        self.probe_timeout = probe_timeout
        self.source = local_address(coordinator, hostname=hostname, interface=interface)
        self.listener: ProbeListener | None = None
        try:
            self.listener = ProbeListener(self.source)
        except OSError as e:
            log.warning(
                "%s: no probe listener on %s (%s); probes of it fail", owner, self.source, e
            )
        self._lock = threading.Lock()
        self._outcomes: list[dict[str, Any]] = []
        self._isolated = ""

    @classmethod
    def for_session(cls, config: SessionConfig, owner: str) -> PeerReach:
        """The one of a session with ``config`` (named ``owner`` in logs)."""
        return cls(
            coordinator=config.coordinator,
            hostname=config.hostname,
            interface=config.interface,
            probe_timeout=config.probe_timeout,
            owner=owner,
        )

    @property
    def address(self) -> str | None:
        """This peer's probe listener, ``host:port`` (None: none)."""
        return None if self.listener is None else self.listener.address

    def waiting(self, reason: str) -> bool:
        """A begin was answered ``wait`` for ``reason``: True when it is an ``isolated: ...``
        one (the peer waits in it until it is taken back, so the wait does not count against
        ``round_timeout``), logged once per reason."""
        if not reason.startswith("isolated:"):
            return False
        if reason != self._isolated:
            self._isolated = reason
            log.warning("%s sits out: %s", self.owner, reason)
        return True

    # -- probes the coordinator asks for -------------------------------------------------------
    def on_push(self, msg: ProbePush) -> None:
        """Probe ``msg.address`` on a thread; its outcome rides on the next heartbeat."""
        threading.Thread(
            target=self._probe, args=(msg.peer, msg.address), daemon=True, name="isthmus-probe"
        ).start()

    def _probe(self, peer: int, address: str) -> None:
        try:
            how = probe(address, timeout_s=self.probe_timeout, source=self.source)
        except (ValueError, OSError) as e:
            log.warning("%s: cannot probe %s: %s", self.owner, address, e)
            return
        out: dict[str, Any] = {"peer": peer, "ok": how is None}
        if how is not None:
            out["how"] = how.value
        with self._lock:
            self._outcomes.append(out)

    def add_outcome(self, outcome: dict[str, Any]) -> None:
        """An outcome made elsewhere (an island's rank-to-rank probe) for the next heartbeat."""
        with self._lock:
            self._outcomes.append(outcome)

    def take_outcomes(self) -> list[dict[str, Any]]:
        """The probe outcomes since the last call (for a heartbeat's ``probes``)."""
        with self._lock:
            out, self._outcomes = self._outcomes, []
        return out

    # -- naming who failed ---------------------------------------------------------------------
    def unreached(
        self, plan: RoundPlan, peer_id: int, error: BaseException, *, aborted: bool
    ) -> tuple[Unreached, ...]:
        """The members this peer could not reach in the failed attempt ``plan`` (see the module
        doc; logged when there are any); ``aborted``: the coordinator aborted the epoch (do not
        probe)."""
        found = self._unreached(plan, peer_id, error, aborted=aborted)
        if found:
            log.warning(
                "%s: round %d: cannot reach %s",
                self.owner,
                plan.round,
                ", ".join(f"peer {u.peer} at {u.address} ({u.how})" for u in found),
            )
        return found

    def _unreached(
        self, plan: RoundPlan, peer_id: int, error: BaseException, *, aborted: bool
    ) -> tuple[Unreached, ...]:
        addresses = plan_addresses(plan, peer_id)
        named = getattr(error, "unreached", ())
        found: list[Unreached] = []
        for entry in named or ():
            try:
                u = named_unreached(entry, plan, addresses)
            except (TypeError, ValueError):  # an entry of a shape this peer does not know
                continue
            if u is not None:
                found.append(u)
        if found:
            return tuple(found)
        # nothing named, or only addresses that no one member's host matches: probes tell
        if aborted or not addresses:
            return ()
        return tuple(
            Unreached(m, a, how.value)
            for m, a, how in probe_all(addresses, timeout_s=self.probe_timeout, source=self.source)
        )

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None


def named_unreached(entry: Any, plan: RoundPlan, addresses: dict[int, str]) -> Unreached | None:
    """One entry of ``CollectiveError.unreached``: ``(peer id, address, How)``, a stalled
    connection's remote as the group names it (``rank R at host:port``: the member of rank
    R in this round), or an address ``host:port``, mapped to the member by its host."""
    if isinstance(entry, tuple) and len(entry) == 3:
        member, address, how = entry
        if isinstance(member, int) and member in plan.members:
            return Unreached(member, str(address), How(how).value)
        return None
    ranked = _RANKED.fullmatch(entry) if isinstance(entry, str) else None
    if ranked is not None:
        rank = int(ranked.group(1))
        if rank < len(plan.members):
            member = plan.members[rank]  # a plan lists its members in rank order
            return Unreached(member, addresses.get(member, ranked.group(2)), How.STALLED.value)
        return None
    if isinstance(entry, str):
        member = _by_host(_host(entry), addresses)
        if member is not None:
            return Unreached(member, addresses[member], How.STALLED.value)
    return None


def _by_host(host: str, addresses: dict[int, str]) -> int | None:
    """The one member whose probe listener is on ``host`` (None: none, or several)."""
    hits = [m for m, a in addresses.items() if _host(a) == host]
    return hits[0] if len(hits) == 1 else None
