"""Fifty protocol-only peers against a real coordinator on loopback (the scale benchmark's
clients, benchmarks/coordinator_swarm.py: registration, heartbeats on the websocket, begin with
hashes, commit): the fan-in of fifty begins and commits forms and commits each round once with
everyone, a peer whose heartbeat connection closes between rounds is left out of the next, and
a member lost inside a round aborts it for all (each told by a push) before the survivors
commit it. Half the peers send begin and commit as frames on their heartbeat websocket
(``ws-rounds``, coordinator/frames.py), half as HTTP requests, in the same rounds; a member dies
while the others' commit frames and requests are held, and each is answered aborted; a
malformed frame is answered 400 naming the field, and its peer goes on. Then the survivors carry each vote in their next begin (``Begin.prev``, one request
per round): a member lost after the others voted that way aborts the round (each carried vote
answered aborted, no begin taken), the survivors form it again in a new epoch and commit it and
the next with no commit request but the last. Checks correctness of the many-waiters path, never
time."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from isthmus.coordinator import protocol as msgs
from isthmus.coordinator.auth import join_token
from isthmus.coordinator.frames import WS_ROUNDS
from isthmus.coordinator.membership import MembershipConfig
from isthmus.coordinator.server import Coordinator, CoordinatorConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from coordinator_swarm import ProtoPeer, SwarmConfig, open_session

TOKEN = "swarm-token"
N = 50


@pytest.fixture
def coord() -> Iterator[Coordinator]:
    cfg = CoordinatorConfig(
        token=TOKEN,
        port=0,
        host="127.0.0.1",
        membership=MembershipConfig(start_peers=N, start_timeout=120.0),
    )
    c = Coordinator(cfg).start()
    yield c
    c.stop()


async def _round(peers: list[ProtoPeer]) -> list[msgs.RoundPlan]:
    """Every peer begins; returns their plans (all must be the same round)."""
    return list(await asyncio.gather(*(p.begin() for p in peers)))


async def _raw_frame(peer: ProtoPeer, frame: dict[str, object]) -> dict[str, object]:
    """Send ``frame`` as it is on ``peer``'s heartbeat socket; returns the reply naming its id."""
    assert peer._ws is not None
    fut: asyncio.Future[dict[str, object]] = asyncio.get_running_loop().create_future()
    peer._replies[int(frame["id"])] = fut  # type: ignore[call-overload]
    await peer._ws.send_json(frame)
    return await asyncio.wait_for(fut, 30)


