"""Pure tests of the coordinator's membership logic: epochs, admission, commit/abort, parity."""

import pytest

from isthmus.coordinator.membership import Membership, MembershipConfig
from isthmus.coordinator.protocol import RoundPlan, TensorSpec, Transfer, schema_mismatch
from isthmus.coordinator.wire import WireError

SCHEMA = [TensorSpec("w", (2, 3), "torch.float32"), TensorSpec("b", (3,), "torch.float32")]
GOOD = {"w": "aa", "b": "bb"}


class Run:
    """A membership object with a fake clock and helpers that act like peers."""

    def __init__(self, **cfg):
        self.now = 0.0
        self.m = Membership(MembershipConfig(**cfg))
        self.nonces: dict[int, int] = {}

    def add(self, name="p"):
        return self.m.register(name, self.now)

    def begin(self, pid, hashes=GOOD, revision=None, new=True, schema=SCHEMA):
        if new:
            self.nonces[pid] = self.nonces.get(pid, 0) + 1
        rev = self.m.revision if revision is None else revision
        return self.m.begin(
            pid, self.now, nonce=str(self.nonces[pid]), revision=rev, hashes=hashes, schema=schema
        )

    def poll(self, pid):
        return self.m.poll_begin(pid, str(self.nonces[pid]))

    def commit(self, pid, plan, ok=True):
        return self.m.commit(pid, self.now, epoch=plan.epoch, round=plan.round, ok=ok)

    def advance(self, dt):
        self.now += dt
        for pid, p in self.m.peers.items():
            if p.state.value == "active" and pid not in self.silent:
                p.last_seen = self.now
        self.m.tick(self.now)

    silent: set = set()  # noqa: RUF012


def full_round(r, pids, hashes=None):
    for pid in pids:
        r.begin(pid, hashes=(hashes or {}).get(pid, GOOD))
    plans = [r.poll(pid).plan for pid in pids]
    assert all(p is not None for p in plans)
    assert len({(p.epoch, p.round) for p in plans}) == 1
    outs = [r.commit(pid, plans[0]) for pid in pids]
    assert outs[-1].kind == "committed"
    return plans[0]


def test_round_forms_when_all_members_ready_and_commits():
    r = Run(start_peers=3)
    a, b, c = r.add("a"), r.add("b"), r.add("c")
    assert r.begin(a).kind == "wait"
    assert r.begin(b).kind == "wait"
    d = r.begin(c)
    assert d.kind == "go"
    plan = d.plan
    assert plan.members == (a, b, c) and plan.epoch == 1 and plan.round == 0
    assert plan.transfers == ()
    assert r.commit(a, plan).kind == "wait"
    assert r.commit(b, plan).kind == "wait"
    assert r.commit(c, plan).kind == "committed"
    assert r.commit(a, plan).kind == "committed"  # idempotent re-ask
    assert r.m.revision == 1
    # unchanged membership after a commit keeps the epoch (and its process groups)
    plan2 = full_round(r, [a, b, c])
    assert plan2.epoch == 1 and not plan2.new_epoch and plan2.round == 1
    assert r.m.counters["rounds_committed"] == 2


def test_one_failure_aborts_for_everyone_and_opens_new_epoch():
    r = Run(start_peers=2)
    a, b = r.add(), r.add()
    r.begin(a)
    plan = r.begin(b).plan
    assert r.commit(a, plan).kind == "wait"
    assert r.commit(b, plan, ok=False).kind == "aborted"
    assert r.m.poll_commit(plan.epoch, plan.round).kind == "aborted"
    assert r.m.revision == 0
    members, notice = r.m.notices[-1]
    assert set(members) == {a, b} and notice["type"] == "abort"
    plan2 = full_round(r, [a, b])
    assert plan2.round == 0 and plan2.epoch == plan.epoch + 1 and plan2.new_epoch
    assert r.m.counters["rounds_aborted"] == 1


