"""Begin and commit as websocket frames (coordinator/frames.py): every frame round-trips through
the one codec, a malformed frame is refused naming the field and the id it gave, and a reply
written with a decision encoded once reads back as that decision."""

from __future__ import annotations

import json
from typing import Any

import pytest

from isthmus.coordinator import frames
from isthmus.coordinator import protocol as p
from isthmus.coordinator.frames import (
    BadFrame,
    BeginFrame,
    CommitFrame,
    Downlink,
    RoundReply,
    Uplink,
    read_uplink,
    reply_text,
)
from isthmus.coordinator.wire import WireError, decode, encode

PLAN = p.RoundPlan(round=7, epoch=3, members=(2, 5, 9), transfers=(), expected={}, new_epoch=False)
BEGIN = p.Begin(
    peer=5,
    nonce="n1",
    revision=7,
    run="abcd",
    hashes={"w": "00ff"},
    schema=(p.TensorSpec("w", (2, 3), "torch.float32"),),
    prev=p.Vote(epoch=3, round=6),
)
COMMIT = p.Commit(peer=5, epoch=3, round=7, ok=False, run="abcd", error="boom")

UPLINK: list[Any] = [
    BeginFrame(id=1, begin=BEGIN),
    BeginFrame(id=2, begin=p.Begin(peer=5, nonce="n2", revision=8)),
    CommitFrame(id=3, commit=COMMIT),
    p.Heartbeat({"revision": 7, "timing": {"work_s": 0.5}}),
]
DOWNLINK: list[Any] = [
    RoundReply(id=1, decision=p.Go(plan=PLAN, prev="committed")),
    RoundReply(id=3, decision=p.Aborted(reason="peer 9 died")),
    RoundReply(id=4, status=400, error="bad frame: field 'begin.nonce' is missing"),
    p.AbortPush("a member died", epoch=3, round=7),
    p.EvictedPush("removed"),
    p.ProbePush(peer=9, address="10.0.0.9:4100"),
]


@pytest.mark.parametrize("frame", UPLINK, ids=lambda f: type(f).__name__)
def test_every_uplink_frame_round_trips_and_reads_as_itself(frame: Any) -> None:
    text = json.dumps(encode(frame))
    assert read_uplink(text) == frame
    assert type(decode(Uplink, json.loads(text))) is type(frame)


@pytest.mark.parametrize("frame", DOWNLINK, ids=lambda f: type(f).__name__)
def test_every_downlink_frame_round_trips(frame: Any) -> None:
    back = decode(Downlink, json.loads(json.dumps(encode(frame))))
    assert type(back) is type(frame) and back == frame


@pytest.mark.parametrize(
    ("text", "fid", "words"),
    [
        ("{not json", -1, "frame is not JSON"),
        ("[1, 2]", -1, "expected an object, got list"),
        ('{"type": "launch", "id": 4}', 4, "field 'type' expected one of 'hb', 'begin'"),
        ('{"id": 4}', 4, "field 'type' expected one of"),
        ('{"type": "begin", "id": 5}', 5, "field 'begin' is missing"),
        (
            '{"type": "begin", "id": 6, "begin": {"peer": 1, "revision": 2}}',
            6,
            "field 'begin.nonce' is missing",
        ),
        (
            '{"type": "begin", "id": 7, "begin": {"peer": 1, "nonce": "n", "revision": "2"}}',
            7,
            "field 'begin.revision' expected an integer, got str",
        ),
        (
            '{"type": "commit", "id": true, "commit": {"peer": 1, "epoch": 1, "round": 0}}',
            -1,  # a boolean is no id
            "field 'id' expected an integer, got bool",
        ),
        (
            '{"type": "commit", "id": 8, "commit": {"peer": 1, "epoch": 1, "round": 0}}',
            8,
            "field 'commit.ok' is missing",
        ),
        (
            '{"type": "begin", "id": 9, "begin": {"peer": 1, "nonce": "n", "revision": 0,'
            ' "schema": [["w", [2, -3], "f"]]}}',
            9,
            "field 'begin.schema[0][1][1]'",
        ),
    ],
)
def test_a_malformed_frame_is_refused_naming_the_field_and_its_id(
    text: str, fid: int, words: str
) -> None:
    with pytest.raises(BadFrame) as e:
        read_uplink(text)
    assert e.value.id == fid
    assert words in str(e.value), str(e.value)


def test_a_malformed_heartbeat_says_it_was_one() -> None:
    with pytest.raises(BadFrame) as e:
        read_uplink('{"type": "hb", "info": [1]}')
    assert e.value.type == "hb" and "field 'info' expected an object" in str(e.value)


def test_a_reply_with_its_decision_spliced_in_reads_back_as_that_decision() -> None:
    go = p.Go(plan=PLAN, prev="committed")
    text = reply_text(12, decision_json=json.dumps(encode(go)))
    reply = decode(RoundReply, json.loads(text))
    assert reply == RoundReply(id=12, status=200, decision=go)
    assert json.loads(reply_text(12, go)) == json.loads(text)
    # the bytes the coordinator sends each member are that text's, byte for byte
    assert frames.reply_frame(12, json.dumps(encode(go)).encode()) == text.encode()
    refused = decode(Downlink, json.loads(reply_text(-1, status=400, error="bad frame: x")))
    assert refused == RoundReply(id=-1, status=400, error="bad frame: x")


