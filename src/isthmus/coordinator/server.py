"""The coordinator: an HTTP+JSON membership server, standalone or embedded in a process.

Endpoints (all but ``/healthz`` need ``Authorization: Bearer <token>``; bodies, answers and
frames are the messages of :mod:`.protocol`, and a malformed field is answered 400 naming it):

* ``POST /v1/register``: a peer of another protocol version is answered 426, naming both.
* ``GET  /v1/ws?peer=<id>&run=<run_id>&protocol=<version>`` websocket (:mod:`.peer_socket`):
  the peer sends heartbeats, the coordinator pushes ``abort`` when a round the peer is in
  aborts. A closed websocket evicts the peer at once (the kernel closes a crashed process's
  sockets), so a SIGKILL is noticed in milliseconds; a stopped or partitioned peer is noticed
  after ``heartbeat_timeout``. Begin and commit may come on it as frames (:mod:`.frames`).
* ``POST /v1/begin`` and ``POST /v1/commit``: long-polls (held up to ``poll_s``, then answered
  ``wait``; the client asks again), handled by :mod:`.rounds` as their frames are. See
  :mod:`isthmus.coordinator.membership` for the rules.
  Requests from peers also carry ``run`` (the run id from ``register``); one naming another
  run, from before a coordinator restart, is answered ``evicted``.
* ``POST /v1/leave``, ``GET /v1/status`` (members, epoch, revision, heartbeats, counters, recent
  events; try ``curl -H "Authorization: Bearer $TOKEN" http://host:port/v1/status``).
* ``GET /`` the live dashboard, ``GET /metrics`` Prometheus (see :mod:`isthmus.coordinator.web`:
  the page asks for the token and keeps it as a cookie; ``metrics_port`` serves ``/metrics``
  without one, where the operator binds it).

Process groups rendezvous through the coordinator's own API (``POST /v1/store``,
:mod:`isthmus.coordinator.store_service`), behind the same tokens and TLS as everything else;
``rendezvous="tcpstore"`` serves torch's unauthenticated ``TCPStore`` on ``store_port`` instead
(for comparison). Tokens, identities, limits and TLS: :mod:`.gate`, :mod:`.auth`, :mod:`.limits`,
:mod:`.tls` and docs/SECURITY.md; the operator's API: :mod:`.admin`.
The handlers here and those rooms share one :class:`~.hub.Hub` (see :mod:`isthmus.coordinator`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import gc
import logging
import secrets
import socket
import threading
from typing import Any

import torch.distributed as dist
from aiohttp import web

from isthmus.coordinator import httplog, wire
from isthmus.coordinator import protocol as msgs
from isthmus.coordinator.admin import AdminAPI
from isthmus.coordinator.auth import Identities
from isthmus.coordinator.bodies import read_json
from isthmus.coordinator.checkpoints import CheckpointBook, PartReport
from isthmus.coordinator.frames import MAX_FRAME_BYTES, WS_ROUNDS
from isthmus.coordinator.gate import BadRequest as _BadRequest
from isthmus.coordinator.gate import Gate
from isthmus.coordinator.hub import Hub
from isthmus.coordinator.membership import Membership
from isthmus.coordinator.mesh_room import MeshRoom
from isthmus.coordinator.peer_socket import PeerSockets
from isthmus.coordinator.rounds import Rounds
from isthmus.coordinator.server_config import CoordinatorConfig
from isthmus.coordinator.store_service import RendezvousStore, StoreRoute
from isthmus.coordinator.stragglers import StragglerDetector
from isthmus.coordinator.tls import server_context
from isthmus.coordinator.web import Dashboard

__all__ = ["Coordinator", "CoordinatorConfig"]

log = logging.getLogger("isthmus.coordinator")


GC_THRESHOLDS = (100_000, 20, 10)
"""The garbage collector's thresholds in a standalone coordinator. Every message allocates
objects that live a moment, and every collection of the oldest generation walks every object
the run keeps (each peer's state and connection: a thousand peers make it a long walk), so
the youngest generation is collected after 100,000 net allocations rather than 700."""


def _is_address(a: object) -> bool:
    """``a`` is a ``host:port`` string of sane length."""
    if not isinstance(a, str) or len(a) > 300:
        return False
    host, sep, port = a.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


class Coordinator:
    """Membership server. ``start()`` runs it on a background thread (embedded use: demo, tests);
    ``serve_forever()`` runs it in the calling thread (the ``isthmus coordinator`` command)."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.membership = Membership(config.membership)
        self.checkpoints = CheckpointBook(config.checkpoint_dir)
        if config.restore_from is not None:
            self.membership.set_restore_point(config.restore_from, 0.0)
        self.run_id = secrets.token_hex(4)
        self.hub = Hub(self.membership, self.run_id)
        self._lock = self.hub.lock  # the handlers' own name for the hub's lock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._store: dist.TCPStore | None = None
        self._stop_event: asyncio.Event | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self.port = config.port
        self.store_port = config.store_port
        self.t0 = self.hub.t0
        self.started_at = self.hub.started_at  # events' "t" + started_at = Unix time
        identities = Identities(config.token, tuple(config.revoked))
        metrics_at = None
        if config.metrics_port is not None:
            metrics_at = (config.metrics_host or config.host, config.metrics_port)
        self.web = Dashboard(self, identities, metrics_at=metrics_at)
        self.gate = Gate(
            identities=identities, limits=config.limits, roster=self.hub, open_path=self.web.handles
        )
        self.admin = AdminAPI(identities, self.hub)
        self.mesh = MeshRoom(self.gate, identities, self.hub, poll_s=config.poll_s)
        self.store = RendezvousStore(
            lambda: f"isthmus/{self.run_id}/",
            max_keys=config.limits.max_store_keys,
            max_value_bytes=config.limits.max_store_value_bytes,
            poll_s=config.poll_s,
        )
        self.rounds = Rounds(self.hub, config.poll_s)
        self.peer_sockets = PeerSockets(
            hub=self.hub,
            gate=self.gate,
            rounds=self.rounds,
            stragglers=StragglerDetector(config.stragglers),
            limits=config.limits,
        )
        self.rounds.on_info = self.peer_sockets.record
        self.features: tuple[str, ...] = (
            msgs.VOTE_IN_BEGIN,
            msgs.INFO_IN_BEGIN,
            msgs.HASH_DIGEST,
        )
        """What :class:`~.protocol.Registered` lists: the vote, a heartbeat's info and a digest
        of the hashes in the begin, and begin and commit as websocket frames where a frame of
        :data:`~.frames.MAX_FRAME_BYTES` fits the websocket's message bound."""
        if config.limits.max_ws_message_bytes >= MAX_FRAME_BYTES:
            self.features += (WS_ROUNDS,)

    @property
    def stragglers(self) -> StragglerDetector:
        """The straggler detector the heartbeats feed (one home: the peers' sockets)."""
        return self.peer_sockets.stragglers

    @stragglers.setter
    def stragglers(self, detector: StragglerDetector) -> None:
        self.peer_sockets.stragglers = detector

    # -- lifecycle ------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        host = self.config.host if self.config.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> Coordinator:
        """Start serving on a daemon thread; returns once listening. Raises if it cannot bind."""
        self._thread = threading.Thread(
            target=self._thread_main, name="isthmus-coordinator", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"coordinator did not start within {timeout}s")
        if self._start_error is not None:
            raise self._start_error
        return self

    def _thread_main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as e:  # reported to start()
            self._start_error = e
            self._ready.set()
        finally:
            loop.close()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving and close every peer connection. Idempotent."""
        if self._loop is None or self._stop_event is None:
            return
        loop, ev = self._loop, self._stop_event
        with contextlib.suppress(RuntimeError):  # loop already closed
            loop.call_soon_threadsafe(ev.set)
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> Coordinator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def serve_forever(self) -> None:
        """Serve in this thread until interrupted (Ctrl-C). The process is the coordinator's
        own: what it imported (torch among it) is moved out of the garbage collector's sight
        first, so that a full collection walks only what serving allocates."""
        # A full collection walks every tracked object: hundreds of thousands here, all of
        # them alive for the whole process, and it comes every few rounds of a large run.
        gc.collect()
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        finally:
            loop.close()

    async def _serve(self) -> None:
        httplog.install()  # malformed HTTP is a line in the log, not a traceback
        self.hub.open()
        self._stop_event = asyncio.Event()
        cfg = self.config
        if cfg.rendezvous == "tcpstore":
            self._store = dist.TCPStore(
                cfg.host if cfg.host not in ("0.0.0.0", "::") else "0.0.0.0",
                cfg.store_port,
                is_master=True,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=60),
            )
            self.store_port = self._store.port
        ssl_ctx = server_context(cfg.tls) if cfg.tls is not None else None
        app = web.Application(
            middlewares=[self.gate.middleware], client_max_size=cfg.limits.max_body_bytes
        )
        app.add_routes(
            [
                web.get("/healthz", self._healthz),
                web.post("/v1/register", self._register),
                web.get("/v1/ws", self.peer_sockets.handle),
                web.post("/v1/begin", self._begin),
                web.post("/v1/commit", self._commit),
                web.post("/v1/leave", self._leave),
                web.post("/v1/checkpoint", self._checkpoint),
                web.get("/v1/status", self._status),
            ]
        )
        self.web.install(app)
        self.admin.install(app)
        self.mesh.install(app)
        StoreRoute(self.store, self.hub.stale_run).install(app)
        # a stop waits for handlers in flight (a long-poll of a peer that has gone runs to its
        # own timeout) at most 1 s, not aiohttp's 60 s
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((cfg.host, cfg.port))
        except OSError as e:
            sock.close()
            await self._runner.cleanup()
            raise OSError(f"coordinator cannot listen on {cfg.host}:{cfg.port}: {e}") from e
        self.port = sock.getsockname()[1]
        site = web.SockSite(self._runner, sock, ssl_context=ssl_ctx)
        await site.start()
        ticker = asyncio.ensure_future(self.hub.tick_forever(cfg.tick_s))
        log.info(
            "coordinator listening on %s://%s:%d (rendezvous: %s)",
            "https" if ssl_ctx else "http",
            cfg.host,
            self.port,
            cfg.rendezvous,
        )
        self._ready.set()
        try:
            await self._stop_event.wait()
        finally:
            ticker.cancel()
            # A stopped or vanished peer never answers the closing handshake (aiohttp waits 10 s
            # for it, per socket): close them together, bounded.
            await self.hub.close_sockets()
            await self._runner.cleanup()
            self._store = None
            # handlers of clients that never finished a request (slow or hostile): end them
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            if rest:
                await asyncio.wait(rest, timeout=1.0)

    # -- plumbing: the hub's, under the names the handlers use ---------------------------------
    def now(self) -> float:
        """Seconds since the coordinator started (the clock of its events)."""
        return self.hub.now()

    async def changed(self, timeout: float) -> None:
        """Return at the run's next change, or after ``timeout`` seconds (on the loop)."""
        await self.hub.changed(timeout)

    _now = now

    def _mutated(self) -> None:
        self.hub.mutated()

    _json = staticmethod(read_json)

    def _stale_run(self, run: object) -> str | None:
        return self.hub.stale_run(run)

    # -- handlers -------------------------------------------------------------------------------
    async def _read(self, request: web.Request, read: Any) -> Any:
        """The request's body as message class ``read`` (or what function ``read`` makes of the
        parsed body). A malformed one is answered 400 naming the field."""
        body = await self._json(request)
        try:
            return wire.decode(read, body) if isinstance(read, type) else read(body)
        except wire.WireError as e:
            raise _BadRequest(str(e)) from None

    def _reply(self, msg: Any) -> web.Response:
        if isinstance(msg, msgs.Decision):
            return web.Response(text=self.rounds.text(msg), content_type="application/json")
        return web.json_response(wire.encode(msg))

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _register(self, request: web.Request) -> web.Response:
        msg: msgs.Register = await self._read(request, msgs.Register)
        name = (msg.name or "peer")[:200]
        why = wire.refusal(msg.protocol, them="peer", us="coordinator")
        if why is not None:
            log.warning("refused %s from %s: %s", name, request.remote, why)
            return web.json_response(
                {"error": why, "protocol": wire.PROTOCOL_VERSION},
                status=426,
                headers={"Upgrade": f"isthmus/{wire.PROTOCOL_VERSION}"},
            )
        info = {**msg.info, "address": request.remote}  # where the peer reached us from
        probe = info.get("probe")
        if probe is not None and not _is_address(probe):
            raise _BadRequest(f"field 'info.probe' expected host:port, got {probe!r:.80}")
        with self._lock:
            pid = self.membership.register(name, self._now(), info)
            restore = self.membership.restore_wanted()
        self.gate.bind(request, pid)
        self._mutated()
        m = self.config.membership
        return self._reply(
            msgs.Registered(
                peer_id=pid,
                run_id=self.run_id,
                heartbeat_interval=self.config.heartbeat_interval,
                store_port=self.store_port,
                rendezvous=self.config.rendezvous,  # type: ignore[arg-type]
                heartbeat_timeout=m.heartbeat_timeout,
                parity_every=m.parity_every,
                min_peers=m.min_peers,
                restore=restore,
                protocol=wire.PROTOCOL_VERSION,
                features=self.features,
            )
        )

    async def _begin(self, request: web.Request) -> web.Response:
        msg: msgs.Begin = await self._read(request, msgs.Begin)
        return self._reply(await self.rounds.begin(msg))

    async def _commit(self, request: web.Request) -> web.Response:
        msg: msgs.Commit = await self._read(request, msgs.Commit)
        return self._reply(await self.rounds.commit(msg))

    async def _leave(self, request: web.Request) -> web.Response:
        msg: msgs.Leave = await self._read(request, msgs.Leave)
        if self._stale_run(msg.run) is not None:
            return web.json_response({"ok": True})  # that peer id is someone else's here
        final = {}
        if msg.digest is not None and msg.revision is not None:
            final = {"digest": msg.digest[:64], "revision": msg.revision}
        with self._lock:
            if msg.info is not None:  # its last counters (bytes), for /metrics and the dashboard
                self.membership.heartbeat(msg.peer, self._now(), msg.info)
            self.membership.leave(msg.peer, self._now(), **final)
        self._mutated()
        return web.json_response({"ok": True})

    async def _checkpoint(self, request: web.Request) -> web.Response:
        """A peer wrote (or failed to write) its part of a checkpoint, or its manifest."""
        msg = await self._read(request, msgs.checkpoint_report)
        if self._stale_run(msg.run) is not None:
            return web.json_response({"complete": False, "failed": "another run"})
        now = self._now()
        if isinstance(msg, msgs.CheckpointManifest):
            path = msg.manifest[:4096]
            with self._lock:
                if msg.url:
                    point = msgs.RestorePoint(msg.url[:4096], msg.revision)
                    self.membership.set_restore_point(point, 0.0)
                self.checkpoints.manifest(msg.revision, path, now)
                self.membership.note(now, "checkpoint", checkpoint_revision=msg.revision, path=path)
            return web.json_response({"ok": True})
        report = PartReport(
            revision=msg.revision,
            part=msg.part,
            parts=msg.parts,
            ok=msg.ok,
            hashes=msg.hashes,
            nbytes=msg.bytes,
            writer=msg.writer[:200],
            local=msg.local[:200],
            error=msg.error[:500],
        )
        with self._lock:
            answer = self.checkpoints.part(report, now)
        return web.json_response(answer)

    async def _status(self, request: web.Request) -> web.Response:
        try:
            n = int(request.query.get("events", "50"))
        except ValueError:
            raise _BadRequest("query parameter 'events' must be an integer") from None
        return web.json_response(self.status(events=n))

    def status(self, events: int = 50) -> dict[str, Any]:
        """Members, epoch, revision, heartbeats, counters and the last ``events`` events.
        Thread-safe; usable on an embedded coordinator without HTTP."""
        with self._lock:
            s = self.membership.status(self._now())
            s["events"] = self.membership.events[-events:] if events > 0 else []
            s["stragglers"] = self.stragglers.status()
        with self._lock:
            s["checkpoint"] = self.checkpoints.status()
        s["run_id"] = self.run_id
        s["started_at"] = self.started_at
        s["uptime_s"] = round(self._now(), 3)
        return s

    def events(self) -> list[dict[str, Any]]:
        """The recorded events still held (joins, evictions, epochs, commits, aborts, resyncs):
        the last 10,000; :meth:`events_since` drains them all over a long run."""
        return self.events_since(0)[0]

    def events_since(self, n: int) -> tuple[list[dict[str, Any]], int]:
        """Events number ``n`` and later (counting from the coordinator's start) that are still
        held, with their Unix time ``ts``, and how many there have been in all. A caller that
        asks again with that count at least every 9,000 events misses none."""
        with self._lock:
            held, total = self.membership.record.since(n), self.membership.events_total
        return [{**e, "ts": round(self.started_at + e["t"], 4)} for e in held], total