def test_dead_member_aborts_running_round_and_survivors_reform():
    r = Run(start_peers=3, heartbeat_timeout=5)
    a, b, c = r.add(), r.add(), r.add()
    plan = full_round(r, [a, b, c])
    for pid in (a, b, c):
        r.begin(pid)
    running = r.poll(a).plan
    r.commit(a, running)
    r.silent = {c}
    # b's heartbeat says nothing moves on its connections (c takes no data): no grace for c
    info = {"transfer": {"epoch": running.epoch, "round": running.round, "moving": False}}
    r.m.heartbeat(b, r.now + 0.5, info)
    r.advance(6)
    assert r.m.poll_commit(running.epoch, running.round).kind == "aborted"
    assert r.m.peers[c].state.value == "dead"
    assert r.m.roster.live == {a, b}  # the live set follows every drop
    assert r.begin(c).kind == "evicted"
    plan3 = full_round(r, [a, b])
    assert plan3.members == (a, b) and plan3.round == plan.round + 1
    r.silent = set()


def test_joiner_waits_for_running_round_then_is_resynced():
    r = Run(start_peers=2)
    a, b = r.add(), r.add()
    full_round(r, [a, b])
    r.begin(a)
    running = r.begin(b).plan
    j = r.add("joiner")
    d = r.begin(j, hashes={"w": "xx", "b": "bb"}, revision=0)
    assert d.kind == "wait" and "running" in d.reason
    r.commit(a, running)
    r.commit(b, running)
    r.begin(a)
    d = r.begin(b)
    assert d.kind == "go"
    plan = d.plan
    assert plan.members == (j, a, b) and plan.new_epoch  # ranks follow names: "joiner" < "p"
    (t,) = plan.transfers
    assert t.dst == j and t.src in (a, b) and t.names == ("w",)
    assert plan.expected == {"w": "aa"}
    assert plan.resynced == {j}
    assert r.m.counters["parity_failures"] == 0  # a joiner differing is not a parity failure
    for pid in (a, b, j):
        r.commit(pid, plan)
    assert r.m.peers[j].in_sync and r.m.peers[j].revision == r.m.revision


def test_parity_failure_repairs_only_the_differing_tensor():
    r = Run(start_peers=3)
    a, b, c = r.add(), r.add(), r.add()
    full_round(r, [a, b, c])
    r.begin(a)
    r.begin(b)
    plan = r.begin(c, hashes={"w": "aa", "b": "CORRUPT"}).plan
    (t,) = plan.transfers
    assert (t.dst, t.names) == (c, ("b",))
    assert t.src in (a, b)
    assert r.m.counters["parity_failures"] == 1


def test_two_voters_disagreeing_resolve_to_longest_standing():
    r = Run(start_peers=2)
    a, b = r.add(), r.add()
    full_round(r, [a, b])
    r.begin(a, hashes={"w": "a1", "b": "bb"})
    plan = r.begin(b, hashes={"w": "b1", "b": "bb"}).plan
    (t,) = plan.transfers
    assert (t.src, t.dst, plan.expected["w"]) == (a, b, "a1")


def test_schema_mismatch_refuses_only_that_peer():
    r = Run(start_peers=1)
    a = r.add()
    full_round(r, [a])
    bad = r.add("bad")
    wrong = [TensorSpec("w", (2, 4), "torch.float32"), TensorSpec("b", (3,), "torch.float32")]
    d = r.begin(bad, schema=wrong)
    assert d.kind == "refused" and "'w'" in d.reason and "[2, 4]" in d.reason
    assert r.begin(bad).kind == "refused"
    plan = full_round(r, [a])
    assert plan.members == (a,)
    assert r.m.counters["refusals"] == 1


