"""The emulated wide-area network: a bridge of shaped links, one namespace per node.

Layout (all of it inside namespaces :mod:`isthmus.lab.netns` creates; the host's own network is
never touched)::

    ns <run>-c   (coordinator)  wan0 10.77.0.1 --veth-- c  \\
    ns <run>-p0  (peer 0)       wan0 10.77.0.2 --veth-- p0  >-- br0 (bridge, in ns <run>-br)
    ns <run>-p1  (peer 1)       wan0 10.77.0.3 ==line== p1 /

Each node's link is shaped in both directions with a token bucket filter
(``tc qdisc add ... tbf``): its upload on its own ``wan0`` and its download on the bridge-side end
of its link (that end's egress is the node's ingress). Links are full duplex, so a ring all-reduce
at rate R moves R bit/s each way on every link, as a real access link would.

A link with a round trip, jitter or loss (``impairments``) is a **delay line**
(:mod:`isthmus.lab.delayline`) instead of a veth: a user-space process owning two TAP devices
(``wan0`` and the bridge port) that holds each frame for the link's delay, because this kernel has
no netem. With **sites**, each site has its own bridge (``br0``, ``br1``, ...) and the sites are
joined by one more line, the core, whose port on site k's bridge (``s<k>``) is shaped per
destination site with htb; only traffic between sites goes through it. The namespace primitives and
the teardown guarantees are :mod:`isthmus.lab.netns`'s; the lines are stopped at teardown and end
by themselves if the owner dies.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import json
import math
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from types import FrameType, TracebackType
from typing import Any, Literal

from isthmus.lab.build import NAT_LAN_PEER, build_network
from isthmus.lab.counters import InterfaceCounters, read_counters
from isthmus.lab.lines import DelayLine
from isthmus.lab.netns import (
    IFNAME,
    TERM_GRACE_S,
    LabError,
    LabUnavailable,
    Node,
    check_prefix,
    delete_namespace,
    list_namespaces,
    run_cmd,
    unavailable_reason,
)
from isthmus.lab.netspec import (
    CONGESTION_CONTROL_NAME,
    Impairment,
    NetworkSpec,
    Sites,
    path_rate_mbit,
    path_rtt_ms,
)

__all__ = ["WanNetwork"]


class WanNetwork:
    """A shaped network of ``n_peers`` peers and one coordinator, each in its own namespace.

    Use as a context manager::

        with WanNetwork(4, rates_mbit=[100, 100, 10, 10]) as net:
            proc = net.popen(0, ["python", "-m", "isthmus", ...])
            ...

    ``rates_mbit`` is one rate for every peer or a list with one entry per peer (``None`` in the
    list: that peer is unshaped); ``coordinator_rate_mbit`` shapes the coordinator (default: not
    shaped, so membership traffic never waits behind tensors in the emulation). Addresses come
    from ``subnet``: the coordinator gets the first host address, peer i the (i+2)-th. Every run
    lives in its own namespaces, so concurrent runs may use the same subnet.
    ``impairments`` (one :class:`~isthmus.lab.netspec.Impairment` for every peer, or one per peer,
    ``None`` entries for none) give peers' links a round trip, jitter and loss, and ``sites``
    puts peers on per-site bridges joined by thin links (see :mod:`isthmus.lab.netspec` for what
    the numbers mean; :meth:`rtt_ms` is the round trip the emulation should show between two
    peers). ``seed`` seeds the lines' jitter and loss draws. Peers listed in ``nat`` sit behind a
    router of their own (:func:`~isthmus.lab.build.add_nat_router`): it masquerades what they
    send and accepts no inbound connection; such a peer's ``ip`` is its private address and
    ``wan_ip`` the router's.
    ``congestion_control`` (e.g. ``"reno"``, ``"bbr"``) sets TCP's congestion control in every
    node's namespace (default: the host's); it matters on shaped links: loss-based TCP (reno,
    cubic) and BBR share a tbf queue differently. The host's
    ``net.ipv4.tcp_allowed_congestion_control`` lists what a namespace may use; another name
    fails the build with :class:`LabError` naming those.

    Entering builds everything or nothing: if any step fails, what was built is removed and
    :class:`LabError` (or :class:`LabUnavailable` when the machine cannot do it at all) is raised.
    While active, SIGINT and SIGTERM handlers tear the network down and then hand the signal to
    the previous handler (SIGINT then raises ``KeyboardInterrupt``; default SIGTERM then ends
    the process as SIGTERM would have); handlers are installed only from the main thread and
    restored on exit. An ``atexit`` hook covers ``sys.exit`` from elsewhere.
    """

    def __init__(
        self,
        n_peers: int,
        *,
        rates_mbit: float | Sequence[float | None] | None = None,
        coordinator_rate_mbit: float | None = None,
        prefix: str = "isth",
        subnet: str = "10.77.0.0/24",
        handle_signals: bool = True,
        congestion_control: str | None = None,
        impairments: Impairment | Sequence[Impairment | None] | None = None,
        sites: Sites | None = None,
        seed: int = 0,
        nat: Sequence[int] = (),
    ) -> None:
        if not isinstance(n_peers, int) or isinstance(n_peers, bool) or n_peers < 1:
            raise ValueError(f"n_peers must be a positive int, got {n_peers!r}")
        if congestion_control is not None and not (
            isinstance(congestion_control, str)
            and CONGESTION_CONTROL_NAME.fullmatch(congestion_control)
        ):
            raise ValueError(
                f"congestion_control must be a TCP congestion control name such as 'reno' or "
                f"'bbr', got {congestion_control!r}"
            )
        check_prefix(prefix)
        try:
            net = ipaddress.ip_network(subnet)
        except ValueError as e:
            raise ValueError(
                f"subnet {subnet!r} is not a network such as '10.77.0.0/24': {e}"
            ) from e
        if not isinstance(net, ipaddress.IPv4Network) or not net.is_private:
            raise ValueError(
                f"subnet must be a private IPv4 network such as 10.77.0.0/24, got {subnet}"
            )
        hosts = list(net.hosts())
        if len(hosts) < n_peers + 1:
            raise ValueError(
                f"subnet {subnet} has {len(hosts)} host addresses; {n_peers} peers and the "
                "coordinator need more: use a larger subnet such as 10.77.0.0/16"
            )
        if rates_mbit is None or isinstance(rates_mbit, (int, float)):
            per_peer: list[float | None] = [rates_mbit] * n_peers  # type: ignore[list-item]
        else:
            per_peer = list(rates_mbit)
            if len(per_peer) != n_peers:
                raise ValueError(
                    f"rates_mbit has {len(per_peer)} entries for {n_peers} peers: give one rate "
                    "or one per peer"
                )
        for i, r in enumerate([*per_peer, coordinator_rate_mbit]):
            if r is not None and not (
                isinstance(r, (int, float))
                and not isinstance(r, bool)
                and math.isfinite(r)
                and r > 0
            ):
                who = "coordinator_rate_mbit" if i == n_peers else f"rates_mbit[{i}]"
                raise ValueError(f"{who} must be a positive number of Mbit/s or None, got {r!r}")

        if impairments is None or isinstance(impairments, Impairment):
            imps: list[Impairment | None] = [impairments] * n_peers
        else:
            imps = list(impairments)
            if len(imps) != n_peers:
                raise ValueError(
                    f"impairments has {len(imps)} entries for {n_peers} peers: give one or one "
                    "per peer"
                )
        if sites is not None:
            sites.check_peers(n_peers)
        self.sites = sites
        self.seed = seed
        self.prefix = prefix
        self.congestion_control = congestion_control
        self.run_id = f"{prefix}-{os.getpid()}-{secrets.token_hex(2)}"
        self.bridge_netns = f"{self.run_id}-br"
        self.handle_signals = handle_signals
        self.subnet = net

        def bps(r: float | None) -> float | None:
            return None if r is None else float(r) * 1e6

        def bridge(peer: int | None) -> str:
            if sites is None:
                return "br0"
            return f"br{sites.coordinator_index if peer is None else sites.site_of(peer)}"

        self.coordinator = Node(
            role="coordinator",
            index=-1,
            netns=f"{self.run_id}-c",
            ip=str(hosts[0]),
            ifname=IFNAME,
            bridge_port="c",
            rate_bps=bps(coordinator_rate_mbit),
            bridge=bridge(None),
        )
        if any(not isinstance(i, int) or not 0 <= i < n_peers for i in nat):
            raise ValueError(f"nat lists peers 0..{n_peers - 1}, got {list(nat)}")
        self.peers: tuple[Node, ...] = tuple(
            Node(
                role="peer",
                index=i,
                netns=f"{self.run_id}-p{i}",
                ip=NAT_LAN_PEER if i in nat else str(hosts[i + 1]),
                wan_ip=str(hosts[i + 1]) if i in nat else None,
                ifname=IFNAME,
                bridge_port=f"p{i}",
                rate_bps=bps(per_peer[i]),
                impairment=imps[i] if imps[i] is not None and imps[i].active else None,  # type: ignore[union-attr]
                bridge=bridge(i),
            )
            for i in range(n_peers)
        )
        self._lines: list[DelayLine] = []
        self.line_counters: list[dict[str, Any]] = []
        """Each delay line's counters (frames, drops, CPU seconds), filled at teardown."""
        self._created: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._lock = threading.RLock()
        self._active = False
        self._closed = False
        self._old_handlers: dict[int, Any] = {}

    @classmethod
    def from_spec(cls, network: NetworkSpec, **kwargs: Any) -> WanNetwork:
        """A network for a scenario's ``[network]`` section (rates there are bits/s).

        Other keyword arguments (``prefix``, ``subnet``, ``handle_signals``) are passed on.
        """

        def mbit(bps: float | None) -> float | None:
            return None if bps is None else bps / 1e6

        return cls(
            network.peers,
            rates_mbit=[mbit(r) for r in network.rates_bps],
            coordinator_rate_mbit=mbit(network.coordinator_rate_bps),
            congestion_control=network.congestion_control,
            impairments=network.impairments,
            sites=network.sites,
            nat=network.nat,
            **kwargs,
        )

    # ------------------------------------------------------------------ queries

    @property
    def nodes(self) -> tuple[Node, ...]:
        """The coordinator followed by the peers."""
        return (self.coordinator, *self.peers)

    @property
    def lines(self) -> tuple[DelayLine, ...]:
        """The delay lines carrying impaired links and the links between sites."""
        return tuple(self._lines)

    def rtt_ms(self, a: int, b: int) -> float:
        """The round trip the emulation should give between peers ``a`` and ``b`` (ms, idle
        queues, jitter aside)."""
        return path_rtt_ms(
            [self.node(a).impairment, self.node(b).impairment],
            self.sites,
            a,
            b,
        )

    def dead_lines(self) -> list[str]:
        """Delay lines whose process has ended while the network is up, each with its message
        (a dead line is a cut link)."""
        return [
            f"{line.cfg.name}: {line.error() or 'exited'}"
            for line in self._lines
            if line.proc is not None and not line.alive()
        ]

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of this run (nodes, routers of peers behind NAT, the bridge)."""
        routers = [n.router_netns for n in self.nodes if n.router_netns is not None]
        return [n.netns for n in self.nodes] + routers + [self.bridge_netns]

    def node(self, which: int | Literal["coordinator"]) -> Node:
        """The peer with that index, or the coordinator; ``IndexError`` for an unknown peer."""
        if which == "coordinator":
            return self.coordinator
        if not isinstance(which, int) or not 0 <= which < len(self.peers):
            raise IndexError(
                f"no peer {which!r}: peers are 0..{len(self.peers) - 1} or 'coordinator'"
            )
        return self.peers[which]

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> WanNetwork:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.close()
        except LabError as e:
            if exc is None:
                raise
            # the body's exception matters more; the leftovers are reported, not hidden
            print(
                f"isthmus.lab: teardown after an error left something behind: {e}", file=sys.stderr
            )

    def start(self) -> None:
        """Build the network. Raises :class:`LabUnavailable`/:class:`LabError`, leaving nothing."""
        if self._active or self._closed:
            raise LabError("a WanNetwork can be started once; make a new one")
        reason = unavailable_reason()
        if reason is not None:
            raise LabUnavailable(reason)
        self._active = True
        self._install_signal_handlers()
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _start_line(self, line: DelayLine) -> None:
        self._lines.append(line)  # first, so that teardown stops it whatever happens next
        line.start()

    def _build(self) -> None:
        build_network(
            bridge_netns=self.bridge_netns,
            nodes=self.nodes,
            prefixlen=self.subnet.prefixlen,
            sites=self.sites,
            congestion_control=self.congestion_control,
            seed=self.seed,
            created=self._created,
            start_line=self._start_line,
        )

    def tcp_congestion_control(self) -> str | None:
        """The TCP congestion control the peers' namespaces use (read in peer 0's), or None if
        it cannot be read."""
        try:
            out = run_cmd(
                [
                    *("ip", "netns", "exec", self.peers[0].netns, "sysctl", "-n"),
                    "net.ipv4.tcp_congestion_control",
                ]
            )
        except LabError:
            return None
        return out.strip() or None

    def close(self) -> None:
        """Tear everything down; safe to call any number of times, from any exit path.

        Terminates processes started with :meth:`popen` and any other process inside the run's
        namespaces, deletes the namespaces, then checks that none is left. Raises
        :class:`LabError` naming what could not be removed (run :func:`cleanup_stale` later).
        """
        with self._lock:
            if self._closed or not self._active:
                self._closed = True
                return
            self._closed = True
            self._active = False
            self._restore_signal_handlers()
            with contextlib.suppress(Exception):
                atexit.unregister(self.close)
            for proc in self._procs:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.terminate()
            deadline = time.monotonic() + TERM_GRACE_S
            for proc in self._procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=TERM_GRACE_S)
            # the lines after the processes (no link is cut under a peer that is still
            # exiting), before the namespaces (their counters are kept)
            for line in self._lines:
                counters = line.stop()
                if counters is not None:
                    self.line_counters.append(counters)
            # node namespaces before the bridge: each veth goes with its node's namespace
            for name in self.namespaces:
                with contextlib.suppress(LabError):
                    delete_namespace(name)
            try:
                left = set(self.namespaces) & set(list_namespaces())
            except LabError as e:
                raise LabError(f"could not verify teardown of run {self.run_id}: {e}") from e
            if left:
                raise LabError(
                    f"namespaces left after teardown: {sorted(left)}; "
                    f"run isthmus.lab.netns.cleanup_stale({self.prefix!r}, include_live=True)"
                )

    # ------------------------------------------------------------------ signals

    def _install_signal_handlers(self) -> None:
        if not self.handle_signals or threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous = signal.getsignal(signum)
            if previous is signal.SIG_IGN:
                continue  # the process chose to ignore it; so do we
            self._old_handlers[signum] = previous
            signal.signal(signum, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # the handler forwards to the old one anyway; it cannot be restored from here
        for signum, previous in self._old_handlers.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._old_handlers.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        previous = self._old_handlers.get(signum, signal.SIG_DFL)
        try:
            self.close()
        except LabError as e:
            print(f"isthmus.lab: teardown on signal {signum} incomplete: {e}", file=sys.stderr)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            # die of the same signal, as the process would have without us
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    # ------------------------------------------------------------------ running things

    def env(self, which: int | Literal["coordinator"]) -> dict[str, str]:
        """Environment additions a process on that node needs: Gloo's interface name.

        Gloo otherwise picks its address from the hostname, which resolves to 127.0.0.1 inside a
        namespace, and the other nodes could not reach it. Torch reads ``GLOO_SOCKET_IFNAME``
        only in ``init_process_group``/``new_group``; a group built directly (isthmus's
        ``build_process_group``) must be given ``interface=`` (this variable's value) or
        ``hostname=`` (the node's ``ip``), or it binds 127.0.0.1 even with the variable set.
        """
        env = {"GLOO_SOCKET_IFNAME": self.node(which).ifname}
        if which != "coordinator" and self.sites is not None:
            # the scenario's bandwidth to every other peer, by address, for the coordinator's
            # ring order (the built-in job reports it; see isthmus.coordinator.ring)
            nodes = [self.node(b) for b in range(len(self.peers)) if b != which]
            rates = {
                n.ip: path_rate_mbit(
                    [self.node(which).rate_bps, n.rate_bps], self.sites, which, n.index
                )
                for n in nodes
            }
            if all(r is not None for r in rates.values()):
                env["ISTHMUS_LINKS"] = json.dumps(rates)
        return env

    def command(self, which: int | Literal["coordinator"], argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside that node's namespace (``ip netns exec``)."""
        return ["ip", "netns", "exec", self.node(which).netns, *argv]

    def popen(
        self,
        which: int | Literal["coordinator"],
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` inside that node's namespace; it is terminated at teardown if still running.

        The child's environment is ours, plus :meth:`env` for the node, plus ``env`` (which wins).
        Other keyword arguments go to ``subprocess.Popen``. Raises :class:`LabError` if the
        network is not active.
        """
        with self._lock:
            if not self._active:
                raise LabError("the network is not active (use it inside `with WanNetwork(...)`)")
            full_env = {**os.environ, **self.env(which), **(env or {})}
            proc = subprocess.Popen(self.command(which, argv), env=full_env, **kwargs)
            self._procs.append(proc)
            return proc

    def run(
        self,
        which: int | Literal["coordinator"],
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 60.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` to completion inside that node's namespace, capturing text output.

        Raises ``subprocess.TimeoutExpired`` after ``timeout_s`` (the child is killed) and
        :class:`LabError` if the network is not active; the exit status is left to the caller.
        """
        proc = self.popen(
            which, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def counters(self) -> dict[int | Literal["coordinator"], InterfaceCounters]:
        """Snapshot of every node's link counters, keyed by peer index and ``"coordinator"``.

        Subtract two snapshots to get the bytes each node sent (``tx_bytes``) and received.
        """
        out: dict[int | Literal["coordinator"], InterfaceCounters] = {
            "coordinator": read_counters(self.coordinator.ifname, netns=self.coordinator.netns)
        }
        for p in self.peers:
            out[p.index] = read_counters(p.ifname, netns=p.netns)
        return out
