"""Pure tests of the parity check over state digests (``hash-digest``): a begin that carries
one digest of its hashes instead of the list, and the lists asked only where digests disagree.
The plans must be exactly those of the check over every list."""

import random

import pytest

from isthmus.coordinator.frames import BadFrame, read_uplink
from isthmus.coordinator.membership import Membership, MembershipConfig
from isthmus.coordinator.parity import lists_from_digests, lists_wanted, state_digest
from isthmus.coordinator.protocol import Begin, TensorSpec
from isthmus.coordinator.wire import WireError, decode, encode

NAMES = ("w", "b", "c")
SCHEMA = [TensorSpec(n, (2,), "torch.float32") for n in NAMES]
GOOD = {"w": "aa", "b": "bb", "c": "cc"}


def test_state_digest_names_the_whole_list_in_any_order():
    assert state_digest(GOOD) == state_digest(dict(reversed(GOOD.items())))
    assert len(state_digest(GOOD)) == 32
    assert state_digest(GOOD) != state_digest({**GOOD, "c": "cd"})
    assert state_digest(GOOD) != state_digest({"w": "aa", "b": "bb"})  # a tensor missing
    # names and hashes are delimited: moving a character from one to the other changes it
    assert state_digest({"ab": "c"}) != state_digest({"a": "bc"})
    assert state_digest({"a": "b", "c": "d"}) != state_digest({"a": "bc", "": "d"})


def test_lists_wanted_only_where_digests_disagree():
    same = {1: "x", 2: "x", 3: "x"}
    assert lists_wanted([1, 2, 3], [1, 2, 3], same, []) == []
    # 3 differs from the majority (1, 2): its list, and one list of the majority (voter 1)
    odd = {1: "x", 2: "x", 3: "y"}
    assert lists_wanted([1, 2, 3], [1, 2, 3], odd, []) == [1, 3]
    assert lists_wanted([1, 2, 3], [1, 2, 3], odd, [2]) == [3]  # 2 holds it and sent its list
    assert lists_wanted([1, 2, 3], [1, 2, 3], odd, [3]) == [1]
    # a joiner (4, not a voter) that differs; the voters agree
    assert lists_wanted([1, 2, 4], [1, 2], {1: "x", 2: "x", 4: "z"}, [4]) == [1]
    # no state held by more than half of the voters: every list
    assert lists_wanted([1, 2], [1, 2], {1: "x", 2: "y"}, []) == [1, 2]
    assert lists_wanted([1, 2, 3], [1, 2, 3], {1: "x", 2: "y", 3: "z"}, [2]) == [1, 3]


def test_lists_from_digests_lends_a_list_to_every_holder_of_its_state():
    digests = {1: "x", 2: "x", 3: "y"}
    lists = {1: GOOD, 3: {"w": "zz"}}
    assert lists_from_digests([1, 2, 3], digests, lists) == {1: GOOD, 2: GOOD, 3: {"w": "zz"}}
    assert lists_from_digests([1, 2], {1: "x", 2: "q"}, {1: GOOD}) == {1: GOOD}


class Run:
    """A membership with a fake clock; each peer begins with its list or its digest."""

    def __init__(self, **cfg):
        self.m = Membership(MembershipConfig(**cfg))
        self.nonce: dict[int, int] = {}
        self.lists_sent = 0

    def add(self, name):
        return self.m.register(name, 0.0)

    def begin(self, pid, hashes, *, digest, fresh=False):
        """Begin as a peer's client does: the digest in place of the list (unless ``fresh`` or
        not ``digest``), the list again when that attempt is answered ``hashes``."""
        self.nonce[pid] = self.nonce.get(pid, 0) + 1
        nonce = str(self.nonce[pid])
        schema = SCHEMA if fresh else None
        if digest and not fresh:
            d = self.m.begin(
                pid,
                0.0,
                nonce=nonce,
                revision=self.m.revision,
                hashes=None,
                schema=None,
                digest=state_digest(hashes),
            )
        else:
            self.lists_sent += 1
            d = self.m.begin(
                pid, 0.0, nonce=nonce, revision=self.m.revision, hashes=hashes, schema=schema
            )
        return d

    def settle(self, pids, hashes):
        """Answer every ``hashes`` with the list until nobody is asked; the plan."""
        for _ in range(4):
            asked = [p for p in pids if self.m.poll_begin(p, str(self.nonce[p])).kind == "hashes"]
            if not asked:
                break
            for p in asked:
                self.lists_sent += 1
                self.m.begin(
                    p,
                    0.0,
                    nonce=str(self.nonce[p]),
                    revision=self.m.revision,
                    hashes=hashes[p],
                    schema=None,
                )
        answers = [self.m.poll_begin(p, str(self.nonce[p])) for p in pids]
        assert all(a.kind == "go" for a in answers), answers
        return answers[0].plan

    def commit_all(self, pids, plan):
        for p in pids:
            self.m.commit(p, 0.0, epoch=plan.epoch, round=plan.round, ok=True)
        assert self.m.revision == plan.round + 1


