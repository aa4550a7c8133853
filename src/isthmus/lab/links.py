"""Watching the emulated network: link counters sampled while a lab run goes on, and the network
itself built for the length of a run (namespaces if the machine allows, loopback otherwise).

:class:`LinkSampler` reads every link's byte and packet counters in one go from the bridge's
namespace (a bridge port's rx is what its node sent) every ``interval_s`` seconds into
``links.jsonl``; on the loopback fall-back it records ``lo`` for reference only (every process
shares it). :func:`open_network` is the lab's way in: it builds the network or falls back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from isthmus.lab.counters import read_all_counters
from isthmus.lab.netns import LabError, LabUnavailable, unavailable_reason
from isthmus.lab.scenario import NetworkSpec
from isthmus.lab.wan import WanNetwork

__all__ = ["NETWORK_MODES", "LinkSampler", "open_network"]

log = logging.getLogger("isthmus.lab")

NETWORK_MODES = ("auto", "netns", "loopback")


class LinkSampler:
    """Samples every link's byte counters into ``links.jsonl`` on a background thread."""

    def __init__(self, net: WanNetwork | None, path: Path, interval_s: float) -> None:
        self.net = net
        self.path = path
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="isthmus-lab-links", daemon=True)
        self.first: dict[str, dict[str, Any]] = {}
        self.last: dict[str, dict[str, Any]] = {}
        self.errors = 0

    def sample(self) -> list[dict[str, Any]]:
        ts = round(time.time(), 4)
        out: list[dict[str, Any]] = []
        if self.net is None:
            lo = read_all_counters()["lo"]
            out.append({"ts": ts, "node": "lo", "tx_bytes": lo.tx_bytes, "rx_bytes": lo.rx_bytes})
        else:
            table = read_all_counters(netns=self.net.bridge_netns)
            for node in self.net.nodes:
                port = table.get(node.bridge_port)
                if port is None:
                    continue
                name = "coordinator" if node.role == "coordinator" else f"peer{node.index}"
                # the bridge port's rx is what its node sent, and its tx what the node received
                out.append(
                    {
                        "ts": ts,
                        "node": name,
                        "tx_bytes": port.rx_bytes,
                        "rx_bytes": port.tx_bytes,
                        "tx_packets": port.rx_packets,
                        "rx_packets": port.tx_packets,
                        "rate_mbit": None if node.rate_bps is None else node.rate_bps / 1e6,
                    }
                )
        for r in out:
            self.first.setdefault(r["node"], r)
            self.last[r["node"]] = r
        return out

    def _write(self, records: list[dict[str, Any]]) -> None:
        with self.path.open("a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._write(self.sample())
            except (RuntimeError, OSError, ValueError) as e:
                # the network is being torn down under us (Ctrl-C), or ip is slow under load
                self.errors += 1
                log.debug("link sample failed: %s", e)

    def start(self) -> None:
        self._write(self.sample())
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        with contextlib.suppress(RuntimeError, OSError, ValueError):
            self._write(self.sample())


@contextlib.contextmanager
def open_network(
    spec: NetworkSpec, *, mode: str = "auto", prefix: str = "isth"
) -> Iterator[tuple[WanNetwork | None, dict[str, Any]]]:
    """The emulated network of ``spec`` for the duration of the block, as ``(net, info)``.

    ``mode``: ``auto`` builds namespaces and tc if the machine can, else falls back to loopback
    without shaping and says so (on stderr and in ``info["reason"]``); ``netns`` raises
    :class:`LabUnavailable` instead of falling back; ``loopback`` never builds namespaces
    (``net`` is then None). ``info`` describes what was built, for the summary; after the block
    it also holds ``delay_lines``, the counters of every delay line (frames, drops, CPU seconds).
    The network is torn down on every way out of the block.
    """
    if mode not in NETWORK_MODES:
        raise ValueError(f"network must be one of {', '.join(NETWORK_MODES)}, got {mode!r}")
    rates = [None if r is None else r / 1e6 for r in spec.rates_bps]
    info: dict[str, Any] = {
        "rates_mbit": rates,
        "coordinator_rate_mbit": None
        if spec.coordinator_rate_bps is None
        else spec.coordinator_rate_bps / 1e6,
        "congestion_control": spec.congestion_control,
        "impairments": [dataclasses.asdict(x) for x in spec.impairments]
        if any(x.active for x in spec.impairments)
        else None,
        "sites": dataclasses.asdict(spec.sites) if spec.sites is not None else None,
    }
    if mode == "loopback":
        yield None, {**info, "mode": "loopback", "reason": "asked for (--network loopback)"}
        return
    reason = unavailable_reason()
    net: WanNetwork | None = None
    if reason is None:
        net = WanNetwork.from_spec(spec, prefix=prefix)
        try:
            net.start()
        except LabUnavailable as e:
            reason, net = str(e), None
    if net is None:
        if mode == "netns":
            raise LabUnavailable(f"the emulated network cannot be built here: {reason}")
        print(
            f"isthmus lab: no emulated network ({reason}); falling back to loopback WITHOUT "
            "shaping: link rates, round trips, loss and sites are ignored and bytes cannot be "
            "attributed to peers",
            file=sys.stderr,
        )
        yield None, {**info, "mode": "loopback", "reason": reason}
        return
    # started above (to catch LabUnavailable), so closed here rather than with `with net:`
    info_out = {**info, "mode": "netns", "reason": None, "run_id": net.run_id}
    try:
        yield net, info_out
    except BaseException:
        try:
            net.close()
        except LabError as e:
            # the body's exception matters more; the leftovers are reported, not hidden
            print(
                f"isthmus lab: teardown after an error left something behind: {e}", file=sys.stderr
            )
        raise
    net.close()
    info_out["delay_lines"] = net.line_counters