def test_schema_mismatch_messages():
    assert schema_mismatch(SCHEMA, SCHEMA) is None
    assert "missing" in schema_mismatch(SCHEMA, SCHEMA[:1])
    assert "dtype" in schema_mismatch(SCHEMA, [TensorSpec("w", (2, 3), "torch.int64"), SCHEMA[1]])
    assert "not in the run" in schema_mismatch(SCHEMA, [*SCHEMA, TensorSpec("z", (1,), "x")])
    assert "order" in schema_mismatch(SCHEMA, SCHEMA[::-1])


def test_min_peers_waits_with_reason():
    r = Run(min_peers=2)
    a = r.add()
    d = r.begin(a)
    assert d.kind == "wait" and "min_peers is 2" in d.reason
    r.advance(1000)
    assert r.poll(a).kind == "wait"
    b = r.add()
    assert r.begin(b).kind == "go"


def test_first_round_waits_for_start_peers_until_start_timeout():
    r = Run(start_peers=3, start_timeout=10)
    a, b = r.add(), r.add()
    r.begin(a)
    assert r.begin(b).kind == "wait"
    r.advance(11)
    assert r.poll(a).kind == "go"


def test_member_that_never_begins_is_evicted_after_begin_timeout():
    r = Run(start_peers=2, begin_timeout=30)
    a, b = r.add(), r.add()
    full_round(r, [a, b])
    r.begin(a)
    r.advance(10)
    assert r.poll(a).kind == "wait"
    r.advance(25)
    d = r.poll(a)
    assert d.kind == "go" and d.plan.members == (a,)
    assert "did not begin" in r.m.peers[b].reason


def test_member_that_never_commits_is_evicted_after_commit_timeout():
    r = Run(start_peers=2, commit_timeout=30)
    a, b = r.add(), r.add()
    r.begin(a)
    plan = r.begin(b).plan
    r.commit(a, plan)
    r.advance(31)
    assert r.m.poll_commit(plan.epoch, plan.round).kind == "aborted"
    assert r.m.peers[b].state.value == "dead"


def test_begin_is_idempotent_and_a_new_attempt_abandons_the_round():
    r = Run(start_peers=2)
    a, b = r.add(), r.add()
    r.begin(a)
    plan = r.begin(b).plan
    again = r.begin(a, new=False)
    assert again.kind == "go" and again.plan == plan
    r.begin(a)  # a new nonce: a gave up on this round
    assert r.m.poll_commit(plan.epoch, plan.round).kind == "aborted"


def test_parity_every_skips_hashes_but_a_joiner_triggers_a_check():
    r = Run(start_peers=2, parity_every=4)
    a, b = r.add(), r.add()
    full_round(r, [a, b])  # round 0 is always checked
    assert r.begin(a, hashes=None).kind == "wait"
    d = r.begin(b, hashes=None)
    assert d.kind == "go" and d.plan.transfers == ()
    for pid in (a, b):
        r.commit(pid, d.plan)
    # round 2: a joiner is waiting; members that begin without hashes are asked for them
    j = r.add()
    d = r.begin(j, hashes={"w": "zz", "b": "zz"}, revision=0)
    assert d.kind == "wait"
    assert r.begin(a, hashes=None).kind == "hashes"
    assert r.begin(b, hashes=None).kind == "hashes"
    r.begin(a, new=False)
    plan = r.begin(b, new=False).plan
    assert plan is not None and plan.resynced == {j}
    assert set(plan.transfers[0].names) == {"w", "b"}


def test_leave_between_rounds_does_not_abort():
    r = Run(start_peers=3)
    a, b, c = r.add(), r.add(), r.add()
    full_round(r, [a, b, c])
    r.m.leave(c, r.now)
    plan = full_round(r, [a, b])
    assert plan.members == (a, b)
    assert r.m.counters["rounds_aborted"] == 0


