"""Nobody without the run's credentials gets in (issue 21), against live coordinators.

* A peer pinned to another fingerprint refuses the coordinator, naming both fingerprints.
* One 3-peer run with TLS, a join token per peer and the authenticated rendezvous, attacked
  while it trains: without a token, with a wrong one, with a revoked one (revoked at start, and
  one revoked live after it registered), with a valid join token acting for another's peer;
  then a seeded, bounded fuzzer (malformed, oversized, truncated and replayed requests, store
  messages and websocket frames, raw bytes on the TLS port). The coordinator never answers
  5xx with a traceback, never grows beyond bounds, and the run ends in parity, untouched.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import resource
import socket
import ssl
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from conftest import assert_bitwise_equal
from isthmus.comm.session import Session
from isthmus.comm.session_config import SessionConfig
from isthmus.coordinator.auth import join_token
from isthmus.coordinator.client import CoordinatorClient, CoordinatorError, TLSRefused
from isthmus.coordinator.limits import Limits
from isthmus.coordinator.membership import MembershipConfig
from isthmus.coordinator.server import Coordinator, CoordinatorConfig
from isthmus.coordinator.tls import self_signed
from isthmus.coordinator.wire import PROTOCOL_VERSION
from isthmus.run import forkserver
from isthmus.run.forkserver import PeerProcess
from isthmus.run.job import PeerJob

ADMIN = "security-test-admin-token"
STEPS = 80  # long enough (0.1 s a step) that the attacks and the fuzzer run during training


def test_a_peer_pinned_to_another_fingerprint_refuses_naming_both(tmp_path: Path) -> None:
    real = self_signed(str(tmp_path / "real"))
    other = self_signed(str(tmp_path / "other"))
    with Coordinator(CoordinatorConfig(token=ADMIN, port=0, tls=real)) as c:
        cfg = SessionConfig(
            coordinator=c.address,
            token=join_token(ADMIN, "p1"),
            coordinator_fingerprint=other.fingerprint,
            connect_timeout=5.0,
        )
        with pytest.raises(TLSRefused) as e:
            Session(cfg)
        assert real.fingerprint in str(e.value) and other.fingerprint in str(e.value)
        assert c.status()["counters"]["registrations"] == 0
        # the right pin is let in
        cfg.coordinator_fingerprint = real.fingerprint
        s = Session(cfg)
        s.close()


def test_slow_and_flooding_clients_cost_only_themselves(tmp_path: Path) -> None:
    """Clients holding half-sent requests and one identity flooding requests: another identity
    is still answered at once, and only the flooder is told to slow down (429)."""
    tls = self_signed(str(tmp_path / "tls"))
    limits = Limits(requests_per_s=1.0, request_burst=10.0)
    with Coordinator(CoordinatorConfig(token=ADMIN, port=0, tls=tls, limits=limits)) as c:
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        slow = []
        for i in range(20):  # headers or a body promised and never finished
            raw = socket.create_connection(("127.0.0.1", c.port), timeout=10)
            conn = ctx.wrap_socket(raw)
            partial = b"POST /v1/store HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{"
            conn.sendall(partial if i % 2 else b"GET /v1/status HTTP/1.1\r\nHost: x\r\n")
            slow.append(conn)
        flood = CoordinatorClient(
            c.address, join_token(ADMIN, "flood"), fingerprint=tls.fingerprint, connect_timeout=0.5
        )
        calm = CoordinatorClient(c.address, join_token(ADMIN, "calm"), fingerprint=tls.fingerprint)
        try:
            limited = 0
            for _ in range(14):
                try:
                    flood.post("/v1/leave", {"peer": 12345})
                except CoordinatorError as e:
                    assert "429" in str(e) or "may not act" in str(e), e
                    limited += "429" in str(e)
            assert limited > 0, "the flooder was never told to slow down"
            assert calm.get("/v1/status")["run_id"] == c.run_id
        finally:
            flood.close()
            calm.close()
            for conn in slow:
                conn.close()


# ------------------------------------------------------------------------------ the attacked run


class Run:
    """A TLS coordinator in this process and peer processes with join tokens of their own."""

    def __init__(self, tmp: Path) -> None:
        self.dir = tmp
        self.tls = self_signed(str(tmp / "tls"))
        self.coord = Coordinator(
            CoordinatorConfig(
                token=ADMIN,
                port=0,
                tls=self.tls,
                heartbeat_interval=0.25,
                revoked=("mallory",),
                limits=Limits(max_body_bytes=256 * 1024, max_peers_per_identity=2),
                membership=MembershipConfig(start_peers=3, heartbeat_timeout=3.0),
            )
        ).start()
        self.procs: dict[str, PeerProcess] = {}

    def spawn(self, name: str, **job: Any) -> None:
        j = PeerJob.from_flat(
            coordinator=self.coord.address,
            token=join_token(ADMIN, name),
            coordinator_fingerprint=self.tls.fingerprint,
            name=name,
            out_dir=str(self.dir),
            model="tiny",
            corpus_bytes=200_000,
            batch_size=8,
            strategy="ddp",
            collective_timeout=10.0,
            connect_timeout=10.0,
            round_timeout=60.0,
            **job,
        )
        path = self.dir / f"{name}.job.json"
        path.write_text(j.to_json())
        log = self.dir / f"{name}.log"
        log.write_bytes(b"")
        # forked from the warm server (torch imported once), as the launcher starts peers
        self.procs[name] = forkserver.popen(
            [sys.executable, "-m", "isthmus.run.job", str(path)],
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            log_path=log,
        )

    def log(self, name: str) -> str:
        return (self.dir / f"{name}.log").read_text(errors="replace")[-3000:]

    def wait_revision(self, n: int, timeout: float = 240.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = int(self.coord.status(events=0)["revision"])
            if r >= n:
                return r
            time.sleep(0.05)
        raise AssertionError(f"no revision {n} within {timeout}s: {self.coord.status()}")

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
        self.coord.stop()


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


async def register(base: str, fp: bytes, token: str) -> int:
    conn = aiohttp.TCPConnector(ssl=aiohttp.Fingerprint(fp))
    async with aiohttp.ClientSession(connector=conn) as s:
        headers = {"Authorization": f"Bearer {token}"}
        async with s.post(
            base + "/v1/register",
            json={"name": "fz", "protocol": PROTOCOL_VERSION},
            headers=headers,
        ) as r:
            assert r.status == 200, await r.text()
            pid = int((await r.json())["peer_id"])
        async with s.post(base + "/v1/leave", json={"peer": pid}, headers=headers) as r:
            assert r.status == 200, await r.text()
        return pid


async def attack(base: str, fp: bytes, run_id: str, c: Coordinator) -> dict[str, Any]:
    """Each credential an attacker may hold, against each door; returns what was answered."""
    out: dict[str, Any] = {}
    conn = aiohttp.TCPConnector(ssl=aiohttp.Fingerprint(fp))
    async with aiohttp.ClientSession(connector=conn) as s:

        async def ask(token: str | None, method: str, path: str, body: Any = None) -> tuple:
            headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
            async with s.request(method, base + path, json=body, headers=headers) as r:
                return r.status, (await r.json(content_type=None) or {}).get("error", "")

        store_set = {
            "op": "set",
            "key": f"isthmus/{run_id}/attacker",
            "value": base64.b64encode(b"6.6.6.6 1").decode(),
            "peer": 0,
            "run": run_id,
        }
        store_get = {"op": "get", "key": f"isthmus/{run_id}/x", "peer": 0, "hold_s": 0}
        tokens = {
            "none": None,
            "wrong": "not-the-token",
            "forged": join_token("a guess at the admin token", "peer0"),
            "revoked": join_token(ADMIN, "mallory"),
        }
        for label, tok in tokens.items():
            out[label] = [
                await ask(tok, "GET", "/v1/status"),
                await ask(
                    tok, "POST", "/v1/register", {"name": "evil", "protocol": PROTOCOL_VERSION}
                ),
                await ask(tok, "POST", "/v1/store", store_set),
                await ask(tok, "POST", "/v1/store", store_get),
                await ask(tok, "POST", "/v1/admin/revoke", {"name": "peer0"}),
            ]
        # a valid join token acting for another identity's peer, or as the operator
        eve = join_token(ADMIN, "eve")
        pid = await ask(eve, "POST", "/v1/register", {"name": "eve", "protocol": PROTOCOL_VERSION})
        out["eve_registered"] = pid
        out["eve_for_peer0"] = [
            await ask(eve, "POST", "/v1/store", store_set),
            await ask(eve, "POST", "/v1/commit", {"peer": 0, "epoch": 1, "round": 0, "ok": False}),
            await ask(eve, "POST", "/v1/leave", {"peer": 0, "run": run_id}),
            await ask(eve, "POST", "/v1/checkpoint", {"peer": 0, "revision": 1, "manifest": "x"}),
            await ask(eve, "POST", "/v1/admin/revoke", {"name": "peer0"}),
        ]
        out["eve_status"] = await ask(eve, "GET", "/v1/status")
        # limits.max_peers_per_identity=2: a third live peer of eve's is refused
        out["eve_more"] = [
            await ask(eve, "POST", "/v1/register", {"name": "eve", "protocol": PROTOCOL_VERSION}),
            await ask(eve, "POST", "/v1/register", {"name": "eve", "protocol": PROTOCOL_VERSION}),
        ]
        # the operator revokes eve live: her peer is evicted and her token refused
        async with s.post(
            base + "/v1/admin/revoke",
            json={"name": "eve"},
            headers={"Authorization": f"Bearer {ADMIN}"},
        ) as r:
            out["revoke_eve"] = (r.status, await r.json())
        out["eve_after"] = [
            await ask(eve, "GET", "/v1/status"),
            await ask(eve, "POST", "/v1/register", {"name": "eve", "protocol": PROTOCOL_VERSION}),
        ]
    return out


async def fuzz(base: str, fp: bytes, run_id: str, port: int, seed: int, own: int) -> dict[str, Any]:
    """A few thousand hostile requests, frames and byte strings from the holder of a join
    token whose peer ``own`` registered and left (so requests in its name reach the handlers
    and the store, but cannot join a round); returns the answers' tally and every 5xx answer.
    It does not register: a live peer of its own could join rounds, which any peer may do."""
    rng = random.Random(seed)
    me = join_token(ADMIN, "fuzzer")
    tally: dict[str, int] = {}
    bad: list[str] = []
    conn = aiohttp.TCPConnector(ssl=aiohttp.Fingerprint(fp), limit=8)
    paths = ["/v1/begin", "/v1/commit", "/v1/leave", "/v1/checkpoint"]
    paths += ["/v1/store", "/v1/status", "/v1/ws", "/v1/admin/revoke", "/metrics", "/", "/nope"]
    tokens = [me, me, me, "", "garbage", join_token(ADMIN, "mallory"), me + "x"]

    def junk(depth: int = 0) -> Any:
        kind = rng.randrange(9 if depth < 3 else 6)
        if kind == 0:
            return rng.randrange(-(2**70), 2**70)
        if kind == 1:
            return rng.choice([None, True, False, 1.5, float("1e308"), -0.0])
        if kind == 2:
            return "".join(chr(rng.randrange(1, 0x2FFF)) for _ in range(rng.randrange(40)))
        if kind == 3:
            return f"isthmus/{run_id}/fuzz/{rng.randrange(50)}"
        if kind == 4:
            return base64.b64encode(rng.randbytes(rng.randrange(64))).decode()
        if kind == 5:
            return rng.randrange(-3, 5)
        if kind == 6:
            return [junk(depth + 1) for _ in range(rng.randrange(4))]
        keys = ["peer", "op", "key", "keys", "value", "run", "epoch", "round", "ok", "name"]
        keys += ["nonce", "revision", "hashes", "schema", "amount", "hold_s", "info", "part"]
        return {rng.choice(keys): junk(depth + 1) for _ in range(rng.randrange(6))}

    ops = ["set", "get", "add", "compare_set", "wait", "check", "delete", "num_keys", "??"]
    replay: list[tuple[str, bytes]] = []

    async def one(s: aiohttp.ClientSession, i: int) -> None:
        path = rng.choice(paths)
        tok = rng.choice(tokens)
        headers = {"Authorization": f"Bearer {tok}"} if tok else {}
        roll = rng.random()
        if roll < 0.15:
            raw = json.dumps({"peer": own, "x": junk(2)} if rng.random() < 0.5 else junk())
            raw = raw.encode()[: rng.randrange(1, 200)]  # truncated
        elif roll < 0.2:
            raw = rng.randbytes(300 * 1024)  # over max_body_bytes
        elif roll < 0.3 and replay:
            path, raw = rng.choice(replay)
        elif roll < 0.55:
            path = "/v1/store"
            body = junk(3) if rng.random() < 0.2 else {}
            if not isinstance(body, dict):
                body = {}
            body.update(op=rng.choice(ops), key=junk(), keys=[junk(), junk()], value=junk())
            body.update(peer=rng.choice([own, own, 0, 99, "0", None]), hold_s=rng.random() * 0.05)
            raw = json.dumps(body).encode()
        else:
            body = junk(2)
            if isinstance(body, dict) and rng.random() < 0.7:
                body["peer"] = own  # reaches the handler behind the gate
            raw = json.dumps(body).encode()
        if len(replay) < 200:
            replay.append((path, raw))
        method = rng.choice(["POST", "POST", "GET", "PUT", "DELETE"])
        try:
            async with s.request(
                method,
                base
                + path
                + rng.choice(["", f"?peer={own}", "?peer=x&run=zz", "?events=-5", "?events=a"]),
                data=raw,
                headers={**headers, "Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=10),
            ) as r:
                text = await r.text(errors="replace")
                tally[str(r.status)] = tally.get(str(r.status), 0) + 1
                if r.status >= 500 or "Traceback" in text:
                    bad.append(f"{method} {path} -> {r.status}: {text[:300]}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            tally[type(e).__name__] = tally.get(type(e).__name__, 0) + 1

    async with aiohttp.ClientSession(connector=conn) as s:
        for start in range(0, 2000, 8):
            await asyncio.gather(*(one(s, i) for i in range(start, start + 8)))
        # websocket frames: heartbeats with junk, broken JSON, binary, a flood past the message
        # bucket, one frame over the size limit; as its own (left) peer and as others'
        for target in [own, own, 0, "x"]:
            try:
                async with s.ws_connect(
                    f"{base}/v1/ws?peer={target}&run={run_id}",
                    headers={"Authorization": f"Bearer {me}"},
                ) as ws:
                    for _ in range(250):
                        roll = rng.random()
                        if roll < 0.5:
                            await ws.send_str(json.dumps({"type": "hb", "info": junk()}))
                        elif roll < 0.8:
                            await ws.send_str("{" * rng.randrange(1, 100))
                        else:
                            await ws.send_bytes(rng.randbytes(rng.randrange(100)))
                    await ws.send_str("x" * 1_100_000)  # over max_ws_message_bytes
                    tally["ws"] = tally.get("ws", 0) + 1
            except (aiohttp.ClientError, ConnectionError, asyncio.TimeoutError) as e:
                tally["ws:" + type(e).__name__] = tally.get("ws:" + type(e).__name__, 0) + 1
    # raw bytes on the TLS port: plain HTTP, a truncated handshake, noise
    for payload in [
        b"GET /v1/status HTTP/1.1\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01",
        b"\x00" * 4096,
    ]:
        for _ in range(20):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(payload[: rng.randrange(1, len(payload) + 1)])
    return {"tally": tally, "bad": bad}


def test_an_attacked_and_fuzzed_run_ends_in_parity_untouched(tmp_path: Path) -> None:
    run = Run(tmp_path)
    try:
        c = run.coord
        for name in ("peer0", "peer1", "peer2"):
            run.spawn(name, steps=STEPS, step_delay=0.1)
        run.wait_revision(3)
        fp = bytes.fromhex(run.tls.fingerprint.replace(":", ""))
        base = f"https://{c.address}"
        answers = asyncio.run(attack(base, fp, c.run_id, c))
        for label in ("none", "wrong", "forged", "revoked"):
            assert [status for status, _ in answers[label]] == [401] * 5, (label, answers[label])
        assert "revoked by the operator" in answers["revoked"][0][1]
        assert "invalid token" in answers["wrong"][0][1] and "missing" in answers["none"][0][1]
        assert answers["eve_registered"][0] == 200
        assert [s for s, _ in answers["eve_for_peer0"]] == [403] * 5, answers["eve_for_peer0"]
        assert answers["eve_status"][0] == 200  # a join token reads the status
        assert [s for s, _ in answers["eve_more"]] == [200, 429], answers["eve_more"]
        status, reply = answers["revoke_eve"]
        eves = c.gate.identities.peers_of("eve")
        assert status == 200 and len(eves) == 2 and set(reply["evicted"]) <= set(eves)
        assert all(c.membership.peers[p].state.value != "active" for p in eves)
        assert [s for s, _ in answers["eve_after"]] == [401, 401]
        assert not any("attacker" in k for k in c.store.data), "a store key was written"

        # the fuzzer's own peer: registered, then left
        own = asyncio.run(register(base, fp, join_token(ADMIN, "fuzzer")))
        assert c.membership.peers[own].state.value == "left"
        before = c.status(events=0)["revision"]
        rss0 = rss_mb()
        result = asyncio.run(fuzz(base, fp, c.run_id, c.port, seed=21, own=own))
        assert not result["bad"], result["bad"][:5]
        tally = result["tally"]
        assert sum(v for k, v in tally.items() if k.isdigit()) >= 1900, tally
        assert {"400", "401", "403", "413"} <= set(tally), tally
        # bounded: the coordinator's tables and this process (the coordinator and the fuzzer)
        assert rss_mb() - rss0 < 64, "the coordinator grew by 64 MB under the fuzzer"
        assert len(c.store.data) <= c.gate.limits.max_store_keys
        assert len(c.hub.sockets) <= 4 and len(c.membership.peers) < 10
        assert c.status(events=0)["revision"] > before, "the run stalled under the fuzzer"

        for name, p in run.procs.items():
            assert p.wait(120) == 0, run.log(name)
        finals = [json.loads((tmp_path / f"{n}.final.json").read_text()) for n in run.procs]
        assert {f["step"] for f in finals} == {STEPS} and len({f["digest"] for f in finals}) == 1
        states = [torch.load(tmp_path / f"{n}.state.pt") for n in run.procs]
        assert_bitwise_equal(states[0], states[1])
        assert_bitwise_equal(states[0], states[2])
        st = c.status(events=2000)
        aborts = [e for e in st["events"] if "reason" in e]  # aborts, evictions: with why
        assert st["counters"]["rounds_committed"] == STEPS, aborts
        assert st["counters"]["rounds_aborted"] == 0, aborts
        members = {p["name"] for p in st["peers"] if p["state"] == "left"}
        assert {"peer0", "peer1", "peer2"} <= members
    finally:
        run.close()
