"""The coordinator's messages (coordinator/protocol.py) through the one codec (coordinator/wire.py):
every message round-trips through JSON, a missing or mistyped field is named, and the version
helpers name both versions."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from isthmus.comm.connect import _listener, _parse
from isthmus.coordinator import protocol as p
from isthmus.coordinator.wire import (
    PROTOCOL_VERSION,
    UNVERSIONED,
    ProtocolMismatch,
    WireError,
    check_version,
    decode,
    encode,
    refusal,
)

PLAN = p.RoundPlan(
    round=7,
    epoch=3,
    members=(2, 5, 9),
    transfers=(p.Transfer(2, 9, ("w", "b")),),
    expected={"w": "aa", "b": "bb"},
    new_epoch=True,
    stale=(5,),
    reach={"2": "10.0.0.2:4100", "5": "10.0.0.5:4100"},
)
POINT = p.RestorePoint("file:///ck", 4)
SCHEMA = (p.TensorSpec("w", (2, 3), "torch.float32"), p.TensorSpec("b", (), "torch.int64"))

MESSAGES: list[Any] = [
    PLAN,
    PLAN.transfers[0],
    POINT,
    SCHEMA[0],
    p.Register("peer0", {"pid": 12, "host": "h"}, PROTOCOL_VERSION),
    p.Registered(
        peer_id=3,
        run_id="abcd",
        heartbeat_interval=1.0,
        store_port=0,
        rendezvous="coordinator",
        heartbeat_timeout=5.0,
        parity_every=2,
        min_peers=1,
        restore=POINT,
        protocol=PROTOCOL_VERSION,
        features=(p.VOTE_IN_BEGIN,),
    ),
    p.Begin(peer=1, nonce="n", revision=4, run="abcd", hashes={"w": "x"}, schema=SCHEMA),
    p.Begin(peer=1, nonce="n", revision=4),
    p.Begin(peer=1, nonce="n", revision=5, prev=p.Vote(epoch=2, round=4)),
    p.Vote(epoch=2, round=4),
    p.Commit(peer=1, epoch=2, round=4, ok=False, run="abcd", error="boom"),
    p.Commit(
        peer=1,
        epoch=2,
        round=4,
        ok=False,
        error="connect",
        unreached=(p.Unreached(5, "10.0.0.5:4100", "refused"),),
    ),
    p.Unreached(5, "[fe80::1]:4100", "stalled"),
    p.ProbeOutcome(5, False, "timed out"),
    p.ProbePush(peer=5, address="10.0.0.5:4100"),
    p.Leave(peer=1, run="abcd", digest="d", revision=4, info={"bytes_sent": 9}),
    p.CheckpointPart(revision=4, part=0, parts=2, ok=True, peer=1, hashes={"w": "x"}, bytes=8),
    p.CheckpointManifest(revision=4, manifest="/ck/4/manifest.json", peer=1, url="file:///ck"),
    p.Heartbeat({"revision": 4, "timing": {"work_s": 0.5}}),
    p.AbortPush("a member died", epoch=3, round=7),
    p.EvictedPush("removed"),
    p.HeartbeatLost("closed"),
    p.Wait(reason="waiting"),
    p.Go(plan=PLAN),
    p.Go(plan=PLAN, prev="committed"),
    p.SendHashes(),
    p.Refused(reason="schema"),
    p.Evicted(reason="gone"),
    p.Finished(reason="over"),
    p.Restore(reason="restart", restore=POINT),
    p.Committed(),
    p.Aborted(reason="a member failed"),
    p.Stopped(reason="the round aborted 5 times in a row for the same cause: x"),
]


def _as_read_by(base: type, msg: Any) -> type:
    """The class a peer decodes ``msg`` as: a union's root for its members."""
    for root in (p.Decision, p.Push):
        if isinstance(msg, root):
            return root
    return base


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_json(msg: Any) -> None:
    wire = json.loads(json.dumps(encode(msg)))
    back = decode(_as_read_by(type(msg), msg), wire)
    assert type(back) is type(msg) and back == msg


def test_every_message_type_is_covered() -> None:
    covered = {type(m) for m in MESSAGES}
    types = {
        v
        for v in vars(p).values()
        if isinstance(v, type) and dataclasses.is_dataclass(v) and v.__module__ == p.__name__
    }
    assert types - covered == {p.Decision, p.Push}  # the unions: read as their members


def test_decisions_are_built_by_kind_and_read_by_type() -> None:
    d = p.Decision("go", plan=PLAN)
    assert isinstance(d, p.Go) and d.kind == "go" and d == p.Go(plan=PLAN)
    assert p.Decision.from_json(d.to_json()) == d
    assert p.Decision("restore", "why", restore=POINT).to_json()["restore"] == POINT.to_json()
    with pytest.raises(ValueError, match="unknown decision 'maybe'"):
        p.Decision("maybe")
    with pytest.raises(WireError, match="'plan' is missing"):
        p.Decision("go")
    with pytest.raises(WireError, match="'kind' expected one of 'wait', 'go'"):
        decode(p.Decision, {"kind": "later"})


