"""Peers and coordinators of two protocol versions refuse each other with a message that names
both versions, over real sockets: a peer process of the next version, a peer of a release from
before versions (no version sent), a websocket of another version, and a coordinator that sends
no version."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from collections.abc import Iterator

import aiohttp
import pytest
from aiohttp import web

from isthmus.comm.session import Session, SessionConfig
from isthmus.coordinator.client import IncompatibleProtocol
from isthmus.coordinator.server import Coordinator, CoordinatorConfig
from isthmus.coordinator.wire import PROTOCOL_VERSION, UNVERSIONED

TOKEN = "protocol-version-test"
NEXT = PROTOCOL_VERSION + 1


@pytest.fixture
def coord() -> Iterator[Coordinator]:
    c = Coordinator(CoordinatorConfig(token=TOKEN, port=0)).start()
    try:
        yield c
    finally:
        c.stop()


def test_a_peer_process_of_the_next_version_is_refused_naming_both(coord: Coordinator) -> None:
    script = textwrap.dedent(
        f"""
        import isthmus.coordinator.client as client
        from isthmus.comm.session import Session, SessionConfig
        client.PROTOCOL_VERSION = {NEXT}  # this peer speaks the next version
        try:
            Session(SessionConfig(coordinator="{coord.address}", token="{TOKEN}"))
        except client.IncompatibleProtocol as e:
            print("REFUSED:", e)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert (
        f"refused this peer: peer speaks isthmus protocol {NEXT}, coordinator speaks "
        f"{PROTOCOL_VERSION}; upgrade one of them"
    ) in out.stdout, out.stdout + out.stderr
    assert coord.status()["peers"] == []  # nobody was registered
    # the coordinator goes on serving a peer of its own version
    with Session(SessionConfig(coordinator=coord.address, token=TOKEN)) as s:
        assert s.peer_id == 0


