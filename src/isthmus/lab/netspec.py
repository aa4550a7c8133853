"""A scenario's ``[network]``: every peer's link (rate, round-trip time, jitter, loss) and, when the
peers are spread over sites, the thin links that join the sites.

What the numbers mean (docs/LAB.md has the table):

* A peer's ``rtt_ms`` is the round trip between it and another peer with the same setting: a round
  trip crosses both peers' links in both directions, so each crossing of a peer's link takes a
  quarter of it, and peers ``i`` and ``j`` are ``(rtt_i + rtt_j) / 2`` apart (plus the site link
  between them). ``jitter_ms`` is spread the same way: the round trip between two such peers stays
  within ``rtt_ms +- jitter_ms``. ``loss`` is the share of packets lost one way between two such
  peers (each crossing of the link loses ``1 - sqrt(1 - loss)``).
* A site link's ``rtt_ms``, ``jitter_ms`` and ``loss`` are those between its two sites (each
  direction: half the round trip, the full loss), and its ``rate`` is shared by every flow that
  crosses it, as a real inter-site link is.

All values are checked on construction and every problem raises a
:class:`~isthmus.spec.SpecError` naming the key (``network.rtt_ms[2]``,
``network.sites[1].peers``) and what to write instead.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from isthmus.lab.checks import (
    check_float,
    check_int,
    check_str,
    construct,
    rate_or_unlimited,
)
from isthmus.settings import check_keys
from isthmus.spec import SpecError

__all__ = [
    "CONGESTION_CONTROL_NAME",
    "MAX_LAB_PEERS",
    "MAX_RTT_MS",
    "Impairment",
    "NetworkSpec",
    "Site",
    "SiteLink",
    "Sites",
    "parse_network",
    "path_rtt_ms",
]

MAX_LAB_PEERS = 252
"""The lab's /24 holds a coordinator and 252 peers; larger runs belong in the simulator."""
MAX_RTT_MS = 5000.0
"""Longer round trips than this are a configuration mistake: no real link is that slow."""

#: what a TCP congestion control name may look like (``reno``, ``bbr``, ``cubic``, ...)
CONGESTION_CONTROL_NAME = re.compile(r"[a-z0-9_]+")
_SITE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}")


@dataclass(frozen=True, kw_only=True)
class Impairment:
    """Round-trip time, jitter and loss of a link (see the module docstring for how they add up)."""

    rtt_ms: float = 0.0
    """Round-trip time in milliseconds, 0 to :data:`MAX_RTT_MS`."""
    jitter_ms: float = 0.0
    """The round trip varies within ``rtt_ms +- jitter_ms`` (uniformly per crossing; packets keep
    their order). At most ``rtt_ms``."""
    loss: float = 0.0
    """Share of packets lost one way, 0 (default) to below 1."""

    def __post_init__(self) -> None:
        rtt = check_float(self.rtt_ms, "rtt_ms", minimum=0.0)
        if rtt > MAX_RTT_MS:
            raise SpecError(
                f"{rtt:g} ms is longer than any real round trip; at most {MAX_RTT_MS:g}",
                key="rtt_ms",
            )
        jitter = check_float(self.jitter_ms, "jitter_ms", minimum=0.0)
        if jitter > rtt:
            raise SpecError(
                f"jitter {jitter:g} ms is more than the round trip ({rtt:g} ms): a packet "
                "cannot arrive before it was sent; lower jitter_ms or raise rtt_ms",
                key="jitter_ms",
            )
        loss = check_float(self.loss, "loss", minimum=0.0)
        if loss >= 1:
            raise SpecError(
                f"must be a probability below 1 (0.01 is 1% loss), got {loss:g}", key="loss"
            )
        object.__setattr__(self, "rtt_ms", rtt)
        object.__setattr__(self, "jitter_ms", jitter)
        object.__setattr__(self, "loss", loss)

    @property
    def active(self) -> bool:
        """Whether the link needs a delay line at all."""
        return bool(self.rtt_ms or self.jitter_ms or self.loss)


@dataclass(frozen=True, kw_only=True)
class Site:
    """One ``[[network.sites]]`` entry: a place whose peers share a fast local network."""

    name: str
    """A label (letters, digits, ``_.-``), unique among the sites."""
    peers: tuple[int, ...]
    """The peers it holds, 0-based."""

    def __post_init__(self) -> None:
        check_str(self.name, "name")
        if not _SITE_NAME.fullmatch(self.name):
            raise SpecError(
                f"site names are 1-32 letters, digits, '_', '.' or '-', got {self.name!r}",
                key="name",
            )
        if not isinstance(self.peers, (list, tuple)) or not self.peers:
            raise SpecError(
                f"must be a non-empty list of peer indices, got {self.peers!r}", key="peers"
            )
        peers = tuple(check_int(p, f"peers[{i}]", minimum=0) for i, p in enumerate(self.peers))
        if len(set(peers)) != len(peers):
            raise SpecError(f"lists a peer twice: {list(peers)}", key="peers")
        object.__setattr__(self, "peers", peers)


