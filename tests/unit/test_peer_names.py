"""Peer names (isthmus.run.names): bare on one machine, prefixed per machine when launchers join
a coordinator elsewhere, claimed apart by launchers on one machine, stable from one launch to the
next (so a resumed peer finds its local state)."""

from __future__ import annotations

from pathlib import Path

import pytest

from isthmus.checkpoint import slot_of
from isthmus.run.launch import Launcher, Script
from isthmus.run.names import PrefixClaim, check_prefix, machine_prefix, peer_name
from isthmus.run.record import RunDir


def test_names_keep_their_slot_before_the_first_dot() -> None:
    assert [peer_name("", 1), peer_name("", 1, 2)] == ["peer1", "peer1.2"]
    assert [peer_name("lab-a", 0), peer_name("lab-a", 0, 1)] == ["lab-a-peer0", "lab-a-peer0.1"]
    assert slot_of(peer_name("lab-a", 3, 4)) == "lab-a-peer3"
    for bad in ("", "a.b", "-a", "a b", "x" * 41):
        with pytest.raises(ValueError, match="name prefix"):
            check_prefix(bad)


def test_the_machine_prefix_is_stable_and_valid() -> None:
    first = machine_prefix()
    assert first == machine_prefix() == check_prefix(first)


def test_launchers_on_one_machine_claim_prefixes_apart_and_get_theirs_back() -> None:
    where = f"test-{id(object())}:1"
    a, b = PrefixClaim("m", where), PrefixClaim("m", where)
    assert (a.prefix, b.prefix) == ("m", "m-2")
    assert PrefixClaim("m", "another:2").prefix == "m"  # another run's names are its own
    a.release()
    a.release()  # idempotent
    c = PrefixClaim("m", where)
    assert c.prefix == "m"  # the lowest free one: a launcher started again gets its old one
    b.release()
    c.release()


def _launcher(tmp_path: Path, **kw: object) -> Launcher:
    script = tmp_path / "train.py"
    script.write_text("")
    return Launcher(Script(script), run_dir=RunDir(tmp_path), slots=2, **kw)  # type: ignore[arg-type]


def test_a_launcher_names_its_peers(tmp_path: Path) -> None:
    alone = _launcher(tmp_path)
    assert [s.next_name() for s in alone.slots] == ["peer0", "peer1"]
    named = _launcher(tmp_path, name_prefix="site-b")
    assert [s.next_name() for s in named.slots] == ["site-b-peer0", "site-b-peer1"]
    remote = _launcher(tmp_path, coordinator=f"test-{id(object())}:2", token="t")
    assert remote.name_prefix.startswith(machine_prefix())
    assert remote.slots[1].next_name() == f"{remote.name_prefix}-peer1"
    bare = _launcher(tmp_path, coordinator="h:1", token="t", name_prefix="")
    assert bare.slots[0].next_name() == "peer0"  # the bare names, asked for
    with pytest.raises(ValueError, match="name prefix"):
        _launcher(tmp_path, name_prefix="a.b")


def test_a_launcher_that_cannot_start_gives_its_prefix_back(tmp_path: Path) -> None:
    where = f"127.0.0.1:{id(object()) % 60000 + 1}"
    failing = _launcher(
        tmp_path, coordinator=where, token="t", coordinator_fingerprint="not-a-fingerprint"
    )
    with pytest.raises(ValueError, match="fingerprint"):
        failing.run()
    again = PrefixClaim(machine_prefix(), where)
    assert again.prefix == failing.name_prefix  # not "-2": the failed launcher let it go
    again.release()
