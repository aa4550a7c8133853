"""Measuring an emulated link from inside its namespaces: round-trip times and windowed TCP
transfers, with nothing but the standard library (run as ``python -I linkprobe.py ...`` inside a
node's namespace, so it starts in milliseconds without importing isthmus or torch).

Modes (each prints one JSON line on stdout):

* ``serve PORT``: accept connections until killed; a connection that sends ``W`` receives data
  and acknowledges every :data:`CHUNK` bytes with the 8-byte total so far; any other first byte
  closes it at once (a connect-time probe).
* ``connect HOST PORT COUNT INTERVAL_S``: time ``COUNT`` TCP connects (SYN to SYN-ACK: one round
  trip each) -> ``{"rtt_ms": [...]}``. The fall-back for machines without ``ping``.
* ``send HOST PORT SECONDS WINDOW WARMUP_S``: send for ``SECONDS`` with at most ``WINDOW`` bytes
  not yet acknowledged by the receiving application (0: no limit beyond TCP's own) ->
  ``{"bytes", "seconds", "mbit"}`` over the time after ``WARMUP_S`` (slow start excluded). With a
  window below the link's bandwidth-delay product, the rate is ``WINDOW / RTT``: that is what
  a transfer over a long link is expected to do, and what the lab's tests check.

Every wait is bounded: sockets time out after ``SECONDS + 30`` s at most.
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import threading
import time

CHUNK = 16 * 1024
"""Bytes per write and per acknowledgement."""
PORT = 7787
"""The port the lab's probes listen on inside a namespace."""


def _serve_one(conn: socket.socket) -> None:
    with conn:
        conn.settimeout(120)
        # acknowledgements leave at once: Nagle would hold each behind the previous one
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            if conn.recv(1) != b"W":
                return
            total = acked = 0
            while True:
                data = conn.recv(1 << 20)
                if not data:
                    return
                total += len(data)
                if total - acked >= CHUNK:
                    acked = total
                    conn.sendall(struct.pack("!Q", total))
        except OSError:
            return


def serve(port: int) -> None:
    with socket.create_server(("0.0.0.0", port), backlog=64) as srv:
        print(json.dumps({"listening": port}), flush=True)
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=_serve_one, args=(conn,), daemon=True).start()


def connect_rtts(host: str, port: int, count: int, interval_s: float) -> list[float]:
    out = []
    for _ in range(count):
        t = time.perf_counter()
        with socket.create_connection((host, port), timeout=30) as s:
            out.append((time.perf_counter() - t) * 1000)
            s.sendall(b"x")
        time.sleep(interval_s)
    return out


def send(host: str, port: int, seconds: float, window: int, warmup_s: float) -> dict[str, float]:
    payload = b"\0" * CHUNK
    acked = 0
    cond = threading.Condition()

    def read_acks(sock: socket.socket) -> None:
        nonlocal acked
        buf = b""
        while True:
            try:
                data = sock.recv(4096)
            except OSError:
                data = b""
            buf += data
            whole = len(buf) // 8 * 8
            with cond:
                if whole:
                    (acked,) = struct.unpack("!Q", buf[whole - 8 : whole])
                    buf = buf[whole:]
                cond.notify()
                if not data:
                    return

    with socket.create_connection((host, port), timeout=seconds + 30) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(b"W")
        threading.Thread(target=read_acks, args=(s,), daemon=True).start()
        sent = 0
        t0 = time.monotonic()
        end = t0 + seconds
        mark: tuple[float, int] | None = None
        while (now := time.monotonic()) < end:
            with cond:
                if mark is None and now - t0 >= warmup_s:
                    mark = (now, acked)
                if window and sent - acked + CHUNK > window:
                    # the window is full: wait for the receiving application's acknowledgement
                    cond.wait(timeout=end - now)
                    continue
            s.sendall(payload)
            sent += CHUNK
        with cond:
            t_end, moved = time.monotonic(), acked
    t_start, before = mark if mark is not None else (t0, 0)
    span = max(1e-9, t_end - t_start)
    return {
        "bytes": moved - before,
        "seconds": round(span, 4),
        "mbit": round((moved - before) * 8 / span / 1e6, 3),
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        if args[:1] == ["serve"] and len(args) == 2:
            serve(int(args[1]))
        elif args[:1] == ["connect"] and len(args) == 5:
            rtts = connect_rtts(args[1], int(args[2]), int(args[3]), float(args[4]))
            print(json.dumps({"rtt_ms": rtts}), flush=True)
        elif args[:1] == ["send"] and len(args) == 6:
            r = send(args[1], int(args[2]), float(args[3]), int(args[4]), float(args[5]))
            print(json.dumps(r), flush=True)
        else:
            print(
                "usage: linkprobe.py serve PORT | connect HOST PORT COUNT INTERVAL_S | "
                "send HOST PORT SECONDS WINDOW WARMUP_S",
                file=sys.stderr,
            )
            return 2
    except OSError as e:
        print(f"probe: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