@dataclass(frozen=True, kw_only=True)
class SiteLink:
    """One ``[[network.site_links]]`` entry: the link between two sites, both directions."""

    sites: tuple[str, str]
    """The two sites' names."""
    rate_bps: float | None = None
    """Its rate in bits/s in each direction, shared by every flow crossing it; ``None``: unshaped."""
    impairment: Impairment = field(default_factory=Impairment)
    """Round trip, jitter and loss between the two sites."""

    def __post_init__(self) -> None:
        s = self.sites
        if not (
            isinstance(s, (list, tuple)) and len(s) == 2 and all(isinstance(x, str) for x in s)
        ):
            raise SpecError(f'must name two sites, e.g. ["eu", "us"], got {s!r}', key="sites")
        if s[0] == s[1]:
            raise SpecError(
                f"joins site {s[0]!r} to itself; a site's own peers share its bridge", key="sites"
            )
        object.__setattr__(self, "sites", (s[0], s[1]))
        if self.rate_bps is not None:
            check_float(self.rate_bps, "rate", positive=True)


@dataclass(frozen=True, kw_only=True)
class Sites:
    """Peers grouped into sites and the links between the sites: every pair of sites has exactly
    one link, every peer (checked against the peer count by :class:`NetworkSpec`) sits in exactly
    one site."""

    sites: tuple[Site, ...]
    links: tuple[SiteLink, ...] = ()
    coordinator_site: str | None = None
    """Where the coordinator sits; ``None``: the first site."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sites", tuple(self.sites))
        object.__setattr__(self, "links", tuple(self.links))
        if not self.sites:
            raise SpecError("give at least one [[network.sites]] entry", key="sites")
        names = [s.name for s in self.sites]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise SpecError(f"site {name!r} is defined twice", key=f"sites[{i}].name")
        seen: dict[int, str] = {}
        for i, site in enumerate(self.sites):
            for p in site.peers:
                if p in seen:
                    raise SpecError(
                        f"peer {p} is already in site {seen[p]!r}; a peer sits in one site",
                        key=f"sites[{i}].peers",
                    )
                seen[p] = site.name
        pairs: dict[frozenset[str], int] = {}
        for i, link in enumerate(self.links):
            for name in link.sites:
                if name not in names:
                    raise SpecError(
                        f"no site {name!r}; the sites are {', '.join(names)}",
                        key=f"site_links[{i}].sites",
                    )
            pair = frozenset(link.sites)
            if pair in pairs:
                raise SpecError(
                    f"sites {link.sites[0]!r} and {link.sites[1]!r} are already joined by "
                    f"site_links[{pairs[pair]}]",
                    key=f"site_links[{i}].sites",
                )
            pairs[pair] = i
        missing = [
            f"{a}-{b}"
            for k, a in enumerate(names)
            for b in names[k + 1 :]
            if frozenset((a, b)) not in pairs
        ]
        if missing:
            raise SpecError(
                f"no link between sites {', '.join(missing)}: add a [[network.site_links]] entry "
                "with sites, rate and rtt_ms for every pair of sites",
                key="site_links",
            )
        if self.coordinator_site is not None and self.coordinator_site not in names:
            raise SpecError(
                f"no site {self.coordinator_site!r}; the sites are {', '.join(names)}",
                key="coordinator_site",
            )

    @property
    def coordinator_index(self) -> int:
        """Index of the coordinator's site."""
        names = [s.name for s in self.sites]
        return names.index(self.coordinator_site) if self.coordinator_site else 0

    def site_of(self, peer: int) -> int:
        """Index of the site holding ``peer``; ``KeyError`` for a peer in none."""
        for k, site in enumerate(self.sites):
            if peer in site.peers:
                return k
        raise KeyError(f"peer {peer} is in no site")

    def link(self, a: int, b: int) -> SiteLink:
        """The link between sites ``a`` and ``b`` (indices, different)."""
        pair = {self.sites[a].name, self.sites[b].name}
        for link in self.links:
            if set(link.sites) == pair:
                return link
        raise KeyError(f"no link between sites {sorted(pair)}")

    def check_peers(self, n: int) -> None:
        """Every peer 0..n-1 in a site, and no site naming a peer beyond them."""
        placed: set[int] = set()
        for i, site in enumerate(self.sites):
            for p in site.peers:
                if p >= n:
                    raise SpecError(
                        f"peer {p} does not exist: network.peers = {n}, so peers are 0..{n - 1}",
                        key=f"sites[{i}].peers",
                    )
                placed.add(p)
        left = sorted(set(range(n)) - placed)
        if left:
            raise SpecError(
                f"peers {left} are in no site; with sites, every peer belongs to one",
                key="sites",
            )


