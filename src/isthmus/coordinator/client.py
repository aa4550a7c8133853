"""Peer-side client of the coordinator: synchronous calls with bounded retries, and a heartbeat.

All network I/O runs on one background asyncio loop (one aiohttp session); the calling thread
blocks on each call with a deadline. Errors that the user must act on are raised as exceptions
that name the coordinator's address and what went wrong.

Begin and commit travel as frames on the heartbeat websocket (:mod:`.frames`) when the
coordinator lists :data:`~.frames.WS_ROUNDS` and the socket is open, and as HTTP requests
otherwise; :meth:`CoordinatorClient.call` chooses, so its callers see one answer either way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import json
import logging
import math
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import aiohttp

from isthmus.coordinator.frames import MAX_FRAME_BYTES, WS_ROUNDS, Downlink, RoundReply
from isthmus.coordinator.parity import state_digest
from isthmus.coordinator.protocol import (
    HASH_DIGEST,
    INFO_IN_BEGIN,
    Begin,
    Decision,
    Heartbeat,
    HeartbeatLost,
    Push,
    Register,
    Registered,
    SendHashes,
)
from isthmus.coordinator.tls import format_fingerprint, normalize_fingerprint
from isthmus.coordinator.wire import (
    PROTOCOL_VERSION,
    ProtocolMismatch,
    WireError,
    decode,
    encode,
    version_mismatch,
)

__all__ = [
    "AuthError",
    "CoordinatorClient",
    "CoordinatorError",
    "CoordinatorUnreachable",
    "IncompatibleProtocol",
    "TLSRefused",
    "normalize_address",
]

log = logging.getLogger("isthmus.client")
M = TypeVar("M")

_FRAMES = {"/v1/begin": "begin", "/v1/commit": "commit"}
"""The requests that may travel as websocket frames, and their frame ``type``."""


class _SocketGone(ConnectionError):
    """The websocket closed while a frame waited for its reply."""


class CoordinatorError(RuntimeError):
    """The coordinator answered with an error the peer cannot recover from by retrying."""


class CoordinatorUnreachable(CoordinatorError):
    """The coordinator could not be reached within the connect timeout."""


class AuthError(CoordinatorError):
    """The coordinator refused this peer's token."""


class IncompatibleProtocol(CoordinatorError, ProtocolMismatch):
    """The coordinator speaks another version of the isthmus protocol (the message names both)."""


class TLSRefused(CoordinatorError):
    """The coordinator's certificate is not the pinned one (or not signed by the CA given)."""


def normalize_address(address: str, tls: bool = False) -> str:
    """``host:port`` or ``http(s)://host:port`` -> ``scheme://host:port`` (validated); a bare
    ``host:port`` gets ``https`` when ``tls``. Raises ValueError for ``http://`` with ``tls``:
    a pinned fingerprint over plain HTTP would protect nothing."""
    a = address.strip().rstrip("/")
    if not a.startswith(("http://", "https://")):
        a = ("https://" if tls else "http://") + a
    elif tls and a.startswith("http://"):
        raise ValueError(
            f"coordinator address {address!r} is plain http but a fingerprint or CA file was "
            f"given: use https://host:port (or host:port)"
        )
    hostport = a.split("://", 1)[1]
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"coordinator address {address!r} must look like host:port")
    return a


