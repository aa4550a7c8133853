"""The coordinator's web side: the live dashboard at ``/``, its event stream, and ``/metrics``.

Routes (added to the coordinator's aiohttp application by :meth:`Dashboard.install`):

* ``GET /`` and ``GET /static/...``: the page (a static asset of this package). It holds no run
  data, so it is served to anyone; it asks for the token.
* ``POST /login`` ``{"token": ...}`` (JSON or a form): sets the session cookie (see
  :mod:`.auth`), 401 for a wrong token. ``POST /logout`` clears it.
* ``GET /v1/dashboard/stream``: server-sent events, one ``snapshot`` event (JSON) at every
  change of the run and at least once a second; ``GET /v1/dashboard/snapshot``: the same JSON
  once; ``GET /v1/dashboard/session``: 200 when the request may see the run, else 401.
* ``GET /metrics``: the Prometheus text format (:mod:`.metrics`).

Everything but the page and ``/login`` needs the token: a bearer header or the cookie; without
it the answer is 401 and no run data. With ``CoordinatorConfig.metrics_port`` set, ``/metrics``
is also served there without a token, on ``metrics_host``: bind it where only the monitoring
system can reach it.

A watcher task on the coordinator's event loop wakes at each change of the membership and feeds
:class:`~.view.RunView` (world size, round durations, aborts, stragglers) and the round duration
histogram; it reads the membership without the coordinator's lock because it runs on the loop
that makes every change (the lock only guards reads from other threads).

The dashboard knows its coordinator only as a :class:`RunSource`: the run id, the port, the
membership (read only), the clock, the status and a wait for the next change.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import json
import logging
import socket
from collections.abc import Iterable
from typing import Any, Protocol

from aiohttp import web

from isthmus.coordinator.auth import Identities
from isthmus.coordinator.membership import Membership
from isthmus.coordinator.peers import PeerState
from isthmus.coordinator.web.metrics import CONTENT_TYPE, RunMetrics
from isthmus.coordinator.web.view import RunView
from isthmus.coordinator.web.viewer_auth import TokenCheck

__all__ = ["Dashboard", "RunSource"]

log = logging.getLogger("isthmus.coordinator.web")

PUSH_EVERY_S = 1.0
"""A stream sends a snapshot at least this often (losses and steps change between membership
changes)."""
MIN_GAP_S = 0.2
"""...and at most every this many seconds, however often the membership changes."""
SAMPLE_EVERY_S = 1.0
"""How often peers' reported steps and losses are sampled when nobody is looking."""

