"""Building a :class:`~isthmus.lab.wan.WanNetwork` step by step: namespaces, bridges (one per
site), each node's link (a veth, or a delay line when it has a round trip, jitter or loss), tbf
shaping at both ends, the core line between sites with per-destination htb shaping, TCP's
congestion control.

Every step records what it made before the next one runs (namespace names in ``created``, lines
through ``start_line``), so when a step fails, the network's teardown removes exactly what exists;
the failure propagates as :class:`~isthmus.lab.netns.LabError`, or
:class:`~isthmus.lab.netns.LabUnavailable` when the machine cannot do it at all (no namespaces,
no tbf or htb).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Sequence

from isthmus.lab.lines import DelayLine, access_line, shape_per_destination, site_core
from isthmus.lab.netns import (
    LabError,
    LabUnavailable,
    Node,
    allowed_congestion_controls,
    run_cmd,
    tbf_parameters,
)
from isthmus.lab.netspec import Sites

__all__ = [
    "NAT_LAN_PEER",
    "add_namespace",
    "add_nat_router",
    "build_network",
    "set_congestion_control",
    "shape",
]

NAT_LAN_ROUTER = "192.168.1.1"
NAT_LAN_PEER = "192.168.1.2"
"""A peer behind NAT and its router on their private network (the same behind every router,
as behind home routers; each pair lives in namespaces of its own)."""

_NAT_RULES = """\
table ip isthmus_nat {
  chain postrouting { type nat hook postrouting priority srcnat; oifname "%(wan)s" masquerade; }
  chain forward {
    type filter hook forward priority filter; policy drop;
    ct state established,related accept
    iifname "lan0" accept
  }
  chain input {
    type filter hook input priority filter; policy drop;
    ct state established,related accept
    iifname { "lo", "lan0" } accept
  }
}
"""


def add_namespace(name: str, created: list[str]) -> None:
    """Create namespace ``name`` (loopback up, IPv6 off) and record it in ``created``."""
    try:
        run_cmd(["ip", "netns", "add", name])
    except LabError as e:
        if not created:
            # the very first namespace: the kernel or container refuses namespaces at all
            raise LabUnavailable(f"cannot create network namespaces here: {e}") from e
        raise
    created.append(name)
    # IPv6 would add neighbour-discovery chatter to the byte counters; the lab is IPv4 only.
    run_cmd(
        f"ip netns exec {name} sysctl -q -w net.ipv6.conf.all.disable_ipv6=1 "
        "net.ipv6.conf.default.disable_ipv6=1".split(),
        check=False,
    )
    run_cmd(["ip", "-n", name, "link", "set", "lo", "up"])


def add_nat_router(node: Node, created: list[str]) -> None:
    """Put ``node`` (a peer, its namespace already made) behind its router: a veth from the
    peer's ``ifname`` to the router's ``lan0`` on a private network, a default route through
    the router, and nftables in the router that masquerade what leaves by its link and drop
    every connection that starts outside (a home router's NAT). The router's own link is built
    like any node's. Raises :class:`LabError`, or :class:`LabUnavailable` without nftables."""
    router = node.router_netns
    assert router is not None
    add_namespace(router, created)
    n, dev = node.netns, node.ifname
    run_cmd(f"ip -n {router} link add lan0 type veth peer name {dev} netns {n}".split())
    run_cmd(f"ip -n {router} addr add {NAT_LAN_ROUTER}/24 dev lan0".split())
    run_cmd(f"ip -n {router} link set lan0 up".split())
    run_cmd(f"ip -n {n} addr add {node.ip}/24 dev {dev}".split())
    run_cmd(f"ip -n {n} link set {dev} up".split())
    run_cmd(f"ip -n {n} route add default via {NAT_LAN_ROUTER}".split())
    run_cmd(f"ip netns exec {router} sysctl -q -w net.ipv4.ip_forward=1".split())
    try:
        proc = subprocess.run(
            ["ip", "netns", "exec", router, "nft", "-f", "-"],
            input=_NAT_RULES % {"wan": node.ifname},
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LabUnavailable(f"NAT needs nftables (apt-get install nftables): {e}") from e
    if proc.returncode != 0:
        raise LabError(f"nft in {router} failed: {proc.stderr.strip()}")


def shape(netns: str, dev: str, rate_bps: float) -> None:
    """tbf at ``rate_bps`` on ``dev``'s egress (:func:`~isthmus.lab.netns.tbf_parameters`)."""
    burst, limit = tbf_parameters(rate_bps)
    # names were validated to contain no whitespace, so splitting a command line is safe
    argv = (
        f"tc -n {netns} qdisc replace dev {dev} root tbf rate {int(rate_bps)}bit "
        f"burst {burst} limit {limit}"
    ).split()
    try:
        run_cmd(argv)
    except LabError as e:
        raise LabUnavailable(f"tc tbf shaping is not available here: {e}") from e


def set_congestion_control(netns: str, name: str) -> None:
    """TCP congestion control ``name`` in ``netns``; :class:`LabError` naming the allowed ones."""
    # A namespace starts with the host's default; only the host's allowed list may be set.
    try:
        run_cmd(
            [
                *("ip", "netns", "exec", netns, "sysctl", "-q", "-w"),
                f"net.ipv4.tcp_congestion_control={name}",
            ]
        )
    except LabError as e:
        raise LabError(
            f"TCP congestion control {name!r} cannot be used in a namespace here (allowed: "
            f"{allowed_congestion_controls() or 'unknown'}; the host's "
            "net.ipv4.tcp_allowed_congestion_control decides): " + str(e)
        ) from e


def build_network(
    *,
    bridge_netns: str,
    nodes: Sequence[Node],
    prefixlen: int,
    sites: Sites | None,
    congestion_control: str | None,
    seed: int,
    created: list[str],
    start_line: Callable[[DelayLine], None],
) -> None:
    """Build everything for ``nodes`` (the coordinator and the peers, already planned)."""
    br = bridge_netns
    add_namespace(br, created)
    n_sites = len(sites.sites) if sites is not None else 1
    for k in range(n_sites):
        run_cmd(["ip", "-n", br, "link", "add", f"br{k}", "type", "bridge"])
        run_cmd(["ip", "-n", br, "link", "set", f"br{k}", "up"])
    for node in nodes:
        add_namespace(node.netns, created)
        if node.router_netns is not None:
            add_nat_router(node, created)
        # behind NAT the shaped link is the router's, with the router's address
        n, dev = node.router_netns or node.netns, node.ifname
        if node.impairment is not None:
            start_line(
                access_line(
                    name=node.role + (str(node.index) if node.index >= 0 else ""),
                    node_netns=n,
                    node_ifname=dev,
                    bridge_netns=br,
                    bridge_port=node.bridge_port,
                    impairment=node.impairment,
                    rate_bps=node.rate_bps,
                    seed=seed * 1000 + node.index + 1,
                )
            )
        else:
            run_cmd(
                f"ip -n {br} link add {node.bridge_port} type veth peer name {dev} netns {n}".split()
            )
        run_cmd(f"ip -n {br} link set {node.bridge_port} master {node.bridge} up".split())
        run_cmd(f"ip -n {n} addr add {node.wan_ip or node.ip}/{prefixlen} dev {dev}".split())
        run_cmd(f"ip -n {n} link set {dev} up".split())
        if node.rate_bps is not None:
            shape(n, dev, node.rate_bps)  # the node's upload
            shape(br, node.bridge_port, node.rate_bps)  # the node's download
        if congestion_control is not None:
            set_congestion_control(node.netns, congestion_control)
    if sites is not None and n_sites > 1:
        _join_sites(br, nodes, sites, seed, start_line)


def _join_sites(
    br: str, nodes: Sequence[Node], sites: Sites, seed: int, start_line: Callable[[DelayLine], None]
) -> None:
    ports = [f"s{k}" for k in range(len(sites.sites))]
    start_line(site_core(name="sites", bridge_netns=br, ports=ports, sites=sites, seed=seed))
    for k, port in enumerate(ports):
        run_cmd(f"ip -n {br} link set {port} master br{k} up".split())
        classes = []
        for m in range(len(sites.sites)):
            rate = sites.link(k, m).rate_bps if m != k else None
            if rate is not None:
                classes.append((rate, [p.wan_ip or p.ip for p in nodes if p.bridge == f"br{m}"]))
        if classes:
            # each site's traffic to every other site waits behind that link's own rate
            shape_per_destination(br, port, classes)
