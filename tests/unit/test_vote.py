"""The pipelined commit's pure parts: the undo copy, and the background vote against a scripted
coordinator (no sockets: the client is a fake that answers from a list)."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from isthmus.comm.state import SharedState, tensor_bytes
from isthmus.comm.vote import PendingVote, UndoCopy, VoteAhead
from isthmus.coordinator import protocol as msgs
from isthmus.coordinator.protocol import RoundPlan


def _state() -> SharedState:
    s = SharedState()
    g = torch.Generator().manual_seed(0)
    s.register("global/w", torch.randn(5, 7, generator=g))
    s.register("outer/m", torch.randn(35, generator=g, dtype=torch.float64))
    s.register("global/half", torch.randn(3, generator=g).to(torch.bfloat16))
    s.register("meta/step", torch.tensor(41))
    return s


def _bits(s: SharedState) -> dict[str, bytes]:
    return {n: bytes(tensor_bytes(t)) for n, t in s.items()}


def test_the_undo_copy_restores_every_tensor_bit_for_bit_and_reuses_its_buffers() -> None:
    s = _state()
    s["global/w"].requires_grad_(True)  # a global copy the outer optimizer steps
    before = _bits(s)
    undo = UndoCopy()
    undo.take(s)
    bufs = {n: b.data_ptr() for n, b in undo._bufs.items()}
    with torch.no_grad():  # a tentative round's result: every tensor moves
        s["global/w"].add_(1e-7)
        s["outer/m"].mul_(-3.0)
        s["global/half"].fill_(float("nan"))
        s["meta/step"].add_(1)
    assert _bits(s) != before
    undo.restore(s)
    assert _bits(s) == before
    assert s["global/w"].requires_grad  # the same tensor objects, written in place
    # the next round's copy reuses the buffers: no allocation per round
    undo.take(s)
    assert {n: b.data_ptr() for n, b in undo._bufs.items()} == bufs


def test_the_undo_copy_refuses_a_state_registered_again_since() -> None:
    s = _state()
    undo = UndoCopy()
    undo.take(s)
    s.register("later", torch.zeros(2))
    with pytest.raises(RuntimeError, match="registered again"):
        undo.restore(s)


class _Coordinator:
    """Answers each path from its own list, in order; records every request it got."""

    def __init__(self, answers: dict[str, list[msgs.Decision]]) -> None:
        self.answers = answers
        self.got: list[tuple[str, Any]] = []

    def call(self, path: str, msg: Any, answer: type, *, read_timeout: float) -> msgs.Decision:
        self.got.append((path, msg))
        return self.answers[path].pop(0)


PLAN = RoundPlan(round=7, epoch=3, members=(1, 2), transfers=(), expected={}, new_epoch=False)
VOTE = msgs.Commit(peer=1, run="r", epoch=3, round=7, ok=True)


def _begin(hashes: dict[str, str] | None) -> msgs.Begin:
    return msgs.Begin(peer=1, run="r", nonce="n8", revision=8, hashes=hashes)


def _run(fake: _Coordinator, begin: msgs.Begin | None) -> PendingVote:
    v = PendingVote(PLAN, 0.0, timeout=5.0)
    v.start(fake, VOTE)  # type: ignore[arg-type]
    assert v.decided.wait(5.0)
    v.prepare(begin)
    assert v.done.wait(5.0)
    return v


def test_a_committed_vote_is_followed_by_the_next_begin_with_its_hashes_once() -> None:
    go = msgs.Go(plan=PLAN)
    fake = _Coordinator(
        {
            "/v1/commit": [msgs.Wait(), msgs.Committed()],
            "/v1/begin": [msgs.Wait(), msgs.SendHashes(), go],
        }
    )
    v = _run(fake, _begin({"global/w": "abc"}))
    assert v.committed and v.error is None and v.answer == go
    paths = [p for p, _ in fake.got]
    assert paths == ["/v1/commit"] * 2 + ["/v1/begin"] * 3
    begins = [m for p, m in fake.got if p == "/v1/begin"]
    # the hashes go with the first begin and again only when the coordinator asks for them
    assert [b.hashes for b in begins] == [{"global/w": "abc"}, None, {"global/w": "abc"}]
    assert {b.nonce for b in begins} == {"n8"}  # one attempt: the same nonce throughout
    assert v.next_begin is not None and v.next_begin.nonce == "n8"


@pytest.mark.parametrize("outcome", [msgs.Aborted(), msgs.Evicted()])
def test_a_vote_that_does_not_commit_sends_no_begin(outcome: msgs.Decision) -> None:
    fake = _Coordinator({"/v1/commit": [outcome], "/v1/begin": []})
    v = _run(fake, _begin(None))
    assert not v.committed and v.answer is None
    assert [p for p, _ in fake.got] == ["/v1/commit"]


def test_a_begin_asked_for_hashes_it_does_not_have_hands_the_request_back() -> None:
    fake = _Coordinator({"/v1/commit": [msgs.Committed()], "/v1/begin": [msgs.SendHashes()]})
    v = _run(fake, _begin(None))
    assert isinstance(v.answer, msgs.SendHashes)  # the training thread hashes and goes on


def test_an_unreachable_coordinator_is_kept_for_the_training_thread() -> None:
    class Down:
        def call(self, *a: Any, **k: Any) -> msgs.Decision:
            raise ConnectionError("coordinator down")

    v = PendingVote(PLAN, 0.0, timeout=5.0)
    v.start(Down(), VOTE)  # type: ignore[arg-type]
    assert v.done.wait(5.0) and v.decided.is_set()
    assert not v.committed and isinstance(v.error, ConnectionError)


def test_the_begin_waits_until_the_training_thread_prepared_it() -> None:
    fake = _Coordinator({"/v1/commit": [msgs.Committed()], "/v1/begin": [msgs.Go(plan=PLAN)]})
    v = PendingVote(PLAN, 0.0, timeout=5.0)
    v.start(fake, VOTE)  # type: ignore[arg-type]
    assert v.decided.wait(5.0)
    assert not v.done.wait(0.2)  # committed, but no begin before the state is applied
    threading.Timer(0.05, v.prepare, args=(_begin(None),)).start()
    assert v.done.wait(5.0) and isinstance(v.answer, msgs.Go)


class _Session(VoteAhead):
    """The attributes of a session that the background vote reads, with a scripted client."""

    def __init__(self, client: _Coordinator, carry: bool = False) -> None:
        self.config = SimpleNamespace(pipeline_commit=True, round_timeout=5.0)
        self.state = _state()
        self.stats = SimpleNamespace(by_op={}, bytes_sent=0)
        self.rounds: list[dict[str, Any]] = []
        self.revision, self.parity_every, self.peer_id, self.run_id = 7, 1, 1, "r"
        self.name = "p"
        self._client = client  # type: ignore[assignment]
        self._fresh, self._group, self._push_lock = False, None, threading.Lock()
        self._aborted_epochs: set[int] = set()
        self._last_by_op: dict[str, int] = {}
        self.hooked: list[int] = []
        self._commit_hooks = [lambda plan: self.hooked.append(plan.round)]
        self._deferrable_hooks = True
        self._vote, self._undo, self._void, self._in_round = None, UndoCopy(), False, None
        self._carry_votes = carry


class _Round:
    plan, epoch, number, started, _done = PLAN, 3, 7, 0.0, False

    def check_faults(self, point: str) -> None:
        pass


def _apply(s: _Session) -> dict[str, bytes]:
    """What a strategy does after a pipelined round: apply the result, then say so."""
    with torch.no_grad():
        for _, t in s.state.items():
            t.add_(1)
    s.applied()
    return _bits(s.state)


def test_a_committed_vote_raises_the_revision_and_hands_its_begin_to_the_next_round() -> None:
    go = msgs.Go(plan=PLAN)
    s = _Session(_Coordinator({"/v1/commit": [msgs.Committed()], "/v1/begin": [go]}))
    assert s._vote_ahead(_Round())
    applied = _apply(s)
    assert s.revision == 7 and s.pending_revision == 8 and s.hooked == []  # not known yet
    carried = s.settle(begin=True)
    assert s.revision == 8 and s.pending_revision is None and s.hooked == [7]
    assert carried is not None and carried[1] == go and carried[0].revision == 8
    assert _bits(s.state) == applied and not s._void
    assert [r["outcome"] for r in s.rounds] == ["committed"]


def test_an_aborted_vote_restores_the_state_bit_for_bit_and_voids_the_work_since() -> None:
    s = _Session(_Coordinator({"/v1/commit": [msgs.Aborted()], "/v1/begin": []}))
    before = _bits(s.state)
    assert s._vote_ahead(_Round())
    _apply(s)
    s.settle()  # a checkpoint's settle: the verdict only
    assert _bits(s.state) == before and s.revision == 7 and s._void and s.hooked == []
    assert s.settle(begin=True) is None  # no begin went: the round begins again
    assert 3 in s._aborted_epochs and [r["outcome"] for r in s.rounds] == ["aborted"]


def test_a_vote_whose_verdict_is_unknown_is_undone_before_the_error_is_raised() -> None:
    class Down:
        def call(self, *a: Any, **k: Any) -> msgs.Decision:
            raise ConnectionError("coordinator restarted")

    s = _Session(Down())  # type: ignore[arg-type]
    before = _bits(s.state)
    assert s._vote_ahead(_Round())
    _apply(s)
    with pytest.raises(ConnectionError):
        s.settle(begin=True)
    assert _bits(s.state) == before and s.revision == 7 and s._vote is None


def test_a_vote_carried_in_the_begin_costs_one_request_per_round() -> None:
    go = msgs.Go(plan=PLAN, prev="committed")
    begin = [msgs.Wait(), msgs.Wait(prev="committed"), go]  # undecided, then held, then go
    fake = _Coordinator({"/v1/commit": [], "/v1/begin": begin})
    s = _Session(fake, carry=True)
    assert s._vote_ahead(_Round())
    applied = _apply(s)
    carried = s.settle(begin=True)
    assert s.revision == 8 and s.hooked == [7] and _bits(s.state) == applied
    assert carried is not None and carried[1] == go and carried[0].prev is None
    sent = [m for _, m in fake.got]
    assert [p for p, _ in fake.got] == ["/v1/begin"] * 3  # no commit request at all
    assert [m.prev for m in sent] == [msgs.Vote(epoch=3, round=7)] * 2 + [None]
    assert {m.nonce for m in sent} == {sent[0].nonce}


def test_a_carried_vote_answered_aborted_is_undone_and_begins_nothing() -> None:
    fake = _Coordinator({"/v1/commit": [], "/v1/begin": [msgs.Aborted()]})
    s = _Session(fake, carry=True)
    before = _bits(s.state)
    assert s._vote_ahead(_Round())
    _apply(s)
    assert s.settle(begin=True) is None
    assert _bits(s.state) == before and s.revision == 7 and s._void


@pytest.mark.parametrize("carry", [False, True])
def test_the_last_round_sends_its_vote_alone_and_begins_nothing(carry: bool) -> None:
    # applied(last=True): the run ends after this round, so no begin may form another
    fake = _Coordinator({"/v1/commit": [msgs.Wait(), msgs.Committed()], "/v1/begin": []})
    s = _Session(fake, carry=carry)
    assert s._vote_ahead(_Round())
    with torch.no_grad():
        s.state["meta/step"].add_(1)
    s.applied(last=True)
    s.applied()  # a later call changes nothing: the first decided
    assert s.settle(begin=True) is None  # committed, and no begin went
    assert s.revision == 8 and s.hooked == [7] and s.pending_revision is None
    assert [p for p, _ in fake.got] == ["/v1/commit"] * 2
    assert all(m.ok for _, m in fake.got)


def test_a_vote_settled_outside_a_begin_goes_alone() -> None:
    # the end of a run (Strategy.finish, Session.close) settles without having applied():
    # the vote is reported as a commit, and an abort loses no work (nothing was computed)
    fake = _Coordinator({"/v1/commit": [msgs.Aborted()], "/v1/begin": []})
    s = _Session(fake, carry=True)
    before = _bits(s.state)
    assert s._vote_ahead(_Round())
    with torch.no_grad():
        s.state["global/w"].add_(1)
    s.settle()
    assert [p for p, _ in fake.got] == ["/v1/commit"]
    assert _bits(s.state) == before and s.revision == 7 and not s._void


class _RoundSession(_Session):
    """The stand-in session with the part of :meth:`Session.run_round` a pipelined round
    takes: the round's function, then the vote sent ahead."""

    def __init__(self, client: _Coordinator) -> None:
        super().__init__(client, carry=True)
        self.config = SimpleNamespace(
            pipeline_commit=True, round_timeout=5.0, resume=None, checkpoint_dir=None
        )

    def add_commit_hook(self, fn: Any) -> None:
        self._commit_hooks.append(fn)

    def run_round(self, fn: Any, *, pipelined: bool = False) -> Any:
        assert pipelined
        out = fn(_Round())
        assert self._vote_ahead(_Round())
        return out


