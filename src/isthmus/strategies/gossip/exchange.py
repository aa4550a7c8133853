"""Gossip over a :class:`~isthmus.comm.group.Group`: the exchange with graph neighbours, the
distributed gossip steps (plain, compressed and variance-corrected), the exact global merge, and
the consensus distance measured over the group (:mod:`.math.consensus` defines it).

Each step sends this rank's vector to its neighbours, receives theirs and combines them with
:func:`~isthmus.strategies.gossip.math.averaging.mix`; it returns exactly the bits the
in-process references of :mod:`isthmus.strategies.gossip.math.averaging` compute for this rank.

Transport. ``transport="p2p"`` posts every send and receive of a step with ``group.send`` /
``group.recv`` (``async_op=True``) before waiting on any, so no ordering of ranks can deadlock.
Each message carries a tag unique to (exchange, sender, receiver, part), see :func:`edge_tag`, so
messages of consecutive exchanges on the same edge cannot be confused.
``transport="all_to_all"`` sends the same bytes through one ``group.all_to_all`` with zero-sized
slices for non-neighbours: a collective, so every rank of the group must call it for every
exchange (including ranks with no neighbours this round), and it holds one copy of the payload
per neighbour in memory.

:func:`global_average` is the single final merge: one all-reduce sum, then a division by the
world size. Gloo's ring all-reduce reduces each element on one rank and forwards the result, so
every rank ends up with the same bits.

A failed send, receive or collective raises the group's
:class:`~isthmus.comm.group.CollectiveError`; a vector with NaN or Inf (sent or received) raises
``ValueError`` before it is mixed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch

from isthmus.comm.group import Group, Handle
from isthmus.strategies.gossip.math.averaging import (
    Decode,
    Encode,
    _check_received,
    _codec_pair,
    _corrected_targets,
    _flat,
    mix,
)
from isthmus.strategies.gossip.math.consensus import _KINDS, _count, _flat64
from isthmus.strategies.gossip.math.mixing import metropolis_row
from isthmus.strategies.gossip.math.sequence import TopologySequence
from isthmus.strategies.gossip.math.topology import Topology
from isthmus.strategies.gossip.math.variance import VARIANCE_EPS, variance_correct_flat

__all__ = [
    "MAX_ITERS_PER_ROUND",
    "consensus_distance_group",
    "edge_tag",
    "exchange_with_neighbors",
    "global_average",
    "gossip",
    "gossip_step",
    "send_copies",
    "variance_corrected_gossip",
    "variance_corrected_gossip_step",
]

_TAG_SPACE = 1 << 31
_PARTS = 2  # header and payload
MAX_ITERS_PER_ROUND = 256
"""Upper bound on gossip iterations per round in :func:`gossip` (tags reserve this many)."""
_MAX_WORLD = 1 << 15  # beyond this one exchange needs more than 2^31 distinct tags
_TRANSPORTS = ("p2p", "all_to_all")


def edge_tag(exchange: int, src: int, dst: int, world: int, part: int = 0) -> int:
    """The message tag for ``src -> dst`` in exchange number ``exchange`` (``part`` 0: payload or
    header, 1: payload after a header).

    Tags live in ``[0, 2^31)`` (Gloo's limit) and are distinct for all messages of any
    ``2^31 / (2 world^2)`` consecutive exchanges, far more than can ever be in flight at once.
    Raises ``ValueError`` for negative arguments or ``world > 32768``.
    """
    if world > _MAX_WORLD:
        raise ValueError(f"edge tags support worlds up to {_MAX_WORLD} ranks, got {world}")
    if exchange < 0 or not (0 <= src < world and 0 <= dst < world) or part not in (0, 1):
        raise ValueError(
            f"bad tag arguments: exchange={exchange} src={src} dst={dst} world={world} part={part}"
        )
    return (((exchange * world + src) * world + dst) * _PARTS + part) % _TAG_SPACE


def _wait(handles: Sequence[Handle]) -> None:
    # the first failed wait aborts the group and raises; the remaining handles are left behind on
    # purpose (their buffers are private to this exchange and never reused)
    for h in handles:
        h.wait()


def _exchange_p2p(
    group: Group,
    payload: torch.Tensor,
    neighbors: Sequence[int],
    exchange: int,
    sized: bool,
    numel: int,
) -> dict[int, torch.Tensor]:
    me, world = group.rank, group.world
    handles: list[Handle] = []
    if not sized:
        bufs = {j: torch.empty(numel, dtype=payload.dtype) for j in neighbors}
        for j in neighbors:
            handles.append(group.send(payload, j, edge_tag(exchange, me, j, world), async_op=True))
        for j in neighbors:
            handles.append(group.recv(bufs[j], j, edge_tag(exchange, j, me, world), async_op=True))
        _wait(handles)
        return bufs
    header = torch.tensor([payload.numel()], dtype=torch.int64)
    sizes = {j: torch.empty(1, dtype=torch.int64) for j in neighbors}
    for j in neighbors:
        handles.append(group.send(header, j, edge_tag(exchange, me, j, world, 0), async_op=True))
        handles.append(group.send(payload, j, edge_tag(exchange, me, j, world, 1), async_op=True))
    size_handles = [
        group.recv(sizes[j], j, edge_tag(exchange, j, me, world, 0), async_op=True)
        for j in neighbors
    ]
    _wait(size_handles)
    bufs = {j: torch.empty(int(sizes[j][0]), dtype=payload.dtype) for j in neighbors}
    for j in neighbors:
        handles.append(group.recv(bufs[j], j, edge_tag(exchange, j, me, world, 1), async_op=True))
    _wait(handles)
    return bufs


def _exchange_all_to_all(
    group: Group,
    payload: torch.Tensor,
    neighbors: Sequence[int],
    sized: bool,
    numel: int,
) -> dict[int, torch.Tensor]:
    world = group.world
    nset = set(neighbors)
    in_splits = [payload.numel() if j in nset else 0 for j in range(world)]
    if sized:
        sizes = group.all_to_all(torch.tensor(in_splits, dtype=torch.int64))
        out_splits = [int(s) for s in sizes]
    else:
        out_splits = [numel if j in nset else 0 for j in range(world)]
    inp = torch.cat([payload] * len(nset)) if nset else payload[:0]
    out = group.all_to_all(inp, in_splits=in_splits, out_splits=out_splits)
    parts = torch.split(out, out_splits)
    return {j: parts[j] for j in sorted(nset)}


def exchange_with_neighbors(
    group: Group,
    vec: torch.Tensor,
    neighbors: Sequence[int],
    *,
    exchange: int,
    encode: Encode | None = None,
    decode: Decode | None = None,
    transport: str = "p2p",
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Send this rank's flat ``vec`` to every rank in ``neighbors`` and receive theirs.

    Returns ``(own, received)``: ``own`` is ``vec`` flattened (or, with a codec, the decoding of
    the payload this rank sent) and ``received`` maps each neighbour to its (decoded) vector.
    The neighbour relation must be symmetric across ranks (each neighbour lists this rank too),
    and ``exchange`` must be the same number on every rank.

    Raises ``ValueError`` before sending if ``vec`` is not finite, and after receiving if a
    neighbour's vector is not finite (naming that rank); raises
    :class:`~isthmus.comm.group.CollectiveError` if a neighbour dies or stays silent past the
    group timeout. After an error the group is unusable for this round.
    """
    if transport not in _TRANSPORTS:
        raise ValueError(f"transport must be one of {_TRANSPORTS}, got {transport!r}")
    coded = _codec_pair(encode, decode)
    flat = _flat(vec, f"rank {group.rank}'s vector")
    nbrs = sorted(set(neighbors))
    if group.rank in nbrs:
        raise ValueError(f"rank {group.rank} lists itself as a neighbour")
    payload = flat
    if coded:
        assert encode is not None
        payload = encode(flat).reshape(-1).contiguous()
    if transport == "p2p":
        got = _exchange_p2p(group, payload, nbrs, exchange, coded, flat.numel()) if nbrs else {}
    else:
        got = _exchange_all_to_all(group, payload, nbrs, coded, flat.numel())
    own = flat
    if coded:
        assert decode is not None
        own = decode(payload, flat.numel()).reshape(-1)
        if not bool(torch.isfinite(own).all()):
            raise ValueError(
                f"rank {group.rank}: decode(encode(vec)) contains NaN or Inf although vec is "
                f"finite; the codec is broken for this input"
            )
        got = {j: decode(p, flat.numel()).reshape(-1) for j, p in got.items()}
    for j, t in got.items():
        _check_received(t, j)
    return own, got


def gossip_step(
    group: Group,
    vec: torch.Tensor,
    topology: Topology,
    *,
    exchange: int,
    encode: Encode | None = None,
    decode: Decode | None = None,
    gamma: float = 1.0,
    transport: str = "p2p",
) -> torch.Tensor:
    """One gossip (mixing) step with Metropolis-Hastings weights; returns the new flat vector.

    ``topology`` must be the same graph on every rank, over ranks ``0..group.world-1``; its
    connectivity is not required (time-varying graphs are disconnected per round). Raises
    ``ValueError`` if the topology size differs from the world size, plus everything
    :func:`exchange_with_neighbors` raises.
    """
    if topology.n != group.world:
        raise ValueError(f"topology has {topology.n} ranks but the group has {group.world}")
    self_w, weights = metropolis_row(topology, group.rank)
    own, got = exchange_with_neighbors(
        group,
        vec,
        topology.neighbors(group.rank),
        exchange=exchange,
        encode=encode,
        decode=decode,
        transport=transport,
    )
    if encode is None:
        return mix(own, got, self_w, weights)
    return mix(own, got, self_w, weights, base=_flat(vec, "vector"), gamma=gamma)


def _graph_for(topology: Topology | TopologySequence, index: int) -> Topology:
    return topology if isinstance(topology, Topology) else topology.at(index)


def _round_of_steps(
    vec: torch.Tensor,
    topology: Topology | TopologySequence,
    *,
    round: int,
    iterations: int,
    step: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """``x = step(x, graph, exchange=...)`` ``iterations`` times from the flat ``vec``, step
    ``q`` on graph ``round * iterations + q`` with exchange ``round * MAX_ITERS_PER_ROUND + q``;
    returns a new tensor shaped like ``vec``. Raises ``ValueError`` for ``iterations`` outside
    ``1..MAX_ITERS_PER_ROUND`` or a negative round, before any step."""
    if not 1 <= iterations <= MAX_ITERS_PER_ROUND:
        raise ValueError(f"iterations must be in 1..{MAX_ITERS_PER_ROUND}, got {iterations}")
    if round < 0:
        raise ValueError(f"round must be >= 0, got {round}")
    x = vec.detach().reshape(-1)
    for q in range(iterations):
        graph = _graph_for(topology, round * iterations + q)
        x = step(x, graph, exchange=round * MAX_ITERS_PER_ROUND + q)
    return x.reshape(vec.shape)


def gossip(
    group: Group,
    vec: torch.Tensor,
    topology: Topology | TopologySequence,
    *,
    round: int,
    iterations: int = 1,
    encode: Encode | None = None,
    decode: Decode | None = None,
    gamma: float = 1.0,
    transport: str = "p2p",
) -> torch.Tensor:
    """``iterations`` gossip steps for round ``round`` (DFedSAM-MGS's Q); returns a new tensor
    shaped like ``vec``.

    For a time-varying sequence, step ``q`` uses graph ``round * iterations + q``, so a
    one-peer exponential sequence with ``iterations = log2 n`` runs through every offset in
    each round. Raises ``ValueError`` for ``iterations`` outside ``1..MAX_ITERS_PER_ROUND`` or a
    negative round, plus everything :func:`gossip_step` raises.
    """
    step = partial(
        gossip_step, group, encode=encode, decode=decode, gamma=gamma, transport=transport
    )
    return _round_of_steps(vec, topology, round=round, iterations=iterations, step=step)


def variance_corrected_gossip_step(
    group: Group,
    vec: torch.Tensor,
    topology: Topology,
    sizes: Sequence[int],
    *,
    exchange: int,
    target: str = "received",
    mix_weight: float = 0.5,
    min_numel: int = 2,
    eps: float = VARIANCE_EPS,
    transport: str = "p2p",
) -> torch.Tensor:
    """A plain gossip step followed by the vanishing-variance correction of
    :mod:`.variance`: each layer (``sizes``: layer sizes of the flat ``vec``) of the mixed vector
    is rescaled to the variance of that layer in the received neighbours (``target="received"``),
    this rank's own (``"own"``) or ``mix_weight * own + (1 - mix_weight) * received``
    (``"mix"``). A rank without neighbours this round targets its own variance.

    Raises like :func:`gossip_step` and :func:`~.variance.variance_correct_flat`.
    """
    if topology.n != group.world:
        raise ValueError(f"topology has {topology.n} ranks but the group has {group.world}")
    self_w, weights = metropolis_row(topology, group.rank)
    own, got = exchange_with_neighbors(
        group, vec, topology.neighbors(group.rank), exchange=exchange, transport=transport
    )
    mixed = mix(own, got, self_w, weights)
    targets = _corrected_targets(own, [got[j] for j in sorted(got)], sizes, target, mix_weight)
    return variance_correct_flat(mixed, sizes, targets, min_numel=min_numel, eps=eps)


def variance_corrected_gossip(
    group: Group,
    vec: torch.Tensor,
    topology: Topology | TopologySequence,
    sizes: Sequence[int],
    *,
    round: int,
    iterations: int = 1,
    target: str = "received",
    mix_weight: float = 0.5,
    min_numel: int = 2,
    eps: float = VARIANCE_EPS,
    transport: str = "p2p",
) -> torch.Tensor:
    """``iterations`` variance-corrected gossip steps for round ``round``, numbered and with the
    graphs chosen exactly like :func:`gossip`; returns a new tensor shaped like ``vec``.

    Raises like :func:`gossip` and :func:`variance_corrected_gossip_step`.
    """
    step = partial(
        variance_corrected_gossip_step,
        group,
        sizes=sizes,
        target=target,
        mix_weight=mix_weight,
        min_numel=min_numel,
        eps=eps,
        transport=transport,
    )
    return _round_of_steps(vec, topology, round=round, iterations=iterations, step=step)


def global_average(group: Group, vec: torch.Tensor, *, contribute: bool = True) -> torch.Tensor:
    """The exact average of the contributing ranks' ``vec`` (a new tensor, same shape and dtype),
    identical bit for bit on all ranks: one all-reduce of ``[vec, 1]`` (``[0, 0]`` from a rank
    with ``contribute=False``), then a division by the summed count. With every rank
    contributing the count is the world size.

    A non-contributing rank (a joiner whose vector is stale) still receives the average; its
    ``vec`` only gives the shape and dtype and may hold anything, NaN included.

    Raises ``ValueError`` before sending if a contributing ``vec`` is not finite, and after the
    reduction if no rank contributed or the sum overflowed (every rank sees the same sum, so every
    rank raises); :class:`~isthmus.comm.group.CollectiveError` if the all-reduce fails.
    """
    if contribute:
        flat = _flat(vec, f"rank {group.rank}'s vector")
    else:
        if not vec.is_floating_point():
            raise ValueError(
                f"vector has dtype {vec.dtype}; gossip averages floating-point vectors"
            )
        flat = torch.zeros(vec.numel(), dtype=vec.dtype)
    # the count rides in the same buffer (exact in any float dtype for realistic worlds), so the
    # average costs one collective
    buf = torch.empty(flat.numel() + 1, dtype=flat.dtype)
    buf[:-1] = flat
    buf[-1] = 1.0 if contribute else 0.0
    group.all_reduce(buf, "sum")
    count = float(buf[-1])
    if count < 0.5:
        raise ValueError("global average with no contributing rank: nobody holds a usable vector")
    out = buf[:-1]
    if out.is_floating_point() and not bool(torch.isfinite(out).all()):
        raise ValueError(
            "global average overflowed (the sum of finite vectors is Inf); average in a wider "
            "dtype or rescale the vectors"
        )
    return out.div_(count).reshape(vec.shape)


def send_copies(
    group: Group,
    vec: torch.Tensor,
    pairs: Sequence[tuple[int, int]],
    *,
    exchange: int,
) -> torch.Tensor | None:
    """Copy vectors along ``pairs`` of ranks ``(src, dst)``: each ``src`` sends its flat ``vec``
    to its ``dst``. Returns the vector received (flat, dtype of ``vec``) on a rank that is a
    ``dst``, else ``None``. Every rank must pass the same ``pairs`` and ``exchange``; a rank may
    be the destination of at most one pair and may send to several.

    Gossip uses this to hand a joiner (or a peer whose model is stale or not finite) a copy of an
    up-to-date neighbour's model. Only ranks named in ``pairs`` communicate.

    Raises ``ValueError`` for a rank that is the destination twice or a pair that sends to itself,
    for a non-finite ``vec`` on a sender, and for a non-finite vector received;
    :class:`~isthmus.comm.group.CollectiveError` if a partner fails.
    """
    me, world = group.rank, group.world
    dsts = [d for _, d in pairs]
    if len(set(dsts)) != len(dsts):
        raise ValueError(f"a rank may receive one copy per exchange; pairs {list(pairs)}")
    for s, d in pairs:
        if s == d or not (0 <= s < world and 0 <= d < world):
            raise ValueError(f"bad copy pair ({s}, {d}) for a group of {world} ranks")
    handles: list[Handle] = []
    received: torch.Tensor | None = None
    src_of_me = next((s for s, d in pairs if d == me), None)
    if src_of_me is not None:
        received = torch.empty(vec.numel(), dtype=vec.dtype)
        handles.append(
            group.recv(received, src_of_me, edge_tag(exchange, src_of_me, me, world), async_op=True)
        )
    outgoing = [d for s, d in pairs if s == me]
    if outgoing:
        flat = _flat(vec, f"rank {me}'s vector")
        for d in outgoing:
            handles.append(group.send(flat, d, edge_tag(exchange, me, d, world), async_op=True))
    _wait(handles)
    if received is not None:
        _check_received(received, src_of_me if src_of_me is not None else -1)
    return received


def consensus_distance_group(
    group: Group,
    vec: torch.Tensor,
    *,
    kind: str = "rms",
    reference: torch.Tensor | None = None,
    contribute: bool = True,
) -> float:
    """The same value as :func:`consensus_distance` over the contributing ranks' ``vec``, on
    every rank.

    ``kind="rms"`` costs one all-reduce of ``numel + 2`` float64s; ``kind="mean"`` one of
    ``numel + 1`` float64s plus one scalar all-reduce. ``reference`` (identical on every rank)
    only improves the accuracy of the RMS form. A rank with ``contribute=False`` (a joiner whose
    model is stale) takes part in the collectives but is left out of the average and the
    distance; its ``vec`` only gives the size.

    Raises ``ValueError`` for a non-finite contributing ``vec`` before anything is sent and when
    no rank contributed; :class:`~isthmus.comm.group.CollectiveError` if a collective fails.
    """
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
    if contribute:
        x = _flat64(vec, f"rank {group.rank}'s vector")
    else:
        x = torch.zeros(vec.numel(), dtype=torch.float64)
    one = 1.0 if contribute else 0.0
    if kind == "mean":
        total = torch.empty(x.numel() + 1, dtype=torch.float64)
        total[:-1] = x
        total[-1] = one
        group.all_reduce(total, "sum")
        n = _count(total[-1])
        d = torch.linalg.vector_norm(x - total[:-1] / n).reshape(1) * one
        group.all_reduce(d, "sum")
        return float(d[0]) / n
    y = x
    if reference is not None:
        ref = _flat64(reference, "reference")
        if ref.numel() != x.numel():
            raise ValueError(f"reference has {ref.numel()} elements, vector has {x.numel()}")
        y = (x - ref) * one
    payload = torch.empty(y.numel() + 2, dtype=torch.float64)
    payload[:-2] = y
    payload[-2] = torch.dot(y, y)
    payload[-1] = one
    group.all_reduce(payload, "sum")
    n = _count(payload[-1])
    ybar = payload[:-2] / n
    # clamp: rounding can push a tiny true value below zero
    sq = float(payload[-2]) / n - float(torch.dot(ybar, ybar))
    return max(sq, 0.0) ** 0.5
