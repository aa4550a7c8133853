"""Gloo rendezvous helpers for the integration tests: a timeout that never ends a wait, and an
abandoned rendezvous that must be cut. Nothing connects at import; the helpers connect when
called."""

from __future__ import annotations

from typing import Any

import pytest

from isthmus.comm.connect import Connecting, Graveyard, connect_gloo
from isthmus.comm.group import CollectiveError
from isthmus.comm.wires import Wires

# Far longer than any test may run: whatever ends a wait here, it is not this timeout.
NEVER = 600.0


def assert_abandoned_rendezvous_is_cut(store: Any, wires: Wires) -> None:
    """Rank 0 of a two-rank Gloo group connects through ``store`` and rank 1 never comes: the
    wait is abandoned after 20 polls and must raise :class:`CollectiveError` ("aborted while
    connecting"); the attempt, parked in a :class:`Graveyard`, must then drain within 60 s
    (its store wait was cut). Fails the calling test otherwise."""
    attempt = Connecting(
        lambda: connect_gloo(store, 0, 2, timeout_s=NEVER, wires=wires, hostname="127.0.0.1"),
        wires,
        name="connect-abandoned",
    )
    calls: list[int] = []

    def abandon() -> str | None:
        calls.append(1)
        return "epoch aborted while connecting" if len(calls) > 20 else None

    with pytest.raises(CollectiveError, match="aborted while connecting"):
        attempt.wait(abandon)
    yard = Graveyard()
    yard.park(attempt)
    assert yard.drain(60.0) == 0, "the abandoned rendezvous is still busy inside torch"
