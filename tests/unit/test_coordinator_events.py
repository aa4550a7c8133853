"""The coordinator's event log over a run longer than the events it keeps in memory."""

from isthmus.coordinator.server import Coordinator, CoordinatorConfig


def test_events_drain_past_the_membership_bound():
    """The coordinator keeps its last 10,000 events; a caller that drains them with
    events_since (the launcher, every poll) gets every one of a longer run, in order."""
    coord = Coordinator(CoordinatorConfig(token="t", port=0))
    got: list[dict] = []
    seen = 0
    for i in range(25_000):
        coord.membership.note(float(i), "mark", i=i)
        if i % 5_000 == 4_999:
            new, seen = coord.events_since(seen)
            got += new
    new, seen = coord.events_since(seen)
    got += new
    assert seen == 25_000 and [e["i"] for e in got] == list(range(25_000))
    assert len(coord.events()) <= 10_000 and coord.events_since(seen) == ([], seen)