async def _swarm(c: Coordinator) -> None:
    base = f"http://127.0.0.1:{c.port}"
    async with open_session() as session:
        peers = [
            ProtoPeer(base, join_token(TOKEN, f"s{i:02d}"), f"s{i:02d}", session) for i in range(N)
        ]
        http = SwarmConfig(frames=False)
        for p in peers[1::2]:  # every other peer asks over HTTP, the rest by frames
            p.config = http
        await asyncio.gather(*(p.register() for p in peers))
        await asyncio.gather(*(p.connect() for p in peers))
        assert all(WS_ROUNDS in p.features for p in peers)

        # three rounds, everyone in each: one plan per round, one commit each
        for r in range(3):
            plans = await _round(peers)
            assert {(pl.round, pl.epoch, pl.members) for pl in plans} == {
                (r, 1, tuple(sorted(p.peer_id for p in peers)))
            }
            assert all(
                await asyncio.gather(*(p.commit(pl) for p, pl in zip(peers, plans, strict=True)))
            )
        assert {p.revision for p in peers} == {3}

        # a peer's heartbeat connection closes between rounds: the next round forms without it
        gone = peers.pop()
        await gone.close()
        plans = await _round(peers)
        assert {(pl.round, len(pl.members), pl.new_epoch) for pl in plans} == {(3, N - 1, True)}
        assert gone.peer_id not in plans[0].members
        assert all(
            await asyncio.gather(*(p.commit(pl) for p, pl in zip(peers, plans, strict=True)))
        )

        # a malformed frame is answered 400 naming the field, and the socket stays open
        asker = peers[0]
        assert asker.framed() and not peers[1].framed()
        reply = await _raw_frame(asker, {"type": "begin", "id": 99, "begin": {"peer": 0}})
        assert (reply["id"], reply["status"]) == (99, 400)
        assert "field 'begin.nonce' is missing" in reply["error"]

        # a member dies inside a round while the others' commits (frames and requests) are
        # held: each is answered aborted, each member is pushed the abort, and the survivors
        # retry the same round in a new epoch and commit it
        plans = await _round(peers)
        victim = peers.pop()

        async def die() -> None:
            await asyncio.sleep(0.3)  # the others' commits are held by then
            await victim.close()

        held = [p.commit(pl) for p, pl in zip(peers, plans[:-1], strict=True)]
        outcomes = await asyncio.gather(*held, die())
        assert not any(outcomes[:-1])
        epoch = plans[0].epoch
        for _ in range(200):  # the pushes travel on the websockets, beside the answers
            if all(
                any(isinstance(x, msgs.AbortPush) and x.epoch == epoch for x in p.pushes)
                for p in peers
            ):
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("not every surviving member was pushed the abort")
        plans = await _round(peers)
        assert {(pl.round, pl.epoch, len(pl.members)) for pl in plans} == {(4, epoch + 1, N - 2)}
        assert all(
            await asyncio.gather(*(p.commit(pl) for p, pl in zip(peers, plans, strict=True)))
        )
        assert {p.revision for p in peers} == {5}
        for _ in range(100):  # first heartbeats are spread over one interval
            if all(p.heartbeats >= 2 for p in peers):
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("not every peer sent its heartbeats")
        st = c.status(events=0)
        counters = st["counters"]
        assert st["revision"] == 5
        assert (counters["rounds_committed"], counters["rounds_aborted"]) == (5, 1)
        assert (counters["parity_failures"], counters["evictions"]) == (0, 2)

        # the vote in the next begin: round 5 forms, every member leaves its ok for the next
        # begin, one member dies before sending it; the carried votes are answered aborted and
        # the survivors' next requests form round 5 again without it
        for p in peers:
            p.config = dataclasses.replace(p.config, vote_in_begin=True)
        assert all(p.carries() for p in peers)  # the coordinator lists vote-in-begin
        left = [None] * len(peers)  # run_round's answer when the vote waits for the next begin
        assert await asyncio.gather(*(p.run_round() for p in peers)) == left
        victim = peers.pop()
        await victim.close()
        assert await asyncio.gather(*(p.run_round() for p in peers)) == left[1:]
        await asyncio.gather(*(p.run_until(7) for p in peers))
        assert {(p.revision, p.failures) for p in peers} == {(7, 0)}
        for p in peers:
            assert [(r.round, r.epoch, r.world, r.outcome) for r in p.rounds[-3:]] == [
                (5, epoch + 1, N - 2, "aborted"),
                (5, epoch + 2, N - 3, "committed"),
                (6, epoch + 2, N - 3, "committed"),
            ]
            # one request per round: rounds 5 voted in begins only, round 6 (the last) by commit
            assert [v for v in p.votes if v[2] >= 5 and v[0] == "commit"] == [
                ("commit", epoch + 2, 6)
            ]
            assert {v for v in p.votes if v[0] == "begin"} == {
                ("begin", epoch + 1, 5),
                ("begin", epoch + 2, 5),
            }
        st = c.status(events=0)
        counters = st["counters"]
        assert st["revision"] == 7
        assert (counters["rounds_committed"], counters["rounds_aborted"]) == (7, 2)
        assert (counters["parity_failures"], counters["evictions"]) == (0, 3)
        framed = [p for p in peers if p.config.frames]
        assert framed and all(p.frames_sent > 0 for p in framed)
        assert all(p.frames_sent == 0 for p in peers if not p.config.frames)
        # the heartbeats carried every live peer's info (its step) to the coordinator
        steps = {p["name"]: p["info"].get("step") for p in st["peers"] if p["state"] == "active"}
        assert sorted(steps) == sorted(p.name for p in peers)
        assert all(isinstance(s, int) for s in steps.values())
        await asyncio.gather(*(p.close() for p in peers))


def test_fifty_protocol_peers_form_commit_and_abort_together(coord: Coordinator) -> None:
    asyncio.run(asyncio.wait_for(_swarm(coord), 120))