_STATIC = {
    "index.html": "text/html",
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
}
_HEADERS = {
    # the page loads only its own files and talks only to this coordinator
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; "
    "base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def _asset(name: str) -> bytes:
    return importlib.resources.files(__package__).joinpath("static", name).read_bytes()


class RunSource(Protocol):
    """What the dashboard reads of its coordinator
    (:class:`~isthmus.coordinator.server.Coordinator` is one). ``port`` is read after the
    coordinator listens (0 may become a picked port)."""

    run_id: str
    port: int
    membership: Membership

    def now(self) -> float:
        """Seconds since the coordinator started (the clock of its events)."""
        ...

    def status(self, events: int = 50) -> dict[str, Any]:
        """``/v1/status``'s dict."""
        ...

    async def changed(self, timeout: float) -> None:
        """Return at the run's next change, or after ``timeout`` seconds."""
        ...


class Dashboard:
    """The web routes of one coordinator (``source``) whose credentials are ``identities``.

    ``metrics_at`` is the ``(host, port)`` where ``/metrics`` is also served without a token
    (port 0 picks one; None: not served there)."""

    PATHS = frozenset(
        {
            "/",
            "/favicon.ico",
            "/login",
            "/logout",
            "/metrics",
            "/v1/dashboard/session",
            "/v1/dashboard/snapshot",
            "/v1/dashboard/stream",
        }
    )

    def __init__(
        self,
        source: RunSource,
        identities: Identities,
        *,
        metrics_at: tuple[str, int] | None = None,
    ) -> None:
        self.source = source
        self.metrics_at = metrics_at
        self.check = TokenCheck(identities)
        self.view = RunView()
        self.metrics = RunMetrics(lambda: source.status(events=0), self.view, self.now)
        self.metrics_port: int | None = None
        """Where the token-less ``/metrics`` listens (None: not served)."""
        self._updated: asyncio.Event | None = None
        self._closing: asyncio.Event | None = None
        self._watcher: asyncio.Future[None] | None = None
        self._metrics_runner: web.AppRunner | None = None
        self._last_event: dict[str, Any] | None = None
        self._sampled_at = -1.0
        self._snapshot: tuple[float, dict[str, Any]] | None = None

    def now(self) -> float:
        """The coordinator's clock (seconds since it started, as in its events)."""
        return self.source.now()

    def handles(self, path: str) -> bool:
        """True for the paths that check access themselves (the coordinator's auth middleware
        lets them through)."""
        return path in self.PATHS or path.startswith("/static/")

    def install(self, app: web.Application) -> None:
        """Add the routes and start/stop the watcher (and the metrics port) with ``app``."""
        app.add_routes(
            [
                web.get("/", self._page),
                web.get("/static/{name}", self._static),
                web.get("/favicon.ico", self._favicon),
                web.post("/login", self._login),
                web.post("/logout", self._logout),
                web.get("/v1/dashboard/session", self._session),
                web.get("/v1/dashboard/snapshot", self._snapshot_json),
                web.get("/v1/dashboard/stream", self._stream),
                web.get("/metrics", self._metrics),
            ]
        )
        app.on_startup.append(self._on_startup)
        app.on_shutdown.append(self._on_shutdown)
        app.on_cleanup.append(self._on_cleanup)

    # -- lifecycle ------------------------------------------------------------------------------
    async def _on_startup(self, app: web.Application) -> None:
        self._updated = asyncio.Event()
        self._closing = asyncio.Event()
        if self.metrics_at is not None:  # first: if it fails there is nothing to stop
            await self._serve_metrics(*self.metrics_at)
        self._watcher = asyncio.ensure_future(self._watch())

    async def _serve_metrics(self, host: str, port: int) -> None:
        """Serve ``/metrics`` alone, without a token, on ``host:port``. Raises OSError naming
        the address when it cannot bind (the coordinator then does not start)."""
        app = web.Application()
        app.add_routes([web.get("/metrics", self._metrics_open)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            await runner.cleanup()
            raise OSError(f"cannot serve /metrics on {host}:{port}: {e}") from e
        self.metrics_port = sock.getsockname()[1]
        await web.SockSite(runner, sock).start()
        self._metrics_runner = runner
        log.info("metrics on http://%s:%d/metrics (no token)", host, self.metrics_port)

    async def _on_shutdown(self, app: web.Application) -> None:
        # open event streams end here; otherwise the server would wait for them on shutdown
        if self._closing is not None and self._updated is not None:
            self._closing.set()
            self._updated.set()

    async def _on_cleanup(self, app: web.Application) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._watcher
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
            self._metrics_runner = None

    # -- the watcher ----------------------------------------------------------------------------
    async def _watch(self) -> None:
        while True:
            await self.source.changed(SAMPLE_EVERY_S)
            try:
                self._observe()
            except Exception:  # a bug here must not stop the dashboard for the rest of the run
                log.exception("dashboard watcher")

    def _new_events(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Events appended since the last call. The list is trimmed at its head when it grows
        long, so the position is found by the identity of the last event seen."""
        last = self._last_event
        if events:
            self._last_event = events[-1]
        if last is None:
            return list(events)
        for i in range(len(events) - 1, -1, -1):
            if events[i] is last:
                return events[i + 1 :]
        return events[-100:]  # trimmed past it: what is left of the recent ones

    def _observe(self) -> None:
        m = self.source.membership
        now = self.now()
        r = m.phase.round
        running: tuple[int, int, float] | None = None
        ready: Iterable[tuple[str, float | None]] = ()
        if r is not None:
            running = (r.plan.epoch, r.plan.round, r.started_at)
            # read by the view only for a round it has not seen: this runs at every change
            ready = ((m.peers[p].name, m.peers[p].ready_since) for p in r.plan.members)
        live = m.roster.live
        world = sum(1 for p in m.members if p in live)  # len(m.expected()), without its list
        events = self._new_events(m.events)
        for outcome, seconds in self.view.update(
            now, world=world, running=running, ready_since=ready, events=events
        ):
            self.metrics.observe(outcome, seconds)
        if now - self._sampled_at >= SAMPLE_EVERY_S:
            self._sampled_at = now
            # straight from the roster: a whole status (every peer's row, the down pairs,
            # the checkpoints) each second was a tenth of a 1,000-peer coordinator's CPU;
            # list() takes the peers at once, as a registration may add one meanwhile
            self.view.sample_reports(
                now,
                (
                    (p.name, p.info, p.last_seen)
                    for p in list(m.peers.values())
                    if p.state is PeerState.ACTIVE
                ),
            )
        if self._updated is not None:
            ev, self._updated = self._updated, asyncio.Event()
            ev.set()

    def _waiting_for(self) -> list[str]:
        """Members of the last epoch the others are waiting for to begin the next round."""
        m = self.source.membership
        if m.running is not None:
            return []
        alive = [m.peers[p] for p in m.members if p in m.peers]
        alive = [p for p in alive if p.state is PeerState.ACTIVE]
        if not any(p.ready_nonce for p in alive):
            return []
        return [p.name for p in alive if not p.ready_nonce]

    def snapshot(self) -> dict[str, Any]:
        """What the page draws (see :meth:`RunView.snapshot`); computed at most every
        ``MIN_GAP_S`` and shared by every open stream."""
        now = self.now()
        if self._snapshot is not None and now - self._snapshot[0] < MIN_GAP_S:
            return self._snapshot[1]
        status = self.source.status(events=0)  # the view keeps the events it shows
        self.view.sample_peers(now, status["peers"])
        snap = self.view.snapshot(now, status, waiting_for=self._waiting_for())
        self._snapshot = (now, snap)
        return snap

    # -- handlers -------------------------------------------------------------------------------
    def _allowed(self, request: web.Request) -> bool:
        return self.check.allowed(request, self.source.port)

    @staticmethod
    def _denied() -> web.Response:
        return web.json_response(
            {
                "error": "this run's data needs its token: log in at / or send "
                "'Authorization: Bearer <token>'"
            },
            status=401,
            headers={"Cache-Control": "no-store"},
        )

    async def _page(self, request: web.Request) -> web.Response:
        return await self._asset_response("index.html")

    async def _static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in _STATIC or name == "index.html":
            raise web.HTTPNotFound()
        return await self._asset_response(name)

    @staticmethod
    async def _asset_response(name: str) -> web.Response:
        return web.Response(
            body=_asset(name), content_type=_STATIC[name], charset="utf-8", headers=_HEADERS
        )

    async def _favicon(self, request: web.Request) -> web.Response:
        return web.Response(status=204)

    async def _login(self, request: web.Request) -> web.Response:
        token: object = None
        if request.content_type == "application/json":
            with contextlib.suppress(ValueError, UnicodeDecodeError):
                body = await request.json()
                token = body.get("token") if isinstance(body, dict) else None
        else:
            token = (await request.post()).get("token")
        if not isinstance(token, str) or not token.strip():
            return web.json_response({"error": "missing token"}, status=400)
        if not self.check.token_ok(token.strip()):
            await asyncio.sleep(0.3)  # slows guessing without holding anyone else up
            return web.json_response({"error": "invalid token for this run"}, status=401)
        resp = web.json_response({"ok": True, "run_id": self.source.run_id})
        self.check.set_cookie(resp, self.source.port, token.strip())
        return resp

    async def _logout(self, request: web.Request) -> web.Response:
        resp = web.json_response({"ok": True})
        self.check.clear_cookie(resp, self.source.port)
        return resp

    async def _session(self, request: web.Request) -> web.Response:
        if not self._allowed(request):
            return self._denied()
        return web.json_response({"ok": True, "run_id": self.source.run_id})

    async def _snapshot_json(self, request: web.Request) -> web.Response:
        if not self._allowed(request):
            return self._denied()
        return web.json_response(self.snapshot(), headers={"Cache-Control": "no-store"})

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        if not self._allowed(request):
            return self._denied()
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-store",
                "X-Accel-Buffering": "no",  # a reverse proxy must not buffer the stream
            }
        )
        await resp.prepare(request)
        assert self._closing is not None
        try:
            await resp.write(b"retry: 2000\n\n")
            while not self._closing.is_set():
                data = json.dumps(self.snapshot(), separators=(",", ":"))
                await resp.write(f"event: snapshot\ndata: {data}\n\n".encode())
                updated = self._updated
                assert updated is not None
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(updated.wait(), PUSH_EVERY_S)
                await asyncio.sleep(MIN_GAP_S)
        except ConnectionResetError:
            pass  # the browser went away
        return resp

    async def _metrics(self, request: web.Request) -> web.Response:
        if not self._allowed(request):
            return self._denied()
        return await self._metrics_open(request)

    async def _metrics_open(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})
