"""Who may do what on a coordinator: the admin credential, per-peer join tokens, revocation.

The run's token (``CoordinatorConfig.token``, ``isthmus coordinator --token``) is the operator's
**admin credential**: it may do everything, including act as any peer (a single-token run, the
embedded coordinator's default, gives it to every peer).

A **join token** names one identity and is derived from the admin credential, so it can be made
offline, without asking the coordinator (``isthmus token new --name NAME``)::

    ij1.<name>.<hex of HMAC-SHA256(admin, "isthmus join v1\\0" + name), first 128 bits>

A join token may register peers and act only for the peers it registered (begin, commit, leave,
heartbeats, checkpoint reports, the rendezvous store), and read the status API, the dashboard
and /metrics; control actions (revoking) need the admin credential. Revoking a name (``isthmus
token revoke NAME``, ``POST /v1/admin/revoke``) refuses its token from then on and evicts its
live peers, without restarting the run. Revocations live in the coordinator's memory: a
restarted coordinator gets them again from ``--revoke NAME`` (see docs/SECURITY.md).

Everything here is pure (no sockets): :class:`Identities` answers questions about tokens and
peer ids, the server acts on the answers.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass

__all__ = [
    "ADMIN",
    "Identities",
    "Identity",
    "join_token",
    "parse_join_token",
    "valid_name",
]

ADMIN = "admin"
"""The admin credential's identity name (no join token can carry it)."""

_PREFIX = "ij1"
_PURPOSE = b"isthmus join v1\0"
_COOKIE_PURPOSE = b"isthmus dashboard session v2\0"
_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}$")


def valid_name(name: str) -> bool:
    """A join token's name: 1-64 of letters, digits, ``_ . -`` (not starting with a dot), and
    not ``admin``."""
    return bool(_NAME.match(name)) and name != ADMIN


def _mac(admin: str, purpose: bytes, name: str) -> str:
    return hmac.new(admin.encode(), purpose + name.encode(), hashlib.sha256).hexdigest()[:32]


def join_token(admin: str, name: str) -> str:
    """The join token of identity ``name`` under the admin credential ``admin``.

    Raises ValueError for an empty admin credential or a name :func:`valid_name` refuses."""
    if not admin:
        raise ValueError("a join token is derived from the admin token: it must not be empty")
    if not valid_name(name):
        raise ValueError(
            f"join token name {name!r}: use 1-64 letters, digits, '_', '.', '-' "
            f"(not starting with '.', and not {ADMIN!r})"
        )
    return f"{_PREFIX}.{name}.{_mac(admin, _PURPOSE, name)}"


def parse_join_token(token: str) -> tuple[str, str] | None:
    """``(name, mac)`` of a string shaped like a join token, or None (not checked)."""
    head, _, rest = token.partition(".")
    name, _, mac = rest.rpartition(".")
    if head != _PREFIX or not valid_name(name) or len(mac) != 32:
        return None
    return name, mac


@dataclass(frozen=True)
class Identity:
    """Who a request comes from."""

    name: str
    admin: bool


class Identities:
    """The run's credentials: checks tokens, ties peer ids to identities, keeps revocations.

    Not thread-safe by itself: the server calls it from its event loop only.
    """

    def __init__(self, admin_token: str, revoked: tuple[str, ...] | list[str] = ()) -> None:
        if not admin_token:
            raise ValueError("the admin token must not be empty")
        self._admin = admin_token
        self.revoked: set[str] = set(revoked)
        self.owner: dict[int, str] = {}
        """Peer id -> the identity that registered it."""
        self._owned: dict[str, set[int]] = {}  # identity -> its peer ids (the inverse of owner)

    # -- tokens -----------------------------------------------------------------------------------
    def check(self, token: str) -> Identity | str:
        """The identity ``token`` proves, or why it proves none (a message for a 401).

        Every comparison is constant-time; a wrong token and a forged join token get the same
        answer, so the answer does not tell which names exist."""
        if not token:
            return "missing token: send 'Authorization: Bearer <token>'"
        if hmac.compare_digest(token.encode(), self._admin.encode()):
            return Identity(ADMIN, True)
        parsed = parse_join_token(token)
        if parsed is not None:
            name, mac = parsed
            if hmac.compare_digest(mac.encode(), _mac(self._admin, _PURPOSE, name).encode()):
                if name in self.revoked:
                    return f"the join token of {name!r} was revoked by the operator"
                return Identity(name, False)
        return "invalid token for this run"

    def token_ok(self, token: str) -> bool:
        """True for the admin token and for join tokens that are not revoked."""
        return isinstance(self.check(token), Identity)

    # -- the dashboard's cookie: per identity, so a revocation ends its sessions too ------------
    def cookie_for(self, token: str) -> str | None:
        """The session cookie's value for a valid ``token`` (None for an invalid one)."""
        who = self.check(token)
        if not isinstance(who, Identity):
            return None
        return f"{who.name}.{_mac(self._admin, _COOKIE_PURPOSE, who.name)}"

    def cookie_ok(self, value: str) -> bool:
        name, _, mac = value.rpartition(".")
        if not name or len(mac) != 32 or name in self.revoked:
            return False
        return hmac.compare_digest(mac.encode(), _mac(self._admin, _COOKIE_PURPOSE, name).encode())

    # -- peers ------------------------------------------------------------------------------------
    def bind(self, pid: int, who: Identity) -> None:
        """Peer ``pid`` was registered by ``who``."""
        old = self.owner.get(pid)
        if old is not None:
            self._owned.get(old, set()).discard(pid)
        self.owner[pid] = who.name
        self._owned.setdefault(who.name, set()).add(pid)

    def may_act_for(self, who: Identity, pid: int) -> bool:
        """May ``who`` send requests in the name of peer ``pid``? The admin may act for anyone
        (single-token runs); a join token only for the peers it registered."""
        return who.admin or self.owner.get(pid) == who.name

    def peers_of(self, name: str) -> list[int]:
        """The peer ids ``name`` registered (live or not), in the order registered."""
        return sorted(self._owned.get(name, ()))

    def revoke(self, name: str) -> list[int]:
        """Refuse ``name``'s join token from now on; returns its peer ids (to evict).

        Raises ValueError for the admin identity (it cannot be revoked: restart the run with a
        new token) or a name no join token can have."""
        if not valid_name(name):
            raise ValueError(
                f"cannot revoke {name!r}: only join tokens' names can be revoked (the admin "
                f"token is changed by restarting the coordinator with a new one)"
            )
        self.revoked.add(name)
        return self.peers_of(name)

    def forget(self, keep: set[int]) -> None:
        """Drop the owners of peer ids not in ``keep`` (peers long gone): bounds the table."""
        self.owner = {pid: n for pid, n in self.owner.items() if pid in keep}
        self._owned = {}
        for pid, n in self.owner.items():
            self._owned.setdefault(n, set()).add(pid)
