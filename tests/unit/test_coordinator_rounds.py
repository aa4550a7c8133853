"""The rounds' held requests (coordinator/rounds.py), in one process: the held table asks each
question once per pass and answers at the deadline with the reason; one waker answers every held
begin and commit of a round when the run changes, votes carried by begins go on to their begins,
and an abandoned request is never answered."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from isthmus.coordinator import protocol as p
from isthmus.coordinator.hub import Hub
from isthmus.coordinator.membership import Membership, MembershipConfig
from isthmus.coordinator.rounds import HeldTable, Rounds, _Ask, _Held
from isthmus.coordinator.wire import encode

SCHEMA = (p.TensorSpec("w", (2,), "torch.float32"),)


def _held(key: Any, answers: list[p.Decision], deadline: float, calls: list[Any]) -> _Held:
    def poll() -> p.Decision:
        calls.append(key)
        return answers[0]

    return _Held(
        key, poll, lambda: p.Wait(reason="why"), deadline, _Ask(lambda d: None, print), print
    )


def test_the_table_asks_a_shared_question_once_and_answers_at_the_deadline() -> None:
    table, calls = HeldTable(), []
    waiting: list[p.Decision] = [p.Wait(reason="")]
    a = table.put(_held(("c", 1, 2), waiting, 5.0, calls))
    table.put(_held(("c", 1, 2), waiting, 6.0, calls))
    c = table.put(_held(("b", 7, "n"), waiting, 7.0, calls))
    assert table.first_deadline() == 5.0 and len(table) == 3
    assert table.decide(now=1.0) == [] and calls == [("c", 1, 2), ("b", 7, "n")]
    table.drop(a)
    table.drop(a)  # twice is nothing
    assert table.first_deadline() == 6.0
    done = table.decide(now=6.0)  # the second one's deadline: answered with its reason
    assert [(h.deadline, d) for h, d in done] == [(6.0, p.Wait(reason="why"))]
    waiting[0] = p.Committed(reason="")
    done = table.decide(now=6.5)
    assert [(h.key, d.kind) for h, d in done] == [(("b", 7, "n"), "committed")]
    assert len(table) == 0 and table.first_deadline() is None
    assert table.decide(now=9.0) == [] and c > a


def _coordinator(poll_s: float = 5.0) -> tuple[Hub, Rounds, list[int]]:
    m = Membership(MembershipConfig(start_peers=3, min_peers=1))
    hub = Hub(m, "run1")
    hub.open()
    pids = [m.register(f"p{i}", hub.now()) for i in range(3)]
    for pid in pids:
        m.heartbeat(pid, hub.now())
    return hub, Rounds(hub, poll_s), pids


def _begin(pid: int, nonce: str, revision: int, prev: p.Vote | None = None) -> p.Begin:
    return p.Begin(pid, nonce, revision, "run1", {"w": "00"}, SCHEMA, prev)


def test_one_waker_answers_a_round_and_votes_go_on_to_their_begins() -> None:
    async def main() -> None:
        hub, rounds, pids = _coordinator()
        got: dict[int, list[p.Decision]] = {pid: [] for pid in pids}

        def submit(msg: p.Begin) -> Any:
            return rounds.submit_begin(msg, got[msg.peer].append, print)

        for pid in pids[:2]:
            submit(_begin(pid, "a", 0))
        assert got == {pids[0]: [], pids[1]: [], pids[2]: []}  # held: the round needs three
        submit(_begin(pids[2], "a", 0))  # forms it: answered at once, the others by the waker
        await asyncio.sleep(0.05)
        plans = {pid: got[pid][0].plan for pid in pids}
        assert all(d.kind == "go" for pid in pids for d in got[pid])
        plan = plans[pids[0]]
        assert plan is not None and all(x is plan for x in plans.values())
        assert len(asyncio.all_tasks()) <= 2  # this test and at most the waker: no task each

        # the vote on that round rides in the next begins; the last vote commits it, and every
        # begin goes on to the next round, which forms at the last of them
        for pid in pids:
            got[pid].clear()
            submit(_begin(pid, "b", plan.round + 1, prev=p.Vote(plan.epoch, plan.round)))
        await asyncio.sleep(0.05)
        assert [[d.kind for d in got[pid]] for pid in pids] == [["go"]] * 3, got
        assert all(got[pid][0].prev == "committed" for pid in pids)
        nxt = got[pids[0]][0].plan
        assert nxt is not None and nxt.round == plan.round + 1
        assert hub.membership.revision == 1 and len(rounds._held) == 0
        # every member's go is encoded once, the same as text and as bytes
        go = got[pids[0]][0]
        assert rounds.utf8(go) is rounds.utf8(got[pids[1]][0])
        assert rounds.utf8(go) == rounds.text(go).encode() == json.dumps(encode(go)).encode()
        wait = p.Decision("wait", "x")
        assert rounds.utf8(wait) == rounds.text(wait).encode()

    asyncio.run(main())


def test_a_held_begin_is_answered_wait_at_the_poll_end_and_an_abandoned_one_never() -> None:
    async def main() -> None:
        _, rounds, pids = _coordinator(poll_s=0.05)
        got: list[p.Decision] = []
        rounds.submit_begin(_begin(pids[0], "a", 0), got.append, print)
        gone = rounds.submit_begin(_begin(pids[1], "a", 0), got.append, print)
        rounds.abandon(gone)
        await asyncio.sleep(0.2)
        assert [d.kind for d in got] == ["wait"] and got[0].reason  # the reason at the end
        assert len(rounds._held) == 0

        # the coroutine form: the same answers, as results
        async def ask(pid: int) -> p.Decision:
            return await rounds.begin(_begin(pid, "b", 0))

        answers = await asyncio.gather(*(ask(pid) for pid in pids))
        assert [d.kind for d in answers] == ["go"] * 3

    asyncio.run(main())


def test_an_error_while_deciding_is_told_to_the_asker() -> None:
    async def main() -> None:
        hub, rounds, pids = _coordinator()
        errors: list[BaseException] = []

        def boom(*a: Any, **k: Any) -> p.Decision:
            raise RuntimeError("a bug")

        hub.membership.begin = boom  # type: ignore[method-assign]
        rounds.submit_begin(_begin(pids[0], "a", 0), print, errors.append)
        assert [str(e) for e in errors] == ["a bug"]

    asyncio.run(main())


def test_a_begins_info_is_recorded_as_a_heartbeat_before_its_vote_and_begin() -> None:
    async def main() -> None:
        hub, rounds, pids = _coordinator()
        seen: list[tuple[str, Any]] = []
        rounds.on_info = lambda pid, info: seen.append(
            ("info", (pid, info, hub.membership.revision))
        )
        vote = hub.membership.commit
        hub.membership.commit = lambda *a, **k: (seen.append(("vote", a[0])), vote(*a, **k))[1]  # type: ignore[method-assign]
        got: list[p.Decision] = []
        msg = _begin(pids[0], "a", 0)
        rounds.submit_begin(msg, got.append, print)  # no info: nothing recorded
        assert seen == []
        with_info = p.Begin(pids[1], "a", 0, "run1", {"w": "00"}, SCHEMA, p.Vote(1, 0), {"step": 2})
        rounds.submit_begin(with_info, got.append, print)
        assert seen[0] == ("info", (pids[1], {"step": 2}, 0)) and seen[1] == ("vote", pids[1])

    asyncio.run(main())
