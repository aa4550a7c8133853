"""Connecting one epoch's process groups: the Gloo groups (one per stripe), their rendezvous, and
the bounds and aborts around them. :class:`~isthmus.comm.session.Session` calls
:func:`connect_epoch` when a round opens an epoch it has no group for.

What happens on failure: a member that cannot be reached, a rendezvous that does not complete
within ``collective_timeout``, or an abort of the epoch by the coordinator while connecting raise
:class:`~isthmus.comm.group.CollectiveError`. When the group did not connect in time (not
aborted), every other member's probe listener (the plan's ``reach``) is probed in parallel,
bounded by ``probe_timeout``, and the error names those not reached (``cannot reach peer 2 at
10.0.0.4:41234 (refused)``) and carries them as ``unreached`` (``(peer id, address, How)``); the attempt is then parked in the session's
:class:`~isthmus.comm.connect.Graveyard` until its thread is out of torch (its connections are
cut). Members that were given different ``SessionConfig.connections``, or that speak different
isthmus protocol versions, fail the same way, with an error naming the setting or both versions
(:func:`isthmus.comm.stripes.connect_stripes` for Gloo; NCCL members compare the versions they
recorded in the epoch's store once connected).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.distributed as dist

from isthmus.comm.connect import (
    Connecting,
    Graveyard,
    Rendezvous,
    check_protocols,
    connect_gloo,
    publish_protocol,
)
from isthmus.comm.group import CollectiveError, CommStats, Group, build_process_group
from isthmus.comm.reach import probe_all
from isthmus.comm.session_config import SessionConfig
from isthmus.comm.stripes import connect_stripes, reverse_sets
from isthmus.comm.wires import Wires
from isthmus.coordinator.protocol import RoundPlan

__all__ = ["connect_epoch"]


def connect_epoch(
    plan: RoundPlan,
    *,
    peer_id: int,
    owner: str,
    run_id: str,
    config: SessionConfig,
    backend: str,
    stats: CommStats,
    stores: Rendezvous,
    aborted: Callable[[], bool],
    graveyard: Graveyard,
    wishes: Sequence[int] = (),
    reach_source: str | None = None,
    reach: Mapping[int, str] | None = None,
) -> tuple[Group, list[int]]:
    """The :class:`Group` of ``plan``'s epoch for member ``peer_id`` (``owner`` names the
    session in logs): a group of one without connections when the epoch has one member, else
    ``config.connections`` Gloo groups (or one NCCL group) on the epoch's store prefix
    ``isthmus/<run_id>/epoch<N>/``. ``aborted()`` says whether the coordinator aborted the epoch
    meanwhile (the attempt is then abandoned). ``wishes`` go into the Gloo handshake
    (:func:`~isthmus.comm.stripes.connect_stripes`); returned with the group is their maximum
    over the members (empty for a group of one or NCCL, which have no handshake).
    ``reach_source``: the local address probes go out from (this peer's Gloo address);
    ``reach``: the probe listeners of the group's other members (default: the plan's ``reach``;
    an island's rank probes the ranks its group holds). Raises
    :class:`CollectiveError` as the module docstring says."""
    name = f"epoch{plan.epoch}"
    rank, world = plan.rank_of(peer_id), len(plan.members)
    cfg = config
    if world == 1:
        return Group(None, 0, 1, timeout_s=cfg.collective_timeout, stats=stats, name=name), []
    wires = Wires(f"{owner} {name}")
    gloo = functools.partial(
        connect_gloo,
        rank=rank,
        world=world,
        timeout_s=cfg.collective_timeout,
        wires=wires,
        interface=cfg.interface,
        hostname=cfg.hostname,
    )
    deadline = time.monotonic() + cfg.collective_timeout

    def abandon() -> str | None:
        if aborted():
            return f"epoch {plan.epoch} aborted while its group was connecting"
        if time.monotonic() > deadline:
            return (
                f"could not connect the process group of epoch {plan.epoch} within "
                f"{cfg.collective_timeout:.0f}s (a member is unreachable: check the network "
                f"interface and that peers can reach each other's Gloo ports)"
            )
        return None

    store = dist.PrefixStore(f"isthmus/{run_id}/{name}/", stores.take(wires, abandon))

    def build() -> Any:
        if backend == "gloo":  # K groups, K connections per pair (comm/stripes.py)
            return connect_stripes(gloo, store, cfg.connections, wishes=wishes)
        publish_protocol(store, rank)  # NCCL has no handshake of ours: compare versions here
        pg = build_process_group(
            store,
            rank,
            world,
            timeout_s=cfg.collective_timeout,
            backend=backend,
            interface=cfg.interface,
            hostname=cfg.hostname,
        )
        check_protocols(store, rank, world)
        return pg, [], []

    attempt = Connecting(build, wires, name=f"connect-{name}")
    try:
        pg, stripes, agreed = attempt.wait(abandon)
    except CollectiveError as e:
        graveyard.park(attempt)  # until its thread is out of torch
        if aborted():
            raise
        raise _name_unreached(e, plan, peer_id, cfg.probe_timeout, reach_source, reach) from None
    # a second connection set (one per stripe), built on first use by Group.exchange
    reverse = reverse_sets(gloo, store, cfg.connections) if backend == "gloo" else None
    group = Group(
        pg,
        rank,
        world,
        timeout_s=cfg.collective_timeout,
        stats=stats,
        name=name,
        connect_reverse=reverse,
        wires=wires,
        stripes=stripes,
        stall_s=cfg.stall_s,
        late_s=cfg.late_s,
        epoch=plan.epoch,
    )
    return group, agreed


def _name_unreached(
    e: CollectiveError,
    plan: RoundPlan,
    peer_id: int,
    timeout_s: float,
    source: str | None,
    reach: Mapping[int, str] | None,
) -> CollectiveError:
    """``e`` with the members whose probe listeners (``reach``, else the plan's) did not answer
    named in its text and in its ``unreached`` (``(peer id, address, How)``); ``e`` itself when
    all answered or no addresses are known."""
    if reach is not None:
        addresses = {m: a for m, a in reach.items() if m != peer_id and m in plan.members}
    else:
        addresses = {
            int(k): a
            for k, a in (plan.reach or {}).items()
            if k.isdigit() and int(k) != peer_id and int(k) in plan.members
        }
    if not addresses:
        return e
    found = probe_all(addresses, timeout_s=timeout_s, source=source)
    if not found:
        return e
    names = ", ".join(f"cannot reach peer {m} at {a} ({how.value})" for m, a, how in found)
    err = CollectiveError(f"{e}; {names}")
    err.unreached = tuple(found)  # type: ignore[attr-defined]
    return err