def _run(states, joiner, digest_of):
    """Three rounds: everyone with GOOD (round 0, first begins carry lists), then ``states``
    (peer index -> its hashes) in round 1 with a joiner (``joiner``: its hashes, or None).
    ``digest_of(i)``: whether peer ``i`` sends digests. Returns the round-1 plan in peer
    indices, the counters, and how many lists went in round 1."""
    r = Run(start_peers=len(states))
    pids = [r.add(f"p{i}") for i in range(len(states))]
    for p in pids:
        r.begin(p, GOOD, digest=True, fresh=True)
    r.commit_all(pids, r.settle(pids, dict.fromkeys(pids, GOOD)))
    everyone = list(pids)
    hashes = {p: states[i] for i, p in enumerate(pids)}
    if joiner is not None:
        j = r.add("p~joiner")
        everyone.append(j)
        hashes[j] = joiner
        r.begin(j, joiner, digest=True, fresh=True)
    before = r.lists_sent
    for i, p in enumerate(pids):
        r.begin(p, hashes[p], digest=digest_of(i))
    plan = r.settle(everyone, hashes)
    index = {p: i for i, p in enumerate(everyone)}
    shape = (
        sorted((index[t.src], index[t.dst], t.names) for t in plan.transfers),
        plan.expected,
        sorted(index[p] for p in plan.resynced),
        len(plan.members),
    )
    counters = {k: r.m.counters[k] for k in ("parity_checks", "parity_failures", "resyncs")}
    return shape, counters, r.lists_sent - before


def test_every_peer_in_one_state_sends_no_list():
    shape, counters, lists = _run([GOOD] * 5, None, lambda i: True)
    assert shape == ([], {}, [], 5)
    assert counters == {"parity_checks": 2, "parity_failures": 0, "resyncs": 0}
    assert lists == 0


def test_a_corrupt_voter_and_one_holder_of_the_majority_send_their_lists():
    bad = {**GOOD, "b": "CORRUPT"}
    shape, counters, lists = _run([GOOD, GOOD, bad, GOOD], None, lambda i: True)
    assert shape == ([(0, 2, ("b",))], {"b": "bb"}, [2], 4)
    assert counters["parity_failures"] == 1 and counters["resyncs"] == 1
    assert lists == 2  # the corrupt one's, and the lowest voter holding the majority state


def test_a_joiner_that_differs_needs_one_list_of_the_majority():
    shape, counters, lists = _run([GOOD, GOOD, GOOD], {**GOOD, "w": "old"}, lambda i: True)
    (t,) = shape[0]
    assert t[1] == 3 and t[2] == ("w",) and shape[2] == [3]
    assert counters["parity_failures"] == 0 and counters["resyncs"] == 1
    assert lists == 1


@pytest.mark.parametrize("seed", range(60))
def test_the_plan_over_digests_is_the_plan_over_every_list(seed):
    """Random states (majorities, ties, no majority, a joiner, peers that send lists as older
    peers do): the round's transfers, expected hashes, resynced peers and parity counters are
    those of the check over every list."""
    rng = random.Random(seed)
    n = rng.randint(2, 7)
    variants = [GOOD, {**GOOD, "w": "w2"}, {**GOOD, "b": "b2", "c": "c2"}, {"w": "aa", "b": "b3"}]
    weights = [rng.random() for _ in variants]
    states = [rng.choices(variants, weights)[0] for _ in range(n)]
    joiner = rng.choice([None, GOOD, variants[1], variants[3]])
    mixed = {i: rng.random() < 0.7 for i in range(n)}
    full = _run(states, joiner, lambda i: False)
    over_digests = _run(states, joiner, lambda i: mixed[i])
    assert over_digests[:2] == full[:2]
    assert over_digests[2] <= full[2]  # never more lists than sending every one


def test_a_begin_frame_reads_its_digest_and_refuses_a_malformed_one():
    text = '{"type":"begin","id":7,"begin":{"peer":1,"nonce":"n","revision":3,"digest":"ab12"}}'
    frame = read_uplink(text)
    assert frame.begin.digest == "ab12" and frame.begin.hashes is None
    for bad, why in (
        ('"digest":5', "digest"),
        ('"digest":""', "digest"),
        (
            '"digest":"' + "x" * 200 + '"',
            "digest",
        ),
    ):
        with pytest.raises(BadFrame, match=why) as e:
            read_uplink(
                '{"type":"begin","id":7,"begin":{"peer":1,"nonce":"n","revision":3,' + bad + "}}"
            )
        assert e.value.id == 7
    b = Begin(peer=1, nonce="n", revision=0, digest=state_digest(GOOD))
    assert decode(Begin, encode(b)) == b
    with pytest.raises(WireError, match="digest"):
        decode(Begin, {"peer": 1, "nonce": "n", "revision": 0, "digest": "y" * 129})
