"""The coordinator's wire types: what the server and the peers' sessions say to each other.

Both sides import this module and nothing else of the other: the server's state machine
(:mod:`isthmus.coordinator.membership`) builds these values and the server sends their JSON; the
peer side (:mod:`isthmus.comm.session`, ``state``, ``transfer``) reads them back with the
``from_json`` constructors here, so each JSON round trip is written once. docs/PROTOCOL.md
describes the requests that carry them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Decision", "RestorePoint", "RoundPlan", "TensorSpec", "Transfer", "schema_mismatch"]


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one shared tensor. All peers of a run must agree on the list."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def to_json(self) -> list[Any]:
        return [self.name, list(self.shape), self.dtype]

    @staticmethod
    def from_json(x: Any) -> TensorSpec:
        """Inverse of :meth:`to_json`; raises ValueError or TypeError for a malformed entry."""
        name, shape, dtype = x
        return TensorSpec(str(name), tuple(int(s) for s in shape), str(dtype))


def schema_mismatch(run: list[TensorSpec], peer: list[TensorSpec]) -> str | None:
    """Describe the first difference between the run's shared-state schema and a peer's, or None."""
    run_by_name = {s.name: s for s in run}
    peer_by_name = {s.name: s for s in peer}
    for s in run:
        p = peer_by_name.get(s.name)
        if p is None:
            return f"tensor {s.name!r} (shape {list(s.shape)}, {s.dtype}) is missing on this peer"
        if p.shape != s.shape:
            return (
                f"tensor {s.name!r} has shape {list(p.shape)} on this peer but "
                f"{list(s.shape)} in the run"
            )
        if p.dtype != s.dtype:
            return f"tensor {s.name!r} has dtype {p.dtype} on this peer but {s.dtype} in the run"
    for p in peer:
        if p.name not in run_by_name:
            return f"tensor {p.name!r} exists on this peer but not in the run"
    if [s.name for s in run] != [p.name for p in peer]:
        return "shared tensors are registered in a different order than in the run"
    return None


@dataclass(frozen=True)
class Transfer:
    """``dst`` must receive tensors ``names`` from ``src`` (peer ids) before the round's work."""

    src: int
    dst: int
    names: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"src": self.src, "dst": self.dst, "names": list(self.names)}

    @staticmethod
    def from_json(x: dict[str, Any]) -> Transfer:
        """Inverse of :meth:`to_json`; raises KeyError, ValueError or TypeError if malformed."""
        return Transfer(int(x["src"]), int(x["dst"]), tuple(str(n) for n in x["names"]))


@dataclass(frozen=True)
class RoundPlan:
    """Everything a member needs to run one round."""

    round: int
    epoch: int
    members: tuple[int, ...]  # peer ids; a member's rank is its index
    transfers: tuple[Transfer, ...]
    expected: dict[str, str]  # canonical hash of every transferred tensor
    new_epoch: bool
    stale: tuple[int, ...] = ()
    """Members whose local work must not count although they need no transfer: a peer repaired
    in an attempt of this round that aborted, or one registered after the run started (a new
    peer id) that has not been in a committed round yet."""

    def rank_of(self, peer_id: int) -> int:
        return self.members.index(peer_id)

    @property
    def resynced(self) -> frozenset[int]:
        """Peers whose local contribution is stale and must not count: repaired in this round,
        or :attr:`stale`."""
        return frozenset(t.dst for t in self.transfers) | frozenset(self.stale)

    def to_json(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "epoch": self.epoch,
            "members": list(self.members),
            "transfers": [t.to_json() for t in self.transfers],
            "expected": dict(self.expected),
            "new_epoch": self.new_epoch,
            "stale": list(self.stale),
        }

    @staticmethod
    def from_json(x: dict[str, Any]) -> RoundPlan:
        """Inverse of :meth:`to_json` (a ``go`` decision's plan). Raises KeyError, ValueError or
        TypeError for a malformed plan; the session treats that as a protocol error."""
        return RoundPlan(
            round=int(x["round"]),
            epoch=int(x["epoch"]),
            members=tuple(int(m) for m in x["members"]),
            transfers=tuple(Transfer.from_json(t) for t in x["transfers"]),
            expected=dict(x["expected"]),
            new_epoch=bool(x["new_epoch"]),
            stale=tuple(int(m) for m in x.get("stale", ())),
        )


@dataclass(frozen=True)
class RestorePoint:
    """The complete checkpoint a run continues from when no live peer holds its state: the
    checkpoint root ``url`` (every peer must be able to read it) and its ``revision``."""

    url: str
    revision: int

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "revision": self.revision}

    @staticmethod
    def from_json(x: dict[str, Any]) -> RestorePoint:
        """Inverse of :meth:`to_json`; raises KeyError, ValueError or TypeError if malformed."""
        return RestorePoint(str(x["url"]), int(x["revision"]))


@dataclass(frozen=True)
class Decision:
    """Answer to begin or commit. ``kind`` is one of:

    wait (ask again), go (plan), hashes (send your hashes and ask again), refused (schema
    mismatch; do not retry), evicted (this peer id is gone; register again), finished (every
    member left after the last round: there is no state to join), restore (no live peer holds
    the run's state: load the shared state of checkpoint ``restore`` and ask again), committed,
    aborted.
    """

    kind: str
    reason: str = ""
    plan: RoundPlan | None = None
    restore: RestorePoint | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind, "reason": self.reason}
        if self.plan is not None:
            d["plan"] = self.plan.to_json()
        if self.restore is not None:
            d["restore"] = self.restore.to_json()
        return d
