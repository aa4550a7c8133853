"""The gate alone, against a fake roster: who may pass, the limits on registrations, and how a
handler's malformed-request error is answered (no server, no sockets)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from typing import Any

from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from isthmus.coordinator.auth import Identities, join_token
from isthmus.coordinator.bodies import BadRequest
from isthmus.coordinator.gate import Gate
from isthmus.coordinator.limits import Limits

ADMIN = "gate-test-admin"


class FakeRoster:
    """The gate's view of the run: ``live`` is the set of active peer ids."""

    def __init__(self, live: set[int]) -> None:
        self.live = live

    def live_peers(self, among: Iterable[int] | None = None) -> int:
        return len(self.live if among is None else self.live & set(among))

    def peer_ids(self) -> set[int]:
        return set(self.live)


def make_gate(live: set[int], **limits: Any) -> Gate:
    return Gate(
        identities=Identities(ADMIN),
        limits=Limits(**limits),
        roster=FakeRoster(live),
        open_path=lambda path: path == "/",
    )


def ask(gate: Gate, method: str, path: str, token: str | None, handler: Any = None) -> web.Response:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    request = make_mocked_request(method, path, headers=headers)

    async def ok(_: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    return asyncio.run(gate.middleware(request, handler or ok))


def error_of(resp: web.Response) -> str:
    assert resp.body is not None
    return json.loads(bytes(resp.body))["error"]


def test_tokens_decide_and_open_paths_pass_without_one():
    gate = make_gate(set())
    assert ask(gate, "GET", "/v1/status", None).status == 401
    assert ask(gate, "GET", "/v1/status", "wrong").status == 401
    assert ask(gate, "GET", "/v1/status", ADMIN).status == 200
    assert ask(gate, "GET", "/v1/status", join_token(ADMIN, "alice")).status == 200
    assert ask(gate, "GET", "/", None).status == 200  # the dashboard checks access itself
    assert gate.refused == 2


def test_admin_routes_need_the_admin_token():
    gate = make_gate(set())
    resp = ask(gate, "POST", "/v1/admin/revoke", join_token(ADMIN, "alice"))
    assert resp.status == 403 and "needs the admin token" in error_of(resp)
    assert ask(gate, "POST", "/v1/admin/revoke", ADMIN).status == 200


def test_a_join_token_acts_only_for_its_own_peers():
    gate = make_gate({0, 1})
    alice, bob = join_token(ADMIN, "alice"), join_token(ADMIN, "bob")
    gate.bind(make_mocked_request("POST", "/", headers={"Authorization": f"Bearer {alice}"}), 0)
    assert ask(gate, "GET", "/v1/ws?peer=0", alice).status == 200
    resp = ask(gate, "GET", "/v1/ws?peer=0", bob)
    assert resp.status == 403 and "may not act for peer 0" in error_of(resp)
    assert ask(gate, "GET", "/v1/ws?peer=0", ADMIN).status == 200
    assert ask(gate, "GET", "/v1/ws?peer=x", bob).status == 400  # not a peer id


def test_registrations_are_bounded_by_what_the_roster_says_is_live():
    live = {0}
    gate = make_gate(live, max_peers=2, max_peers_per_identity=1)
    alice = join_token(ADMIN, "alice")
    gate.bind(make_mocked_request("POST", "/", headers={"Authorization": f"Bearer {alice}"}), 0)
    resp = ask(gate, "POST", "/v1/register", alice)
    assert resp.status == 429 and "max_peers_per_identity=1" in error_of(resp)
    assert ask(gate, "POST", "/v1/register", join_token(ADMIN, "bob")).status == 200
    live.add(1)
    resp = ask(gate, "POST", "/v1/register", ADMIN)
    assert resp.status == 429 and "the run is full (2 live peers" in error_of(resp)
    live.discard(0)  # alice's peer died
    assert ask(gate, "POST", "/v1/register", alice).status == 200


def test_a_handlers_bad_request_is_a_400_and_a_bug_a_500_without_its_traceback():
    gate = make_gate(set())

    async def malformed(_: web.Request) -> web.Response:
        raise BadRequest("field 'x' is wrong")

    async def buggy(_: web.Request) -> web.Response:
        raise KeyError("secret detail")

    resp = ask(gate, "GET", "/v1/status", ADMIN, malformed)
    assert resp.status == 400 and error_of(resp) == "bad request to /v1/status: field 'x' is wrong"
    resp = ask(gate, "GET", "/v1/status", ADMIN, buggy)
    assert resp.status == 500 and "secret" not in error_of(resp)
