"""Bad input gets a clear error that names what is wrong, and the run goes on undisturbed."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import pytest
import torch

from conftest import TOKEN, assert_bitwise_equal
from isthmus import AuthError, CoordinatorUnreachable, RoundTimeout, Session, SessionConfig
from isthmus.coordinator.wire import PROTOCOL_VERSION


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_coordinator_names_the_address():
    port = _free_port()  # nothing listens here
    with pytest.raises(CoordinatorUnreachable) as e:
        Session(SessionConfig(coordinator=f"127.0.0.1:{port}", token="t", connect_timeout=1.5))
    msg = str(e.value)
    assert f"127.0.0.1:{port}" in msg and "could not reach the coordinator" in msg


def test_bad_address_is_rejected_before_connecting():
    with pytest.raises(ValueError, match="host:port"):
        Session(SessionConfig(coordinator="no-port-here", token="t"))


def test_wrong_token_and_wrong_schema_are_refused_and_the_run_goes_on(cluster):
    c = cluster(start_peers=2)
    c.spawn("a", steps=60, step_delay=0.05)
    c.spawn("b", steps=60, step_delay=0.05)
    c.wait_until(lambda s: s["revision"] >= 3, "the run to start")

    # a wrong token: refused at once, with the coordinator's reason
    with pytest.raises(AuthError, match="invalid token"):
        Session(
            SessionConfig(coordinator=c.coord.address, token="not-the-token", connect_timeout=5)
        )
    # no token: the session refuses to start; a raw request without one gets a 401 saying so
    with pytest.raises(ValueError, match="token is empty"):
        SessionConfig(coordinator=c.coord.address, token="")
    req = urllib.request.Request(f"http://{c.coord.address}/v1/status")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 401
    assert "missing token" in json.loads(e.value.read())["error"]

    # a peer with a different model: refused, exit code 2, the tensor named in its log
    c.spawn("m", steps=60, model="default")
    assert c.wait("m")["m"] == 2
    log = c.log("m")
    assert "shared state does not match the run" in log
    assert "tensor 'model/" in log

    assert c.wait("a", "b") == {"a": 0, "b": 0}
    st = c.coord.status(events=500)
    assert st["counters"]["refusals"] == 1
    assert st["counters"]["rounds_aborted"] == 0, "an intruder disturbed the run"
    assert c.final("a")["revision"] == 60
    assert_bitwise_equal(c.state("a"), c.state("b"))


def _post(address: str, path: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"http://{address}{path}",
        data=body,
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_malformed_requests_get_400_naming_the_problem(cluster):
    c = cluster(start_peers=1)
    addr = c.coord.address
    code, body = _post(addr, "/v1/begin", b"{not json")
    assert code == 400 and "not valid JSON" in body["error"]
    code, body = _post(addr, "/v1/begin", b"[1, 2]")
    assert code == 400 and "JSON object" in body["error"]
    code, body = _post(addr, "/v1/begin", json.dumps({"peer": 0, "nonce": "x"}).encode())
    assert code == 400 and "'revision'" in body["error"]
    code, body = _post(
        addr,
        "/v1/commit",
        json.dumps({"peer": "zero", "epoch": 1, "round": 0, "ok": True}).encode(),
    )
    assert code == 400 and "'peer'" in body["error"]
    code, body = _post(
        addr,
        "/v1/begin",
        json.dumps({"peer": 0, "nonce": "x", "revision": 0, "schema": [["w"]]}).encode(),
    )
    assert code == 400 and "schema" in body["error"]
    # the coordinator still serves a well-formed peer afterwards
    s = Session(SessionConfig(coordinator=addr, token=TOKEN, connect_timeout=5))
    try:
        w = torch.zeros(3)
        s.register("w", w)
        assert s.run_round(lambda r: r.world) == 1
    finally:
        s.close()


def test_below_min_peers_a_round_waits_then_fails_with_the_reason(cluster):
    c = cluster(min_peers=2)
    s = Session(SessionConfig(coordinator=c.coord.address, token=TOKEN, round_timeout=1.5))
    try:
        s.register("w", torch.zeros(2))
        with pytest.raises(RoundTimeout, match="min_peers is 2"):
            s.begin()
    finally:
        s.close()


def test_a_peer_id_from_before_a_coordinator_restart_cannot_speak_for_a_new_peer(cluster):
    # A restarted coordinator hands out ids from 0 again: a surviving peer's old id 0 must not be
    # taken for the new peer 0 (its schema-less begin would get that peer refused).
    c = cluster(start_peers=1)
    addr = c.coord.address
    code, reg = _post(
        addr, "/v1/register", json.dumps({"name": "new", "protocol": PROTOCOL_VERSION}).encode()
    )
    assert code == 200
    pid, run = reg["peer_id"], reg["run_id"]
    old = {"peer": pid, "run": "0ld0ld00"}
    begin = {**old, "nonce": "n1", "revision": 12}
    code, d = _post(addr, "/v1/begin", json.dumps(begin).encode())
    assert code == 200 and d["kind"] == "evicted", d
    assert run in d["reason"] and "0ld0ld00" in d["reason"] and "restarted" in d["reason"]
    commit = {**old, "epoch": 1, "round": 12, "ok": False, "error": "x"}
    code, d = _post(addr, "/v1/commit", json.dumps(commit).encode())
    assert code == 200 and d["kind"] == "evicted", d
    code, _ = _post(addr, "/v1/leave", json.dumps(old).encode())
    assert code == 200
    # none of it touched the peer that really holds the id
    st = c.coord.status()
    (peer,) = [p for p in st["peers"] if p["id"] == pid]
    assert peer["state"] == "active" and peer["name"] == "new", peer
    assert st["counters"].get("rounds_aborted", 0) == 0


def test_demo_refuses_bad_strategy_options_and_peers_before_starting_anything(capsys, tmp_path):
    from isthmus.cli import main as cli_main

    base = ["demo", "--model", "tiny", "--no-progress", "--run-dir", str(tmp_path / "run")]
    assert cli_main([*base, "--option", "bogus=1"]) == 2
    assert "bogus" in capsys.readouterr().err
    # H = 20 cannot be cut into 3 fragments
    assert cli_main([*base, "--strategy", "streaming", "--option", "fragments=3"]) == 2
    assert "fragments" in capsys.readouterr().err
    assert cli_main([*base, "--byzantine", "7:sign_flip"]) == 2
    assert "peer 7" in capsys.readouterr().err
    assert not (tmp_path / "run").exists(), "nothing may be started for a refused run"


def test_a_timed_out_demo_does_not_count_the_peers_it_stops_as_kills(tmp_path):
    """Peer 1 is frozen (SIGSTOP) for good: peer 0 evicts it and finishes, the demo's bound
    runs out, and the teardown SIGKILLs the frozen process. That is the demo stopping a peer,
    not a kill the user asked for: the summary's ``kills`` stays 0."""
    from isthmus.run.builtin_run import demo_config, run_builtin

    cfg = demo_config(
        {
            "peers": 2,
            "strategy": "ddp",
            "steps": 12,
            "model": "tiny",
            "corpus_bytes": 200_000,
            "fault": {1: ["stop@step:step=4"]},
            "heartbeat_timeout": 1.5,
            "timeout": 25.0,
            "run_dir": str(tmp_path / "run"),
            "progress": False,
        }
    )
    s, _, _ = run_builtin(cfg)
    assert s.kills == 0, s
    assert s.peers_final == 1 and s.peers_started == 2, s