def test_resume_from_checkpoint_adopts_highest_revision():
    r = Run(start_peers=2)
    a, b = r.add(), r.add()
    r.begin(a, revision=7, hashes={"w": "k7", "b": "k7"})
    plan = r.begin(b, revision=0, hashes={"w": "i0", "b": "i0"}).plan
    assert plan.round == 7 and plan.resynced == {b}
    assert plan.expected == {"w": "k7", "b": "k7"}


def test_no_voter_left_means_waiting_with_reason():
    r = Run(start_peers=1, heartbeat_timeout=5)
    a = r.add()
    full_round(r, [a])
    j = r.add()
    r.begin(j, revision=0, hashes={"w": "x", "b": "y"})
    r.silent = {a}
    r.advance(6)
    r.silent = set()
    d = r.poll(j)
    assert d.kind == "wait" and "no ready peer holds the run's state" in d.reason


def test_config_validation():
    with pytest.raises(ValueError, match="min_peers"):
        MembershipConfig(min_peers=0)
    with pytest.raises(ValueError, match="start_peers"):
        MembershipConfig(min_peers=3, start_peers=2)
    with pytest.raises(ValueError, match="heartbeat_timeout"):
        MembershipConfig(heartbeat_timeout=0)


def test_restart_from_checkpoint_at_the_run_revision_can_vote():
    r = Run(start_peers=1, heartbeat_timeout=5)
    a = r.add()
    full_round(r, [a])
    full_round(r, [a])
    r.m.leave(a, r.now)
    b = r.add("restarted")
    plan = r.begin(b, revision=2).plan
    assert plan is not None and plan.round == 2 and plan.transfers == ()


def test_peer_arriving_after_everyone_left_is_told_the_run_is_over():
    r = Run(start_peers=2)
    a, b = r.add(), r.add()
    full_round(r, [a, b])
    r.m.leave(a, r.now)
    r.m.leave(b, r.now)
    late = r.add()
    d = r.begin(late, revision=0, hashes={"w": "x", "b": "y"})
    assert d.kind == "finished" and "run is over" in d.reason


def test_peer_arriving_after_members_died_keeps_waiting():
    r = Run(start_peers=1, heartbeat_timeout=5)
    a = r.add()
    full_round(r, [a])
    r.silent = {a}
    r.advance(6)
    r.silent = set()
    late = r.add()
    assert r.begin(late, revision=0, hashes={"w": "x", "b": "y"}).kind == "wait"


def test_a_waiting_joiner_never_gets_members_evicted():
    # members may go a long time between rounds (sparse gossip schedules, long DiLoCo phases)
    r = Run(start_peers=2, begin_timeout=30)
    a, b = r.add(), r.add()
    full_round(r, [a, b])
    j = r.add("joiner")
    assert r.begin(j, revision=0, hashes={"w": "x", "b": "y"}).kind == "wait"
    r.advance(10 * 30)
    assert r.m.peers[a].state.value == "active" and r.m.peers[b].state.value == "active"
    r.begin(a)
    r.advance(31)  # now a member is ready and b is late: b is evicted
    assert r.m.peers[b].state.value == "dead" and "did not begin" in r.m.peers[b].reason
    assert r.poll(j).kind == "go"


def test_round_plan_json_round_trip():
    plan = RoundPlan(
        round=7,
        epoch=3,
        members=(2, 5, 9),
        transfers=(Transfer(2, 9, ("w", "b")),),
        expected={"w": "aa", "b": "bb"},
        new_epoch=True,
    )
    assert RoundPlan.from_json(plan.to_json()) == plan
    assert TensorSpec.from_json(SCHEMA[0].to_json()) == SCHEMA[0]
    with pytest.raises(WireError, match="'epoch' is missing"):
        RoundPlan.from_json({"round": 1})