@dataclass(frozen=True, kw_only=True)
class NetworkSpec:
    """``[network]``: how many peers, each one's link (both directions) and where they sit."""

    peers: int
    """Peers at the start of the run, including any that join later (see ``[[churn]]``)."""
    rates_bps: tuple[float | None, ...]
    """Per-peer link rate in bits/s, one entry per peer; ``None``: unshaped."""
    coordinator_rate_bps: float | None = None
    """The coordinator's link rate; ``None`` (default): unshaped."""
    congestion_control: str | None = None
    """TCP congestion control in every namespace (e.g. ``reno``, ``bbr``); ``None``: the host's."""
    impairments: tuple[Impairment, ...] = ()
    """Per-peer round trip, jitter and loss, one entry per peer; empty: none anywhere."""
    sites: Sites | None = None
    """Sites and the links between them; ``None``: every peer on one bridge."""
    nat: tuple[int, ...] = ()
    """Peers behind a NAT router of their own that accepts no inbound connection (indices)."""

    def __post_init__(self) -> None:
        check_int(self.peers, "peers", minimum=1)
        if self.peers > MAX_LAB_PEERS:
            raise SpecError(
                f"{self.peers} peers do not fit the lab's /24 (at most {MAX_LAB_PEERS}); use the "
                "simulator (isthmus.lab.sim) for larger runs",
                key="peers",
            )
        rates = tuple(self.rates_bps)
        if len(rates) != self.peers:
            raise SpecError(
                f"{len(rates)} rates for {self.peers} peers; give one rate for all or one per peer",
                key="rate",
            )
        for i, r in enumerate([*rates, self.coordinator_rate_bps]):
            if r is not None:
                name = "coordinator_rate" if i == len(rates) else f"rate[{i}]"
                check_float(r, name, positive=True)
        cc = self.congestion_control
        if cc is not None and not (isinstance(cc, str) and CONGESTION_CONTROL_NAME.fullmatch(cc)):
            raise SpecError(
                f"must be a TCP congestion control name such as 'reno' or 'bbr', got {cc!r}",
                key="congestion_control",
            )
        object.__setattr__(self, "rates_bps", rates)
        imps = tuple(self.impairments) or (Impairment(),) * self.peers
        if len(imps) != self.peers:
            raise SpecError(
                f"{len(imps)} link impairments for {self.peers} peers; give one value for all "
                "or one per peer",
                key="rtt_ms",
            )
        object.__setattr__(self, "impairments", imps)
        if self.sites is not None:
            self.sites.check_peers(self.peers)
        for i in self.nat:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.peers:
                raise SpecError(f"must list peer indices 0..{self.peers - 1}, got {i!r}", key="nat")
        object.__setattr__(self, "nat", tuple(sorted(set(self.nat))))

    def rtt_ms(self, a: int, b: int) -> float:
        """The round trip the emulation should give between peers ``a`` and ``b``, in ms (queues
        empty, jitter aside): half of each peer's link setting plus their sites' link."""
        return path_rtt_ms([self.impairments[a], self.impairments[b]], self.sites, a, b)


def path_rtt_ms(links: Sequence[Impairment | None], sites: Sites | None, a: int, b: int) -> float:
    """Round trip between peers ``a`` and ``b`` whose own links are ``links`` (theirs, in that
    order): the mean of their links' ``rtt_ms`` plus the link between their sites, if any."""
    rtt = sum(x.rtt_ms for x in links if x is not None) / 2
    if sites is not None:
        sa, sb = sites.site_of(a), sites.site_of(b)
        if sa != sb:
            rtt += sites.link(sa, sb).impairment.rtt_ms
    return rtt


def path_rate_mbit(
    rates_bps: Sequence[float | None], sites: Sites | None, a: int, b: int
) -> float | None:
    """The rate between peers ``a`` and ``b`` whose own links are ``rates_bps`` (theirs, in
    that order), in Mbit/s: the slowest of their links and the link between their sites, if
    any; ``None`` when nothing on the path is shaped."""
    rates = [r for r in rates_bps if r is not None]
    if sites is not None:
        sa, sb = sites.site_of(a), sites.site_of(b)
        if sa != sb and sites.link(sa, sb).rate_bps is not None:
            rates.append(float(sites.link(sa, sb).rate_bps))  # type: ignore[arg-type]
    return min(rates) / 1e6 if rates else None