@pytest.mark.parametrize(
    ("cls", "body", "field", "expected"),
    [
        (p.Begin, {"peer": 0, "nonce": "x"}, "revision", "is missing"),
        (
            p.Begin,
            {"peer": "0", "nonce": "x", "revision": 1},
            "peer",
            "expected an integer, got str",
        ),
        (p.Begin, {"peer": True, "nonce": "x", "revision": 1}, "peer", "expected an integer"),
        (
            p.Begin,
            {"peer": 0, "nonce": "x", "revision": 1, "hashes": {"w": 3}},
            "hashes.w",
            "expected a string, got int",
        ),
        (
            p.Begin,
            {"peer": 0, "nonce": "x", "revision": 1, "schema": [["w", [2, "3"], "f"]]},
            "schema[0][1][1]",
            "expected an integer",
        ),
        (
            p.Begin,
            {"peer": 0, "nonce": "x", "revision": 1, "schema": [["w"]]},
            "schema[0]",
            "expected [name, shape, dtype]",
        ),
        (p.Commit, {"peer": 0, "epoch": 1, "round": 0, "ok": 1}, "ok", "expected true or false"),
        (p.Leave, {"peer": 0, "info": []}, "info", "expected an object, got list"),
        (p.Register, {"name": 5}, "name", "expected a string"),
        (p.Heartbeat, {"type": "hb", "info": "x"}, "info", "expected an object"),
        (p.Heartbeat, {"type": "hello"}, "type", "expected one of 'hb'"),
        (p.Push, {"type": "abort", "epoch": None}, "epoch", "expected an integer, got null"),
        (
            p.Decision,
            {"kind": "go", "plan": {**PLAN.to_json(), "transfers": [{"src": 1, "dst": 2}]}},
            "plan.transfers[0].names",
            "is missing",
        ),
        (p.Registered, {"peer_id": 1, "run_id": "r"}, "heartbeat_interval", "is missing"),
        (
            p.Registered,
            {"peer_id": 1, "run_id": "r", "heartbeat_interval": 1, "rendezvous": "x"},
            "rendezvous",
            "expected one of 'coordinator', 'tcpstore'",
        ),
    ],
)
def test_a_bad_field_is_named_with_what_was_expected(
    cls: type, body: dict[str, Any], field: str, expected: str
) -> None:
    with pytest.raises(WireError) as e:
        decode(cls, body)
    assert e.value.field == field
    assert f"field {field!r}" in str(e.value) and expected in str(e.value)


def test_a_body_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(WireError, match="expected an object, got list"):
        decode(p.Commit, [1, 2])


def test_fields_a_message_does_not_declare_are_ignored() -> None:
    assert decode(p.Commit, {"peer": 0, "epoch": 1, "round": 2, "ok": True, "x": 1}).round == 2


def test_checkpoint_reports_are_parts_or_manifests() -> None:
    assert isinstance(p.checkpoint_report({"revision": 1, "manifest": "m"}), p.CheckpointManifest)
    part = p.checkpoint_report({"revision": 1, "part": 0, "parts": 1, "ok": True})
    assert isinstance(part, p.CheckpointPart) and part.hashes == {}
    with pytest.raises(WireError, match="'parts' is missing"):
        p.checkpoint_report({"revision": 1, "part": 0, "ok": True})


def test_a_missing_version_is_the_unversioned_protocol_and_is_refused_by_name() -> None:
    assert decode(p.Register, {"name": "old"}).protocol == UNVERSIONED != PROTOCOL_VERSION
    assert refusal(PROTOCOL_VERSION, them="peer", us="coordinator") is None
    why = refusal(PROTOCOL_VERSION + 1, them="peer", us="coordinator")
    assert why == (
        f"peer speaks isthmus protocol {PROTOCOL_VERSION + 1}, coordinator speaks "
        f"{PROTOCOL_VERSION}; upgrade one of them"
    )
    with pytest.raises(ProtocolMismatch, match=f"protocol {UNVERSIONED} .*no version"):
        check_version(UNVERSIONED, them="peer", us="coordinator")


def test_listener_records_carry_the_version() -> None:
    assert _parse(_listener(("10.0.0.1", 4242)).encode(), 1) == ("10.0.0.1", 4242)
    assert _parse(_listener(None).encode(), 1) is None
    with pytest.raises(ProtocolMismatch, match=f"rank 1 speaks isthmus protocol {UNVERSIONED}"):
        _parse(b"10.0.0.1 4242", 1)  # a record without a version
    with pytest.raises(ProtocolMismatch, match=f"speaks {PROTOCOL_VERSION}"):
        _parse(f"{PROTOCOL_VERSION + 1} 10.0.0.1 4242".encode(), 2)


def test_epoch_members_without_listener_records_compare_versions_in_the_store() -> None:
    import torch.distributed as dist

    from isthmus.comm.connect import check_protocols, publish_protocol

    store = dist.HashStore()
    publish_protocol(store, 0)
    publish_protocol(store, 1)
    check_protocols(store, 0, 2)  # the same version: nothing to say
    store.set("isthmus-protocol/1", str(PROTOCOL_VERSION + 1))
    with pytest.raises(
        ProtocolMismatch, match=f"rank 1 speaks isthmus protocol {PROTOCOL_VERSION + 1}"
    ):
        check_protocols(store, 0, 2)
    publish_protocol(store, 1)
    with pytest.raises(ProtocolMismatch, match=f"rank 2 speaks isthmus protocol {UNVERSIONED}"):
        check_protocols(store, 0, 3)  # rank 2 recorded none
