"""The authenticated rendezvous over a live coordinator (TLS, join tokens, loopback): torch's
store semantics, a Gloo group formed through it, an abandoned rendezvous cut by its epoch's
wires (not by its timeout), and a token that may not act for the peer refused."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from isthmus.comm.connect import CoordinatorStores, connect_gloo
from isthmus.comm.wires import Wires
from isthmus.coordinator.auth import join_token
from isthmus.coordinator.client import CoordinatorClient
from isthmus.coordinator.server import Coordinator, CoordinatorConfig
from isthmus.coordinator.store_client import CoordinatorStore
from isthmus.coordinator.tls import TLSFiles, self_signed
from support.rendezvous import NEVER, assert_abandoned_rendezvous_is_cut

ADMIN = "store-test-admin"


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    return self_signed(str(tmp_path_factory.mktemp("tls")))


@pytest.fixture
def coord(tls: TLSFiles) -> Iterator[Coordinator]:
    with Coordinator(CoordinatorConfig(token=ADMIN, port=0, tls=tls)) as c:
        yield c


def peer(c: Coordinator, tls: TLSFiles, name: str) -> tuple[CoordinatorClient, int]:
    client = CoordinatorClient(c.address, join_token(ADMIN, name), fingerprint=tls.fingerprint)
    return client, client.register(name).peer_id


def test_store_semantics_over_the_coordinator(coord: Coordinator, tls: TLSFiles) -> None:
    client, pid = peer(coord, tls, "alice")
    try:
        s = CoordinatorStore(client, pid, coord.run_id, timeout_s=5.0)
        p = dist.PrefixStore(f"isthmus/{coord.run_id}/e1/", s)
        p.set("a", b"10.0.0.1 4000")
        assert p.get("a") == b"10.0.0.1 4000"
        assert p.add("n", 2) == 2 and p.add("n", 5) == 7
        assert p.check(["a", "n"]) and not p.check(["a", "zz"])
        assert s.compare_set(f"isthmus/{coord.run_id}/c", b"", b"x") == b"x"
        assert s.compare_set(f"isthmus/{coord.run_id}/c", b"y", b"z") == b"x"
        p.wait(["a"], datetime.timedelta(seconds=1))
        # (torch's PrefixStore does not pass delete_key on to a Python store: called directly)
        assert s.delete_key(f"isthmus/{coord.run_id}/e1//a")  # PrefixStore adds a "/"
        assert not p.check(["a"])
        with pytest.raises(RuntimeError, match="not set within 1s"):
            p.wait(["never"], datetime.timedelta(seconds=1))
        with pytest.raises(RuntimeError, match="start with"):
            s.set("elsewhere/key", b"x")  # only the run's keys
        # a valid token acting for a peer that is not its own
        mallory, _ = peer(coord, tls, "mallory")
        with pytest.raises(RuntimeError, match="may not act for peer"):
            CoordinatorStore(mallory, pid, coord.run_id, timeout_s=5.0).get(
                f"isthmus/{coord.run_id}/e1/n"
            )
        mallory.close()
    finally:
        client.close()


def test_a_gloo_group_forms_through_it_and_an_abandoned_rendezvous_is_cut(
    coord: Coordinator, tls: TLSFiles
) -> None:
    peers = [peer(coord, tls, f"p{r}") for r in range(2)]
    try:
        stores = [CoordinatorStores(c, pid, coord.run_id, timeout_s=NEVER) for c, pid in peers]

        def build(r: int) -> object:
            w = Wires(f"rank {r}")
            store = dist.PrefixStore(f"isthmus/{coord.run_id}/g/", stores[r].take(w, lambda: None))
            pg = connect_gloo(store, r, 2, timeout_s=NEVER, wires=w, hostname="127.0.0.1")
            t = torch.full((4,), float(r + 1))
            pg.allreduce([t]).wait()
            return t

        with ThreadPoolExecutor(2) as pool:
            out = list(pool.map(build, range(2)))
        assert all(torch.equal(t, torch.full((4,), 3.0)) for t in out)

        # rank 1 never comes: rank 0 waits in the rendezvous until its epoch is aborted
        wires = Wires("abandoned")
        store = dist.PrefixStore(
            f"isthmus/{coord.run_id}/lost/", stores[0].take(wires, lambda: None)
        )
        assert_abandoned_rendezvous_is_cut(store, wires)
    finally:
        for c, _ in peers:
            c.close()


def test_a_revoked_token_reads_no_key(coord: Coordinator, tls: TLSFiles, tmp_path: Path) -> None:
    client, pid = peer(coord, tls, "bob")
    admin = CoordinatorClient(coord.address, ADMIN, fingerprint=tls.fingerprint)
    try:
        s = CoordinatorStore(client, pid, coord.run_id, timeout_s=5.0)
        s.set(f"isthmus/{coord.run_id}/k", b"v")
        assert admin.post("/v1/admin/revoke", {"name": "bob"})["evicted"] == [pid]
        with pytest.raises(RuntimeError, match="revoked"):
            s.get(f"isthmus/{coord.run_id}/k")
    finally:
        client.close()
        admin.close()
