"""The peer's client against a real coordinator with begin and commit as websocket frames
(coordinator/frames.py): rounds go as frames once the heartbeat socket is open; a socket that
the coordinator closes while a begin frame is held sends that begin again over HTTP, which
learns the peer was evicted (as the next begin always did); a coordinator that does not list
``ws-rounds`` (an older one) is asked over HTTP only; and a frame naming another peer is
refused without closing the socket. Checks behaviour, never time."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from isthmus.coordinator import protocol as msgs
from isthmus.coordinator.client import CoordinatorClient, CoordinatorError
from isthmus.coordinator.frames import WS_ROUNDS
from isthmus.coordinator.membership import MembershipConfig
from isthmus.coordinator.server import Coordinator, CoordinatorConfig

TOKEN = "frames-token"
SCHEMA = (msgs.TensorSpec("w", (2,), "torch.float32"),)


@pytest.fixture
def coord() -> Iterator[Coordinator]:
    cfg = CoordinatorConfig(
        token=TOKEN, port=0, poll_s=5.0, membership=MembershipConfig(start_peers=2)
    )
    c = Coordinator(cfg).start()
    yield c
    c.stop()


def _until(cond: Callable[[], bool], what: str) -> None:
    for _ in range(200):
        if cond():
            return
        time.sleep(0.05)
    pytest.fail(what)


class _Peer:
    """A registered client with its heartbeat socket open."""

    def __init__(
        self,
        coord: Coordinator,
        name: str,
        interval: float = 0.2,
        info: Callable[[], dict[str, Any]] = dict,
    ) -> None:
        self.client = CoordinatorClient(coord.address, TOKEN, connect_timeout=5)
        self.reg = self.client.register(name)
        self.pushes: list[msgs.Push] = []
        self.client.start_heartbeat(
            self.reg.peer_id, interval, info, self.pushes.append, run_id=self.reg.run_id
        )
        _until(lambda: self.client._ws is not None, f"{name}'s heartbeat socket did not open")

    def begin(self, revision: int) -> msgs.Decision:
        msg = msgs.Begin(
            peer=self.reg.peer_id,
            run=self.reg.run_id,
            nonce=f"{self.reg.peer_id}-{revision}",
            revision=revision,
            schema=SCHEMA,
            hashes={"w": "00"},
        )
        while True:
            d = self.client.call("/v1/begin", msg, msgs.Decision, read_timeout=10)
            if not isinstance(d, msgs.Wait):
                return d

    def commit(self, plan: msgs.RoundPlan, ok: bool = True) -> msgs.Decision:
        msg = msgs.Commit(
            peer=self.reg.peer_id, run=self.reg.run_id, epoch=plan.epoch, round=plan.round, ok=ok
        )
        while True:
            d = self.client.call("/v1/commit", msg, msgs.Decision, read_timeout=10)
            if not isinstance(d, msgs.Wait):
                return d


def _one_round(peers: list[_Peer], revision: int) -> None:
    with ThreadPoolExecutor(len(peers)) as pool:
        go = list(pool.map(lambda p: p.begin(revision), peers))
        assert all(isinstance(d, msgs.Go) for d in go), go
        plan = go[0].plan
        assert plan is not None
        done = list(pool.map(lambda p: p.commit(plan), peers))
    assert all(isinstance(d, msgs.Committed) for d in done), done


def test_rounds_go_as_frames_and_a_dropped_socket_falls_back_to_http(coord: Coordinator) -> None:
    a, b = _Peer(coord, "a"), _Peer(coord, "b")
    try:
        assert WS_ROUNDS in a.reg.features
        _one_round([a, b], 0)
        assert (a.client.frames_sent, b.client.frames_sent) == (2, 2)  # a begin, a commit each
        assert coord.status()["revision"] == 1

        # a frame in another peer's name is refused (403) and the socket stays open
        other = msgs.Commit(peer=b.reg.peer_id, run=b.reg.run_id, epoch=1, round=0, ok=True)
        with pytest.raises(CoordinatorError, match=r"403\): this socket is peer"):
            a.client.call("/v1/commit", other, msgs.Decision)
        _one_round([a, b], 1)
        assert coord.status()["revision"] == 2
        assert a.client.frames_sent == 5  # the refused frame counts

        # a's begin frame is held (b has not begun); the coordinator closes a's socket: the
        # begin goes again over HTTP and is answered evicted, as a dropped socket always meant
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(a.begin, 2)
            _until(lambda: a.client.frames_sent == 6, "a's begin frame was not sent")
            time.sleep(0.1)  # held at the coordinator
            assert not held.done()
            loop = coord._loop
            assert loop is not None
            asyncio.run_coroutine_threadsafe(
                coord.hub.disconnect(a.reg.peer_id, {"type": "evicted", "reason": "test"}), loop
            ).result(10)
            d = held.result(timeout=30)
        assert isinstance(d, msgs.Evicted), d
        assert a.client.frames_sent == 6  # held once (poll_s 5 s), then asked over HTTP
        assert any(isinstance(x, msgs.HeartbeatLost) for x in a.pushes)
        st = coord.status(events=0)
        assert st["counters"]["evictions"] == 1
    finally:
        a.client.close()
        b.client.close()


def test_a_begin_carries_the_heartbeats_info_where_the_coordinator_records_it(
    coord: Coordinator,
) -> None:
    # one heartbeat at the socket's start, the next one a long interval later: the begins
    # sent meanwhile carry the info, which the coordinator records as that heartbeat's
    counts = {"a": 0, "b": 0}

    def info_of(name: str) -> Callable[[], dict[str, Any]]:
        def info() -> dict[str, Any]:
            counts[name] += 1
            return {"calls": counts[name], "step": 7}

        return info

    a, b = _Peer(coord, "a", 30.0, info_of("a")), _Peer(coord, "b", 30.0, info_of("b"))
    try:
        assert msgs.INFO_IN_BEGIN in a.reg.features
        peers = coord.hub.membership.peers
        _until(lambda: peers[a.reg.peer_id].info.get("calls") == 1, "a's first heartbeat")
        _until(lambda: peers[b.reg.peer_id].info.get("calls") == 1, "b's first heartbeat")
        # the begins go within half an interval of that heartbeat: they carry nothing
        _one_round([a, b], 0)
        assert (a.client.infos_in_begins, counts["a"]) == (0, 1)
        a.client._info_at -= 20.0  # as if the heartbeat had gone 20 s (two thirds of 30) ago
        _one_round([a, b], 1)
        assert (a.client.infos_in_begins, b.client.infos_in_begins) == (1, 0)
        assert peers[a.reg.peer_id].info["calls"] == 2  # recorded with the begin
        assert peers[b.reg.peer_id].info["calls"] == 1
        assert counts == {"a": 2, "b": 1}  # no heartbeat went besides: the next is 30 s away
        # a coordinator that does not list the feature (an older one) is never sent the info
        a.client.features = tuple(f for f in a.client.features if f != msgs.INFO_IN_BEGIN)
        a.client._info_at -= 20.0
        _one_round([a, b], 2)
        assert a.client.infos_in_begins == 1 and counts["a"] == 2
        assert coord.status()["revision"] == 3
    finally:
        a.client.close()
        b.client.close()


def test_a_coordinator_without_frames_is_asked_over_http(coord: Coordinator) -> None:
    coord.features = (msgs.VOTE_IN_BEGIN,)  # what a coordinator from before frames lists
    a, b = _Peer(coord, "a"), _Peer(coord, "b")
    try:
        assert WS_ROUNDS not in a.reg.features
        _one_round([a, b], 0)
        assert (a.client.frames_sent, b.client.frames_sent) == (0, 0)
        assert coord.status()["revision"] == 1
    finally:
        a.client.close()
        b.client.close()


def test_begins_carry_a_digest_and_send_lists_only_where_the_states_differ() -> None:
    """Three real clients (one of them acting as an older peer, which sends lists): a round in
    which everyone holds one state asks for no list; a round with a corrupt peer asks for its
    list and one list of the majority, and repairs it as the check over every list would."""
    cfg = CoordinatorConfig(
        token=TOKEN, port=0, poll_s=5.0, membership=MembershipConfig(start_peers=3)
    )
    coord = Coordinator(cfg).start()
    peers = [_Peer(coord, n) for n in ("a", "b", "c")]
    a, b, c = peers
    good = {"w": "00"}

    def begin(p: _Peer, revision: int, hashes: dict[str, str]) -> msgs.Decision:
        # as the session does: schema on the first begin, the hashes again when asked
        msg = msgs.Begin(
            peer=p.reg.peer_id,
            run=p.reg.run_id,
            nonce=f"{p.reg.peer_id}-{revision}",
            revision=revision,
            schema=SCHEMA if revision == 0 else None,
            hashes=hashes,
        )
        while True:
            d = p.client.call("/v1/begin", msg, msgs.Decision, read_timeout=10)
            msg = dataclasses.replace(msg, schema=None, hashes=None)
            if isinstance(d, msgs.SendHashes):
                msg = dataclasses.replace(msg, hashes=hashes)
            elif not isinstance(d, msgs.Wait):
                return d

    def round_of(revision: int, states: dict[str, dict[str, str]]) -> msgs.RoundPlan:
        with ThreadPoolExecutor(3) as pool:
            go = list(pool.map(lambda p: begin(p, revision, states[p.reg.peer_id]), peers))
            assert all(isinstance(d, msgs.Go) for d in go), go
            plan = go[0].plan
            assert plan is not None
            done = list(pool.map(lambda p: p.commit(plan), peers))
        assert all(isinstance(d, msgs.Committed) for d in done), done
        return plan

    def asked() -> list[dict[str, Any]]:
        return [e for e in coord.events() if e["kind"] == "hash_lists"]

    try:
        assert msgs.HASH_DIGEST in a.reg.features
        c.client.features = tuple(f for f in c.client.features if f != msgs.HASH_DIGEST)
        same = {p.reg.peer_id: good for p in peers}
        assert round_of(0, same).transfers == ()  # first begins: lists, with the schema
        assert round_of(1, same).transfers == () and asked() == []  # digests agree
        bad = {**same, b.reg.peer_id: {"w": "XX"}}
        plan = round_of(2, bad)
        (t,) = plan.transfers
        assert (t.dst, t.names) == (b.reg.peer_id, ("w",)) and plan.expected == {"w": "00"}
        (e,) = asked()
        # b's list, and one list of the majority: c sent its list already (an older peer)
        assert e["peers"] == [b.reg.peer_id] and e["count"] == 1
        assert coord.status()["counters"]["parity_failures"] == 1
        assert round_of(3, same).transfers == ()  # repaired: one state again
        assert len(asked()) == 1
    finally:
        for p in peers:
            p.client.close()
        coord.stop()