def test_a_peer_that_sends_no_version_gets_426_naming_both(coord: Coordinator) -> None:
    req = urllib.request.Request(
        f"http://{coord.address}/v1/register",
        data=json.dumps({"name": "old"}).encode(),
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 426 and e.value.headers["Upgrade"] == f"isthmus/{PROTOCOL_VERSION}"
    body = json.loads(e.value.read())
    assert body["protocol"] == PROTOCOL_VERSION
    assert body["error"].startswith(f"peer speaks isthmus protocol {UNVERSIONED} (it sends no")
    assert body["error"].endswith(f"coordinator speaks {PROTOCOL_VERSION}; upgrade one of them")


def test_a_heartbeat_socket_of_another_version_is_told_why_and_closed(coord: Coordinator) -> None:
    with Session(SessionConfig(coordinator=coord.address, token=TOKEN)) as s:

        async def connect() -> list[dict]:
            url = f"http://{coord.address}/v1/ws?peer={s.peer_id}&run={s.run_id}&protocol={NEXT}"
            headers = {"Authorization": f"Bearer {TOKEN}"}
            async with (
                aiohttp.ClientSession(headers=headers) as http,
                http.ws_connect(url) as ws,
            ):
                return [m.json() async for m in ws if m.type == aiohttp.WSMsgType.TEXT]

        (push,) = asyncio.run(connect())
        assert push["type"] == "evicted"
        assert push["reason"] == (
            f"peer speaks isthmus protocol {NEXT}, coordinator speaks {PROTOCOL_VERSION}; "
            "upgrade one of them"
        )
        # the refused socket did not replace the session's own: it is still a live peer
        (peer,) = coord.status()["peers"]
        assert peer["state"] == "active"


def test_a_coordinator_that_sends_no_version_is_refused_naming_both() -> None:
    """A coordinator from before versions answers register without one (and accepts the peer):
    the peer refuses it."""

    async def register(request: web.Request) -> web.Response:
        return web.json_response(
            {"peer_id": 0, "run_id": "0ld", "store_port": 1, "heartbeat_interval": 1.0}
        )

    ready: asyncio.Queue[int] = asyncio.Queue()

    async def serve(done: asyncio.Event) -> None:
        app = web.Application()
        app.router.add_post("/v1/register", register)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        await ready.put(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        await done.wait()
        await runner.cleanup()

    async def main() -> str:
        done = asyncio.Event()
        server = asyncio.ensure_future(serve(done))
        port = await ready.get()
        try:
            cfg = SessionConfig(coordinator=f"127.0.0.1:{port}", token=TOKEN, connect_timeout=5)
            with pytest.raises(IncompatibleProtocol) as e:
                await asyncio.to_thread(Session, cfg)
            return str(e.value)
        finally:
            done.set()
            await server

    msg = asyncio.run(main())
    assert f"coordinator speaks isthmus protocol {UNVERSIONED} (it sends no version" in msg
    assert msg.endswith(f"peer speaks {PROTOCOL_VERSION}; upgrade one of them")


def test_a_vote_carried_in_a_begin_is_recorded_as_a_commit_and_answered_with_its_outcome() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from isthmus.coordinator import protocol as msgs
    from isthmus.coordinator.client import CoordinatorClient
    from isthmus.coordinator.membership import MembershipConfig

    config = CoordinatorConfig(
        token=TOKEN, port=0, poll_s=0.2, membership=MembershipConfig(start_peers=2)
    )
    coord = Coordinator(config).start()
    clients = [CoordinatorClient(coord.address, TOKEN) for _ in range(2)]
    try:
        regs = [c.register(f"p{i}") for i, c in enumerate(clients)]
        assert all(msgs.VOTE_IN_BEGIN in r.features for r in regs)
        schema = (msgs.TensorSpec("w", (2,), "torch.float32"),)

        def ask(i: int, msg: msgs.Begin) -> msgs.Decision:
            while True:  # a held request is asked again with the same message, as peers do
                d = clients[i].call("/v1/begin", msg, msgs.Decision)
                if not isinstance(d, msgs.Wait):
                    return d

        def begin(i: int, revision: int, prev: msgs.Vote | None) -> msgs.Begin:
            first = prev is None
            return msgs.Begin(
                peer=regs[i].peer_id, run=regs[i].run_id, nonce=f"{i}-{revision}",
                revision=revision, schema=schema if first else None,
                hashes={"w": "00"}, prev=prev,
            )  # fmt: skip

        with ThreadPoolExecutor(2) as pool:
            go = list(pool.map(lambda i: ask(i, begin(i, 0, None)), range(2)))
            plan = go[0].plan
            assert plan is not None and all(isinstance(d, msgs.Go) for d in go)
            assert go[0].prev == ""  # no vote was carried
            # both carry their ok for round 0 in the begin of round 1: one request each
            vote = msgs.Vote(epoch=plan.epoch, round=0)
            go = list(pool.map(lambda i: ask(i, begin(i, 1, vote)), range(2)))
            assert all(isinstance(d, msgs.Go) and d.prev == "committed" for d in go), go
            nxt = go[0].plan
            assert nxt is not None and nxt.round == 1 and coord.status()["revision"] == 1
            # p1 fails round 1 while p0's vote rides in its begin of round 2: p0 is told
            # aborted, and no begin of round 2 was taken from it
            held = pool.submit(ask, 0, begin(0, 2, msgs.Vote(epoch=nxt.epoch, round=1)))
            failed = msgs.Commit(
                peer=regs[1].peer_id, run=regs[1].run_id, epoch=nxt.epoch, round=1, ok=False
            )
            assert isinstance(clients[1].call("/v1/commit", failed, msgs.Decision), msgs.Aborted)
            d = held.result(timeout=30)
        assert isinstance(d, msgs.Aborted) and d.prev == "", d
        st = coord.status()
        assert st["revision"] == 1 and st["counters"]["rounds_committed"] == 1
        assert st["counters"]["rounds_aborted"] == 1
    finally:
        for c in clients:
            c.close()
        coord.stop()
