"""Helpers for tests: real Gloo groups inside one process, one thread per rank.

These run the same collectives as a multi-process run (Gloo over loopback TCP), so a distributed
algorithm can be checked against its pure reference without starting processes. Tests of failure
handling (kills, stops, joins) use real processes instead; see tests/integration.
"""

from __future__ import annotations

import functools
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch.distributed as dist

from isthmus.comm.group import CommStats, Group, build_process_group
from isthmus.comm.stripes import connect_stripes, reverse_sets

T = TypeVar("T")

__all__ = ["local_groups", "run_parallel"]


def local_groups(world: int, *, timeout_s: float = 30.0, connections: int = 1) -> list[Group]:
    """Build ``world`` connected :class:`Group` objects in this process (ranks 0..world-1).

    Each gets its own :class:`CommStats`, so byte accounting is per rank as in a real run.
    ``connections`` > 1 builds that many process groups per rank, striped as a session's are
    (:mod:`isthmus.comm.stripes`).
    """
    if world == 1:
        return [Group(None, 0, 1, timeout_s=timeout_s)]
    store = dist.PrefixStore(f"local/{uuid.uuid4().hex}/", dist.HashStore())

    def build(rank: int) -> Group:
        connect = functools.partial(
            build_process_group, rank=rank, world=world, timeout_s=timeout_s, hostname="127.0.0.1"
        )
        pg, stripes, _ = connect_stripes(connect, store, connections)
        return Group(
            pg,
            rank,
            world,
            timeout_s=timeout_s,
            stats=CommStats(),
            name=f"local{rank}",
            connect_reverse=reverse_sets(connect, store, connections),
            stripes=stripes,
        )

    with ThreadPoolExecutor(max_workers=world) as ex:
        return list(ex.map(build, range(world)))


def run_parallel(
    groups: list[Group], fn: Callable[[Group], T], *, timeout_s: float = 60.0
) -> list[T]:
    """Run ``fn(group)`` for every group concurrently (one thread each); return results in rank
    order. The first exception raised by any rank is re-raised here. Bounded by ``timeout_s``."""
    results: list[Any] = [None] * len(groups)
    errors: list[BaseException] = []

    def target(i: int) -> None:
        try:
            results[i] = fn(groups[i])
        except BaseException as e:  # re-raised in the caller's thread
            errors.append(e)
            for g in groups:  # do not leave the other ranks waiting for a dead rank
                g.abort(f"rank {i} raised {type(e).__name__}")

    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"run_parallel: ranks still running after {timeout_s}s")
    if errors:
        raise errors[0]
    return results