# ---------------------------------------------------------------------------- parsing

_NETWORK_KEYS = (
    "peers",
    "rate",
    "coordinator_rate",
    "congestion_control",
    "rtt_ms",
    "jitter_ms",
    "loss",
    "sites",
    "site_links",
    "coordinator_site",
    "nat",
)
_HINTS = {
    name: " (write the round trip as rtt_ms, e.g. rtt_ms = 80)"
    for name in ("latency", "delay", "latency_ms", "delay_ms", "rtt")
} | {"jitter": " (did you mean 'jitter_ms'?)", "packet_loss": " (did you mean 'loss'?)"}


def _per_peer(value: Any, key: str, peers: int) -> list[Any]:
    if isinstance(value, list):
        if len(value) != peers:
            raise SpecError(
                f"{len(value)} values for {peers} peers; give one value for all or one per peer",
                key=key,
            )
        return value
    return [value] * peers


_IMPAIRMENT_KEYS = ("rtt_ms", "jitter_ms", "loss")


def _peer_impairments(t: Mapping[str, Any], peers: int) -> tuple[Impairment, ...]:
    values = {k: _per_peer(t.get(k, 0.0), f"network.{k}", peers) for k in _IMPAIRMENT_KEYS}
    out = []
    for i in range(peers):
        try:
            out.append(Impairment(**{k: v[i] for k, v in values.items()}))
        except SpecError as e:
            where = f"[{i}]" if isinstance(t.get(e.key), list) else ""
            raise SpecError(e.problem, key=f"network.{e.key}{where}") from None
    return tuple(out)


def _sites(t: Mapping[str, Any]) -> Sites | None:
    if "sites" not in t:
        for k in ("site_links", "coordinator_site"):
            if k in t:
                raise SpecError(
                    f"{k} needs [[network.sites]] entries that say which peers sit where",
                    key=f"network.{k}",
                )
        return None
    raw_sites, raw_links = t["sites"], t.get("site_links", [])
    for k, v in (("sites", raw_sites), ("site_links", raw_links)):
        if not isinstance(v, list):
            raise SpecError(f"write each entry as a [[network.{k}]] table", key=f"network.{k}")
    sites = []
    for i, raw in enumerate(raw_sites):
        st = check_keys(raw, f"network.sites[{i}]", ["name", "peers"], ["name", "peers"])
        sites.append(construct(Site, f"network.sites[{i}]", **st))
    links = []
    for i, raw in enumerate(raw_links):
        key = f"network.site_links[{i}]"
        lt = check_keys(
            raw, key, ["sites", "rate", "rtt_ms", "jitter_ms", "loss"], ["sites", "rate"]
        )
        links.append(
            construct(
                SiteLink,
                key,
                sites=lt["sites"],
                rate_bps=rate_or_unlimited(lt["rate"], f"{key}.rate"),
                impairment=construct(
                    Impairment, key, **{k: lt[k] for k in _IMPAIRMENT_KEYS if k in lt}
                ),
            )
        )
    coord = t.get("coordinator_site")
    if coord is not None and not isinstance(coord, str):
        raise SpecError(f"must be a site name, got {coord!r}", key="network.coordinator_site")
    return construct(Sites, "network", sites=sites, links=links, coordinator_site=coord)


def parse_network(raw: Any) -> NetworkSpec:
    """The ``[network]`` table as a :class:`NetworkSpec`; raises :class:`SpecError`."""
    t = check_keys(raw, "network", _NETWORK_KEYS, ["peers", "rate"], hints=_HINTS)
    peers = check_int(t["peers"], "network.peers", minimum=1)
    rate = t["rate"]
    if isinstance(rate, list):
        rates = tuple(rate_or_unlimited(r, f"network.rate[{i}]") for i, r in enumerate(rate))
    else:
        rates = (rate_or_unlimited(rate, "network.rate"),) * peers
    coord_bps = rate_or_unlimited(
        t.get("coordinator_rate", "unlimited"), "network.coordinator_rate"
    )
    impairments = _peer_impairments(t, peers)
    return construct(
        NetworkSpec,
        "network",
        peers=peers,
        rates_bps=rates,
        coordinator_rate_bps=coord_bps,
        congestion_control=t.get("congestion_control"),
        impairments=impairments,
        sites=_sites(t),
        nat=tuple(nat) if isinstance(nat := t.get("nat", []), list) else (nat,),
    )