def test_work_of_a_new_registration_or_an_aborted_repair_does_not_count():
    """A peer registered after the run started, or repaired in an attempt that then aborted, is
    listed as stale in its next round even when its hashes match: its local work (a gradient
    from a stale model, a batch drawn under another peer id) must not count until it commits."""
    r = Run(start_peers=2)
    a, b = r.add("a"), r.add("b")
    first = full_round(r, [a, b])
    assert first.stale == () and first.resynced == frozenset()
    c = r.add("c")  # joins a running run with the right state (e.g. evicted and back)
    plan = full_round(r, [c, a, b])  # the joiner waits first; the members' next round admits it
    assert plan.transfers == () and plan.stale == (c,) and plan.resynced == {c}
    assert full_round(r, [a, b, c]).stale == ()  # counted once it committed a round
    d = r.add("d")
    r.begin(d, hashes={"w": "zz", "b": "bb"})
    for pid in (a, b, c):
        r.begin(pid)
    attempt = r.poll(d).plan
    assert [t.dst for t in attempt.transfers] == [d]
    assert r.commit(a, attempt, ok=False).kind == "aborted"  # the attempt that repaired d
    plan = full_round(r, [a, b, c, d])  # d's state was overwritten: no transfer needed now
    assert plan.transfers == () and plan.stale == (d,) and d in plan.resynced
    assert RoundPlan.from_json(plan.to_json()) == plan


def test_ranks_follow_peer_names_not_registration_order():
    """Whoever registers first, ``peer0`` is rank 0: a restarted or resumed peer gets its rank,
    its data shard and its slot's local state back."""
    r = Run(start_peers=3)
    c, a, b = r.add("peer2"), r.add("peer0"), r.add("peer1")
    plan = full_round(r, [c, a, b])
    assert plan.members == (a, b, c) and plan.rank_of(a) == 0 and plan.rank_of(c) == 2


def test_islands_and_single_process_peers_refuse_each_other():
    """An island (registered with ``info.island``) joining a run of single-process peers is
    refused at its first begin, naming both kinds and the peer it conflicts with; so is a
    single-process peer joining islands. Islands of different sizes go together."""
    r = Run(start_peers=1)
    a = r.m.register("plain", r.now)
    full_round(r, [a])
    island = r.m.register("isl", r.now, {"island": {"size": 2}})
    d = r.begin(island)
    assert d.kind == "refused", d
    assert "an island of 2 rank(s)" in d.reason and "'plain' (peer 0)" in d.reason, d.reason
    assert "a single-process peer" in d.reason and "--nproc-per-peer" in d.reason

    r = Run(start_peers=1)
    big = r.m.register("big", r.now, {"island": {"size": 2}})
    full_round(r, [big])
    small = r.m.register("small", r.now, {"island": {"size": 1}})
    assert r.begin(small).kind != "refused"
    plain = r.m.register("plain", r.now)
    d = r.begin(plain)
    assert d.kind == "refused" and "this peer ('plain') is a single-process peer" in d.reason


def test_a_repeated_heartbeat_is_a_sign_of_life_only_while_no_other_info_came_between():
    m = Membership(MembershipConfig(heartbeat_timeout=5.0))
    pid = m.register("a", 0.0)
    moving = {"transfer": {"epoch": 1, "round": 0, "moving": True}, "step": 3}
    assert m.heartbeat(pid, 1.0, moving)
    p = m.peers[pid]
    beats = p.beats
    assert beats == 1 and p.moving and p.progress_at == 1.0
    # the same info again: alive, seen now, and its moving transfer counts as progress now
    assert m.same_beat(pid, 2.0, beats) is True
    assert (p.last_seen, p.progress_at, p.beats) == (2.0, 2.0, beats)
    # another info recorded since (a begin's): the repeat must be recorded in full
    assert m.heartbeat(pid, 2.5, {"transfer": None, "step": 4})
    assert not p.moving
    assert m.same_beat(pid, 3.0, beats) is None
    assert p.last_seen == 2.5 and not p.moving  # nothing was taken from the stale repeat
    m.tick(9.0)  # silent past heartbeat_timeout: evicted
    assert m.same_beat(pid, 9.5, p.beats) is False