def test_a_reply_with_a_malformed_decision_is_refused_naming_it() -> None:
    raw = {"type": "reply", "id": 3, "status": 200, "decision": {"kind": "go"}}
    with pytest.raises(WireError, match="decision"):
        decode(Downlink, raw)


# -- the direct reading of the frames peers send every round --------------------------------------
_ODD = [None, 0, -1, True, False, 1.5, "", "x", [], [1], {}, {"a": "b"}, {"a": 1}, {"epoch": 1}]


def _variants(raw: dict[str, Any]) -> list[Any]:
    """``raw`` and, for every field at every depth, that field removed and set to each odd
    value, plus an unknown field added."""
    out: list[Any] = [raw, {**raw, "extra": 1}]
    for key, value in raw.items():
        out.append({k: v for k, v in raw.items() if k != key})
        out.extend({**raw, key: odd} for odd in _ODD)
        if isinstance(value, dict):
            out.extend({**raw, key: inner} for inner in _variants(value))
    return out


_COMMON = [
    encode(
        BeginFrame(id=1, begin=p.Begin(peer=5, nonce="n", revision=7, run="r", hashes={"w": "0"}))
    ),
    encode(BeginFrame(id=2, begin=p.Begin(peer=5, nonce="n", revision=7, prev=p.Vote(3, 6)))),
    encode(
        BeginFrame(
            id=5,
            begin=p.Begin(
                peer=5, nonce="n", revision=7, prev=p.Vote(3, 6), info={"step": 3, "t": {"a": 1}}
            ),
        )
    ),
    encode(CommitFrame(id=3, commit=COMMIT)),
    encode(CommitFrame(id=4, commit=p.Commit(peer=5, epoch=3, round=7, ok=True))),
    encode(p.Heartbeat({"revision": 7, "timing": {"work_s": 0.5}})),
]


def _generic(raw: Any) -> Any:
    try:
        return decode(Uplink, raw)
    except WireError as e:
        return ("error", str(e))


@pytest.mark.parametrize("base", _COMMON, ids=lambda r: r["type"])
def test_the_direct_reading_takes_and_gives_exactly_what_the_codec_does(base: Any) -> None:
    from isthmus.coordinator.frames import _read_common

    taken = 0
    for raw in _variants(base):
        fast = _read_common(raw)
        if fast is not None:  # where it reads a frame, the codec reads the same one
            taken += 1
            assert fast == _generic(raw), raw
            assert type(fast) is type(_generic(raw))
            assert repr(fast) == repr(_generic(raw))
        text = json.dumps(raw)
        try:
            got: Any = read_uplink(text)
        except BadFrame as e:
            got = ("error", str(e).removeprefix("bad frame: "))
        assert got == _generic(raw), raw  # and read_uplink answers as the codec alone would
    assert _read_common(base) is not None  # the common shapes take the direct way
    assert taken > 3


TRICKY = (
    '{"type":"hb","info":{"a":1,"a":2}}',  # a repeated key: the last one counts
    '{"type":"hb","info":{"big":123456789012345678901234567890,"neg":-9223372036854775809}}',
    '{"type":"hb","info":{"x":1e400,"y":NaN,"z":-Infinity}}',  # what only json takes
    '{"type":"hb","info":{"s":"\\ud800 \\u00e9 \\ud83d\\ude00","f":0.1,"g":-0.0,"e":1.5e-7}}',
    '{"type":"begin","id":18446744073709551616,"begin":{"peer":1,"nonce":"n","revision":0}}',
    '{"type":"begin","id":3,"begin":{"peer":1,"nonce":"1234567890123456789012","revision":0}}',
    '{"type":"hb","info":{"f":0.12345678901234567890,"g":1234567890123456789e-5,"n":"\u0661\u0662"}}',
    '{"type":"hb","info":{"n":"\u00e9\u00e9 1234567890123456789 \u0663"}}',
    ' {"type" : "commit" , "id":4,"commit":{"peer":1,"epoch":2,"round":3,"ok":true}} ',
    '\ufeff{"type":"hb"}',
    '{"type":"hb",}',
    '{"type":"hb"',
    "[1, 2",
    "",
)


@pytest.mark.parametrize("text", TRICKY)
def test_the_fast_parser_reads_every_frame_as_the_standard_one(
    text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where orjson is installed the frames are read with it, only where it reads them as the
    json module does: the same message, or the same error (json's own words)."""
    pytest.importorskip("orjson")

    def read(fast: Any) -> Any:
        monkeypatch.setattr(frames, "_fast", fast)
        try:
            return ("ok", repr(frames.read_uplink(text)))
        except frames.BadFrame as e:
            return ("bad", str(e), e.id)

    import orjson

    assert read(orjson.loads) == read(None)