class CoordinatorClient:
    """Talks to one coordinator with one token.

    ``connect_timeout`` bounds how long a call keeps retrying while the coordinator cannot be
    reached (connection refused, reset, timeouts, 5xx). A 401 is never retried, nor is a
    certificate that is not the pinned ``fingerprint`` (or not signed by ``cafile``):
    :class:`TLSRefused` names what was expected and what was found.

    After :meth:`register` with a coordinator that lists :data:`~.frames.WS_ROUNDS`, and while
    the heartbeat websocket is open, :meth:`call` sends begin and commit as frames on it (see
    :meth:`call` for what happens when the socket fails).
    """

    def __init__(
        self,
        address: str,
        token: str,
        *,
        connect_timeout: float = 30.0,
        fingerprint: str | None = None,
        cafile: str | None = None,
    ) -> None:
        if fingerprint and cafile:
            raise ValueError("give either the coordinator's fingerprint or a CA file, not both")
        self.pin = normalize_fingerprint(fingerprint) if fingerprint else None
        self.cafile = cafile
        self.base = normalize_address(address, tls=bool(fingerprint or cafile))
        self.host = self.base.split("://", 1)[1].rpartition(":")[0].strip("[]")
        self.token = token
        self.connect_timeout = connect_timeout
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="isthmus-client", daemon=True
        )
        self._thread.start()
        self._session: aiohttp.ClientSession | None = None
        self._hb_task: asyncio.Future[Any] | None = None
        self._closed = False
        self.features: tuple[str, ...] = ()
        """What the coordinator listed at the last :meth:`register`."""
        self.frames_sent = 0
        """Begins and commits sent as websocket frames (the rest went as HTTP requests)."""
        self._ws: aiohttp.ClientWebSocketResponse | None = None  # the heartbeat socket, on the loop
        self._replies: dict[int, asyncio.Future[dict[str, Any]]] = {}  # frame id -> its reply
        self._ids = itertools.count(1)
        # the heartbeat's info callback and interval while it runs, and the loop's time at
        # which the last info went (in a heartbeat or a begin)
        self._beat: tuple[Callable[[], dict[str, Any]], float] | None = None
        self._info_at = -math.inf
        self.infos_in_begins = 0
        """Heartbeat infos sent inside begins (each one a heartbeat left out)."""
        self._full_for: str | None = None  # the begin attempt (nonce) asked for its full list

    # -- loop helpers ---------------------------------------------------------------------------
    def _run(self, coro: Any, timeout: float) -> Any:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            raise

    def submit(
        self, path: str, body: dict[str, Any], read_timeout: float
    ) -> concurrent.futures.Future[dict[str, Any]]:
        """POST ``body`` to ``path`` on the client's loop without waiting: the future holds the
        answer, or the :class:`CoordinatorError` the request ended with. Cancelling the future
        cancels the request."""
        return asyncio.run_coroutine_threadsafe(self._post(path, body, read_timeout), self._loop)

    def _ssl(self) -> ssl.SSLContext | aiohttp.Fingerprint | bool:
        if self.pin is not None:
            return aiohttp.Fingerprint(self.pin)  # the certificate itself, no CA involved
        if self.cafile is not None:
            try:
                return ssl.create_default_context(cafile=self.cafile)
            except (OSError, ssl.SSLError) as e:
                raise CoordinatorError(f"cannot use CA file {self.cafile}: {e}") from None
        return True  # https:// with the system's CAs; ignored for http://

    async def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                headers={"Authorization": f"Bearer {self.token}"},
                timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_read=None),
                connector=aiohttp.TCPConnector(ssl=self._ssl()),
            )
        return self._session

    def tls_refused(self, e: BaseException) -> TLSRefused | None:
        """The error to raise for a refused certificate, or None when ``e`` is not one."""
        if isinstance(e, aiohttp.ServerFingerprintMismatch):
            return TLSRefused(
                f"refusing the coordinator at {self.base}: its certificate's SHA-256 fingerprint "
                f"is {format_fingerprint(e.got)}, but this peer is pinned to "
                f"{format_fingerprint(e.expected)} (a different coordinator, a new certificate, "
                f"or someone in between)"
            )
        if isinstance(e, aiohttp.ClientConnectorCertificateError):
            return TLSRefused(
                f"refusing the coordinator at {self.base}: its certificate does not verify "
                f"against {self.cafile or 'the system CAs'}: {e.certificate_error}"
            )
        return None

    async def _post(self, path: str, body: dict[str, Any], read_timeout: float) -> dict[str, Any]:
        url = self.base + path
        deadline = time.monotonic() + self.connect_timeout
        delay = 0.1
        attempts = 0
        last = ""
        while True:
            attempts += 1
            try:
                s = await self._sess()
                async with s.post(
                    url, json=body, timeout=aiohttp.ClientTimeout(total=read_timeout)
                ) as r:
                    if r.status == 401:
                        msg = (await r.json(content_type=None) or {}).get("error", "unauthorized")
                        raise AuthError(f"the coordinator at {self.base} refused this peer: {msg}")
                    if r.status == 426:  # another protocol version: retrying cannot help
                        msg = (await r.json(content_type=None) or {}).get("error", "")
                        raise IncompatibleProtocol(
                            f"the coordinator at {self.base} refused this peer: {msg}"
                        )
                    if r.status == 429:  # over a limit: back off and try again, bounded
                        last = "HTTP 429 " + (await r.text())[:200]
                    elif 400 <= r.status < 500:
                        text = await r.text()
                        raise CoordinatorError(
                            f"coordinator at {self.base} rejected {path}: {text[:500]}"
                        )
                    elif r.status >= 500:
                        last = f"HTTP {r.status}"
                    else:
                        return dict(await r.json())
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError) as e:
                refused = self.tls_refused(e)
                if refused is not None:
                    raise refused from None
                last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                if isinstance(e, aiohttp.ServerDisconnectedError) and self.base.startswith(
                    "http://"
                ):
                    last += " (is the coordinator serving TLS? then use https:// or a fingerprint)"
            if time.monotonic() + delay > deadline:
                raise CoordinatorUnreachable(
                    f"could not reach the coordinator at {self.base} ({path}) after {attempts} "
                    f"attempts over {self.connect_timeout:.0f}s; last error: {last}"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    def post(
        self, path: str, body: dict[str, Any], *, read_timeout: float = 30.0
    ) -> dict[str, Any]:
        """POST JSON and return the JSON answer, retrying while the coordinator is unreachable."""
        return self._run(
            self._post(path, body, read_timeout), self.connect_timeout + read_timeout + 5
        )

    def call(self, path: str, message: Any, answer: type[M], *, read_timeout: float = 30.0) -> M:
        """POST ``message`` (a :mod:`~isthmus.coordinator.protocol` message) and decode the answer
        as an ``answer``, retrying as :meth:`post` does. Raises :class:`CoordinatorError` naming
        the field when the answer is not a well-formed ``answer``.

        A begin or commit goes as a frame on the heartbeat websocket instead when the
        coordinator offers it (:data:`~.frames.WS_ROUNDS`), the socket is open and the frame
        is at most :data:`~.frames.MAX_FRAME_BYTES`. Its reply is awaited at most
        ``read_timeout`` seconds; when none comes by then, the socket closes meanwhile, or the
        coordinator answers 429 or 5xx, the same message is sent again as an HTTP request (a
        begin and a commit may be asked twice: the same nonce, the same vote). A reply of 400
        or 403 raises :class:`CoordinatorError` with the coordinator's message, as the HTTP
        answer would.

        A begin's hashes go as their digest where the coordinator takes it
        (:data:`~.protocol.HASH_DIGEST`), unless the begin carries its schema (a first begin)
        or the coordinator answered this attempt's digest ``hashes``: the caller then sends
        the hashes again, as after any ``hashes`` answer, and they go as the full list."""
        digested: str | None = None
        if isinstance(message, Begin) and answer is Decision:
            message, digested = self._digested(message)
        body = encode(message)
        kind = _FRAMES.get(path) if answer is Decision else None
        if kind is not None and WS_ROUNDS in self.features and self._ws is not None:
            bound = 2 * read_timeout + self.connect_timeout + 5
            reply = self._run(self._ask(path, kind, body, read_timeout), bound)
        else:
            reply = self.post(path, body, read_timeout=read_timeout)
        try:
            out = decode(answer, reply)
        except WireError as e:
            raise CoordinatorError(
                f"the coordinator at {self.base} answered {path} with a malformed "
                f"{answer.__name__}: {e}"
            ) from None
        if digested is not None and isinstance(out, SendHashes):
            self._full_for = digested  # its digest disagreed: this attempt sends the list
        return out

    def _digested(self, msg: Begin) -> tuple[Begin, str | None]:
        """``msg`` with the digest of its hashes in their place, and its nonce; or ``msg`` as
        it is and None (see :meth:`call`)."""
        if (
            msg.hashes is None
            or msg.schema is not None
            or HASH_DIGEST not in self.features
            or msg.nonce == self._full_for
        ):
            return msg, None
        return dataclasses.replace(msg, hashes=None, digest=state_digest(msg.hashes)), msg.nonce

    async def _ask(
        self, path: str, kind: str, body: dict[str, Any], read_timeout: float
    ) -> dict[str, Any]:
        """``body`` as a frame on the heartbeat socket, its reply's decision; falls back to an
        HTTP request as :meth:`call` says."""
        ws, fid = self._ws, next(self._ids)
        if kind == "begin":
            body = self._with_info(body)
        text = json.dumps({"type": kind, "id": fid, kind: body})
        if ws is None or ws.closed or len(text) > MAX_FRAME_BYTES:
            return await self._post(path, body, read_timeout)
        fut = asyncio.get_running_loop().create_future()
        self._replies[fid] = fut
        try:
            await ws.send_str(text)
            self.frames_sent += 1
            raw = await asyncio.wait_for(fut, read_timeout)
        except (asyncio.TimeoutError, ConnectionError, aiohttp.ClientError, RuntimeError) as e:
            log.debug("%s by frame failed (%s); asking over HTTP", path, type(e).__name__)
            return await self._post(path, body, read_timeout)
        finally:
            self._replies.pop(fid, None)
        if raw.get("status") == 200 and isinstance(raw.get("decision"), dict):
            return raw["decision"]  # type: ignore[no-any-return]  # call() decodes it
        try:
            reply = decode(RoundReply, raw)
        except WireError as e:
            raise CoordinatorError(
                f"the coordinator at {self.base} answered a {kind} frame with a malformed "
                f"reply: {e}"
            ) from None
        if reply.status == 200 and reply.decision is not None:
            return encode(reply.decision)  # type: ignore[no-any-return]
        if reply.status == 429 or reply.status >= 500:  # the HTTP path backs off, bounded
            return await self._post(path, body, read_timeout)
        raise CoordinatorError(
            f"coordinator at {self.base} rejected {path} (a {kind} frame, {reply.status}): "
            f"{reply.error[:500]}"
        )

    def _with_info(self, body: dict[str, Any]) -> dict[str, Any]:
        """The begin ``body`` with the heartbeat's info (:attr:`~.protocol.Begin.info`) where
        the coordinator records it (:data:`~.protocol.INFO_IN_BEGIN`), the heartbeat runs and
        half an interval or more passed since the last info went; the heartbeat loop then
        sends its next beat one interval after this begin. Else ``body`` as it is. On the
        loop."""
        beat = self._beat
        if beat is None or INFO_IN_BEGIN not in self.features:
            return body
        info, interval = beat
        now = self._loop.time()
        if now - self._info_at < interval / 2:
            return body  # the heartbeat's info is fresh enough: carrying it would add work
        try:
            payload = info()
        except Exception:  # a broken info callback costs this begin nothing
            return body
        self._info_at = now
        self.infos_in_begins += 1
        return {**body, "info": payload}

    def register(self, name: str, info: dict[str, Any] | None = None) -> Registered:
        """Register a peer called ``name`` (``info``: shown on the dashboard) with the
        coordinator, in this protocol version. Raises :class:`IncompatibleProtocol` naming both
        versions when the coordinator speaks another version (it refused the peer, or its answer
        carries another version or none)."""
        message = Register(name, info or {}, PROTOCOL_VERSION)
        reply = self.call("/v1/register", message, Registered)
        if reply.protocol != PROTOCOL_VERSION:
            raise IncompatibleProtocol(
                f"refusing the coordinator at {self.base}: "
                + version_mismatch(reply.protocol, PROTOCOL_VERSION, them="coordinator", us="peer")
            )
        self.features = tuple(reply.features)
        return reply

    def get(self, path: str) -> dict[str, Any]:
        async def go() -> dict[str, Any]:
            s = await self._sess()
            try:
                async with s.get(self.base + path, timeout=aiohttp.ClientTimeout(total=10)) as r:
                    if r.status in (401, 403):
                        msg = (await r.json(content_type=None) or {}).get("error", "")
                        raise AuthError(
                            f"the coordinator at {self.base} refused this peer's token: {msg}"
                        )
                    return dict(await r.json())
            except aiohttp.ClientConnectionError as e:
                refused = self.tls_refused(e)
                if refused is not None:
                    raise refused from None
                raise

        return self._run(go(), 15)

    # -- heartbeat ------------------------------------------------------------------------------
    def start_heartbeat(
        self,
        peer_id: int,
        interval: float,
        info: Callable[[], dict[str, Any]],
        on_push: Callable[[Push], None],
        run_id: str = "",
    ) -> None:
        """Keep a websocket to the coordinator and send a :class:`Heartbeat` with ``info()``
        every ``interval`` seconds.

        Where the coordinator lists :data:`~.protocol.INFO_IN_BEGIN`, a begin sent as a frame
        (or as its HTTP fallback) half an interval or more after the last info carries
        ``info()`` itself, and the next heartbeat goes one interval after that begin: a peer
        whose rounds are shorter than the interval sends about one message a round, none of
        them a bare heartbeat, and the coordinator still hears from it every ``interval``.

        Pushes from the coordinator (:class:`~isthmus.coordinator.protocol.AbortPush`,
        :class:`~isthmus.coordinator.protocol.EvictedPush`) are passed to ``on_push`` on the
        client's thread, and a :class:`~isthmus.coordinator.protocol.HeartbeatLost` when the
        connection ends; a malformed push is logged and dropped. Replies to begin and commit
        frames go to the :meth:`call` that waits for them. If the connection drops, the
        coordinator evicts this peer; the frames still waiting go again over HTTP and learn
        that (as the next begin does), and the peer registers again, so reconnecting here is
        only for a new peer id.
        """
        self.stop_heartbeat()
        self._beat = (info, interval)
        self._hb_task = asyncio.run_coroutine_threadsafe(
            self._heartbeat(peer_id, interval, info, on_push, run_id), self._loop
        )

    def stop_heartbeat(self) -> None:
        self._beat = None
        if self._hb_task is not None:
            self._hb_task.cancel()
            self._hb_task = None

    async def _heartbeat(
        self,
        peer_id: int,
        interval: float,
        info: Callable[[], dict[str, Any]],
        on_push: Callable[[Push], None],
        run_id: str,
    ) -> None:
        s = await self._sess()
        # the run id keeps an id from before a coordinator restart from naming a new peer
        url = f"{self.base}/v1/ws?peer={peer_id}&protocol={PROTOCOL_VERSION}"
        url += f"&run={run_id}" if run_id else ""
        try:
            async with s.ws_connect(url, heartbeat=None) as ws:

                async def reader() -> None:
                    async for msg in ws:
                        if msg.type == aiohttp.WSMsgType.TEXT:
                            self._received(msg.data, on_push)
                        elif msg.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                            break

                rtask = asyncio.ensure_future(reader())
                self._info_at = -math.inf
                self._ws = ws
                try:
                    while not ws.closed and not rtask.done():
                        # one interval after the last info, which a begin may have carried
                        due = self._info_at + interval - self._loop.time()
                        if due > 0:
                            await asyncio.sleep(due)
                            continue
                        try:
                            payload = info()
                        except Exception:  # a broken info callback must not stop heartbeats
                            payload = {}
                        await ws.send_json(encode(Heartbeat(payload)))
                        self._info_at = self._loop.time()
                finally:
                    rtask.cancel()
                    self._socket_closed(ws)
            reason = "the coordinator closed the heartbeat connection"
        except asyncio.CancelledError:
            raise
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
        log.warning("heartbeat connection to %s lost: %s", self.base, reason)
        on_push(HeartbeatLost(reason))

    def _received(self, text: str, on_push: Callable[[Push], None]) -> None:
        """One frame from the coordinator: a reply to the frame that waits for it, or a push."""
        try:
            raw = json.loads(text)
            if isinstance(raw, dict) and raw.get("type") == "reply":
                fid = raw.get("id")
                fut = self._replies.get(fid) if isinstance(fid, int) else None
                if fut is not None and not fut.done():
                    fut.set_result(raw)  # decoded and checked by the call that waits
                elif fid == -1:  # a frame of ours the coordinator could not read
                    log.warning("the coordinator at %s refused a frame: %s", self.base, raw)
                return  # else the reply to a call that gave up waiting for it
            push = decode(Downlink, raw)
        except ValueError as e:  # not JSON, or not a push
            log.warning("malformed push from %s: %s", self.base, e)
            return
        if isinstance(push, Push):
            on_push(push)

    def _socket_closed(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        """The heartbeat socket ``ws`` is gone: frames waiting on it go over HTTP."""
        if self._ws is ws:
            self._ws = None
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(_SocketGone("the heartbeat socket closed"))

    # -- shutdown -------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the heartbeat and the background loop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.stop_heartbeat()

        async def shutdown() -> None:
            if self._session is not None:
                await self._session.close()

        with contextlib.suppress(Exception):
            self._run(shutdown(), 5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