def _counting_strategy(session: _RoundSession, run_steps: int) -> Any:
    from isthmus.strategies.base import Strategy
    from isthmus.strategies.ddp import DDPConfig

    class Counting(Strategy):
        """A round per step whose result is the shared step counter plus one."""

        name = "counting"
        Config = DDPConfig

        def setup(self) -> None:
            self.global_step = session.state["meta/step"]

        def pipelines_rounds(self) -> bool:
            return True

        def _step(self) -> None:
            session.run_round(lambda rnd: None, **self.round_options())
            with torch.no_grad():
                self.global_step.add_(1)

    st = Counting(session, torch.nn.Linear(2, 2), torch.optim.SGD([torch.zeros(1)], lr=0.1))
    st.run_steps = run_steps
    return st


def test_the_step_that_reaches_run_steps_settles_its_round_without_a_begin() -> None:
    s = _RoundSession(_Coordinator({"/v1/commit": [msgs.Committed()], "/v1/begin": []}))
    st = _counting_strategy(s, run_steps=42)  # meta/step is 41: this step is the last
    st.step()
    assert st.step_count == 42 and s.revision == 8 and s.pending_revision is None
    assert [p for p, _ in s._client.got] == ["/v1/commit"]
    st.finish()  # nothing left to settle, nothing sent
    assert len(s._client.got) == 1


def test_an_aborted_last_round_leaves_the_step_to_be_run_again_with_its_work_counting() -> None:
    s = _RoundSession(_Coordinator({"/v1/commit": [msgs.Aborted()], "/v1/begin": []}))
    st = _counting_strategy(s, run_steps=42)
    before = _bits(s.state)
    st.step()
    # undone within the step: the loop (while step_count < run_steps) runs the step again,
    # and its next gradient, computed from the restored state, counts
    assert st.step_count == 41 and _bits(s.state) == before and not s._void
    assert [p for p, _ in s._client.got] == ["/v1/commit"]


def test_the_round_known_to_end_the_run_takes_the_waiting_path() -> None:
    st = _counting_strategy(_RoundSession(_Coordinator({})), run_steps=42)
    assert st.round_options(step_after=41) == {"pipelined": True}
    assert st.round_options(step_after=42) == {}  # its verdict before the step returns
    assert st.round_options() == {"pipelined": True}  # not known: the step settles after
    st.run_steps = None
    assert st.round_options(step_after=10**6) == {"pipelined": True}
    st.session.config.pipeline_commit = False
    assert st.round_options(step_after=1) == {}
