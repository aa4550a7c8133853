"""A run whose every in-sync peer is gone restarts from its latest checkpoint (the restore point):
peers registering then are told it at registration, peers already waiting are answered
``restore`` and their first round drops their work, and a checkpoint a peer cannot load is given
up rather than asked for forever."""

from test_membership import GOOD, Run, full_round

from isthmus.coordinator.protocol import Decision, RestorePoint

POINT = RestorePoint("/ck", 3)


def _run_to(r: Run, pids: list[int], rounds: int) -> None:
    for _ in range(rounds):
        full_round(r, pids)


def test_restore_point_keeps_the_newest_and_round_trips():
    r = Run()
    r.m.set_restore_point(RestorePoint("/ck", 4), 0.0)
    r.m.set_restore_point(RestorePoint("/ck", 2), 0.0)
    assert r.m.restore_point == RestorePoint("/ck", 4)
    assert RestorePoint.from_json(POINT.to_json()) == POINT
    d = Decision("restore", "why", restore=POINT)
    assert d.to_json()["restore"] == {"url": "/ck", "revision": 3}


def test_no_restart_while_a_peer_holds_the_state():
    r = Run(start_peers=2)
    a, b = r.add("a"), r.add("b")
    _run_to(r, [a, b], 5)
    r.m.set_restore_point(POINT, r.now)
    r.m.remove(a, r.now, "killed")
    assert r.m.started and r.m.restore_wanted() is None
    c = r.add("c")  # a joiner is repaired from b, as always
    r.begin(c, hashes={"w": "old", "b": "old"}, revision=0)
    d = r.begin(b)
    assert d.kind == "go" and [t.dst for t in d.plan.transfers] == [c]
    assert not [e for e in r.m.events if e["kind"] == "restart"]


def test_every_peer_gone_restarts_from_the_checkpoint():
    r = Run(start_peers=2)
    a, b = r.add("a"), r.add("b")
    _run_to(r, [a, b], 5)
    r.m.set_restore_point(POINT, r.now)
    waiting = r.add("w")  # registered while the run held its state: a joiner
    r.m.remove(a, r.now, "killed")
    r.m.remove(b, r.now, "killed")
    # Lazily: the run restarts when somebody arrives to restart it with.
    assert r.m.started and not [e for e in r.m.events if e["kind"] == "restart"]

    # A peer registering now is told at registration; it loads the checkpoint before any work.
    c = r.add("c")
    restart = [e for e in r.m.events if e["kind"] == "restart"]
    assert len(restart) == 1 and restart[0]["checkpoint_revision"] == 3
    assert not r.m.started and r.m.restore_wanted() == POINT
    assert not r.m.peers[c].uncounted
    # The joiner that was waiting holds its initial state: it is answered restore.
    d = r.begin(waiting, revision=0)
    assert d.kind == "restore" and d.restore == POINT
    assert r.m.peers[waiting].uncounted  # its work so far started from another state

    # Restored, the joiner begins at the checkpoint's revision. A restart waits for start_peers
    # as a first round does (c, told at registration, is still loading), for restart_timeout
    # (shorter than start_timeout); then round 3 forms with whoever is there, and its work
    # does not count.
    d = r.begin(waiting, revision=3)
    assert d.kind == "wait" and "first 2 peers" in d.reason, d
    assert r.m.config.restart_timeout < r.m.config.start_timeout
    r.advance(r.m.config.restart_timeout + 0.5)
    d = r.poll(waiting)
    assert d.kind == "go"
    plan = d.plan
    assert plan.round == 3 and plan.members == (waiting,) and plan.new_epoch
    assert plan.transfers == () and plan.stale == (waiting,)
    assert r.commit(waiting, plan).kind == "committed"
    assert r.m.revision == 4 and r.m.started and r.m.restore_wanted() is None
    # c, which loaded checkpoint 3 at registration, is one round behind now: repaired from it
    r.begin(c, revision=3, hashes={"w": "c3", "b": "c3"})
    d = r.begin(waiting)
    assert d.kind == "go" and [t.dst for t in d.plan.transfers] == [c]


def test_a_restart_waits_for_start_peers_so_peers_killed_together_restart_together():
    """Every peer died; both come back under new processes and load the checkpoint at
    registration, one slower than the other: the restart round forms with both, at the
    checkpoint's revision, rather than with the first alone."""
    r = Run(start_peers=2)
    a, b = r.add("a"), r.add("b")
    _run_to(r, [a, b], 5)
    r.m.set_restore_point(POINT, r.now)
    r.m.remove(a, r.now, "killed")
    r.m.remove(b, r.now, "killed")
    a2, b2 = r.add("a"), r.add("b")
    assert r.m.restore_wanted() == POINT
    assert r.begin(a2, revision=3).kind == "wait"
    r.advance(r.m.config.restart_timeout / 2)  # b2 still loading: a2 waits
    assert r.poll(a2).kind == "wait"
    d = r.begin(b2, revision=3)
    assert d.kind == "go" and d.plan.round == 3 and set(d.plan.members) == {a2, b2}
    assert d.plan.transfers == () and r.poll(a2).plan == d.plan


def test_a_peer_ahead_of_the_checkpoint_is_repaired_from_none_and_votes():
    """A peer that comes back with a later committed state (it was stopped, not killed) is the
    newest state there is: nobody is told to restore, the others are repaired from it."""
    r = Run(start_peers=2, min_peers=2)
    a, b = r.add("a"), r.add("b")
    _run_to(r, [a, b], 5)
    r.m.set_restore_point(POINT, r.now)
    r.m.remove(a, r.now, "killed")
    r.m.remove(b, r.now, "stopped")
    back = r.add("b")  # registered again, still holding revision 5
    fresh = r.add("c")
    r.begin(back, revision=5)
    d = r.begin(fresh, revision=0, hashes={"w": "x", "b": "y"})
    assert d.kind == "go" and d.plan.round == 5
    assert [t.dst for t in d.plan.transfers] == [fresh]


def test_a_checkpoint_a_peer_cannot_load_is_given_up():
    r = Run(start_peers=1)
    a = r.add("a")
    _run_to(r, [a], 5)
    r.m.set_restore_point(POINT, r.now)
    w = r.add("w")
    r.m.remove(a, r.now, "killed")
    assert r.begin(w, revision=0).kind == "restore"
    # checkpoint 3 failed to verify there; the peer loaded checkpoint 2 instead
    d = r.begin(w, revision=2)
    assert d.kind == "go" and d.plan.round == 2
    assert [e["kind"] for e in r.m.events].count("checkpoint_unusable") == 1
    assert r.m.restore_point is None


def test_without_a_checkpoint_the_run_waits_for_its_state():
    r = Run(start_peers=1)
    a = r.add("a")
    _run_to(r, [a], 2)
    r.m.remove(a, r.now, "killed")
    c = r.add("c")
    d = r.begin(c, revision=0, hashes=GOOD)
    assert d.kind == "wait" and "holds the run's state" in d.reason
    assert r.m.started
