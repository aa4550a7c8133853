"""Loading: the latest complete checkpoint, verified, into a run of any number of peers.

The shared state is *consolidated* on load: every part is read, whichever peer wrote it, so a
checkpoint written by 3 peers resumes on 1, 2 or 5. Every tensor is checked against the
manifest's hash before anything is overwritten. A checkpoint whose part is truncated or corrupted
is skipped with a warning naming the tensor, and the previous complete one is used; a checkpoint
of another model (a tensor missing, or of another shape or dtype) is refused with the tensor's
name, because falling back would only find the same mismatch.

Checkpoints of islands hold flat shards (:mod:`isthmus.checkpoint.shards`): a reader takes the
elements it holds from whichever parts overlap them (:func:`load_ranges`), so an island of any
size, or a single peer, reads a checkpoint written by islands of any sizes, and an island
reads one written by single peers. Every piece is checked by its xxh3, and every tensor by its
layout hash (an island sums its ranks' shares), before anything is overwritten.

Local state (inner optimizer, error feedback, RNG) belongs to a peer *slot* (``peer1``). A slot
the checkpoint has no local state for (a run resumed on more peers) starts its local state as a
joiner does: a fresh inner optimizer and empty error feedback, its parameters from the shared
state. That is the rule because the shared state is the only state every peer agrees on;
borrowing another slot's inner optimizer would give two peers the same moments for different data.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from isthmus.checkpoint.manifest import Manifest
from isthmus.checkpoint.shards import reads, whole_shards
from isthmus.checkpoint.store import CheckpointStore, StorageError
from isthmus.comm.layout import hash_hex, layout_hash
from isthmus.comm.state import tensor_hash

__all__ = [
    "CheckpointCorrupt",
    "CheckpointMismatch",
    "NoCheckpoint",
    "load_latest",
    "load_ranges",
    "load_shared",
    "read_manifest",
]

log = logging.getLogger("isthmus.checkpoint")


class NoCheckpoint(StorageError):
    """The location holds no complete (usable) checkpoint."""


class CheckpointCorrupt(ValueError):
    """A part of a checkpoint does not match its manifest (truncated, corrupted)."""


class CheckpointMismatch(ValueError):
    """The checkpoint holds another model's state: names the first tensor that differs."""


def read_manifest(store: CheckpointStore, revision: int) -> Manifest:
    path = store.path(store.dirname(revision), "manifest.json")
    return Manifest.from_bytes(
        store.read(path), where=f"{store.url}/{store.dirname(revision)}/manifest.json"
    )


def _full_shape(state: Mapping[str, torch.Tensor], name: str) -> tuple[int, ...]:
    """The full shape of ``name`` (an island's state holds shards of it)."""
    full = getattr(state, "full_shape", None)
    return tuple(full(name)) if full is not None else tuple(state[name].shape)


def _check_schema(m: Manifest, state: Mapping[str, torch.Tensor], where: str) -> None:
    saved = {str(n): (tuple(shape), str(dtype)) for n, shape, dtype in m.schema}
    for n, t in state.items():
        if n not in saved:
            raise CheckpointMismatch(f"{where}: tensor {n!r} of this run is not in the checkpoint")
        shape, dtype = saved[n]
        full = _full_shape(state, n)
        if shape != full or dtype != str(t.dtype):
            raise CheckpointMismatch(
                f"{where}: tensor {n!r} is {list(shape)} {dtype} in the checkpoint but "
                f"{list(full)} {t.dtype} in this run"
            )
    extra = [n for n in saved if n not in state]
    if extra:
        raise CheckpointMismatch(
            f"{where}: tensor {extra[0]!r} of the checkpoint is not in this run"
        )


def load_shared(
    store: CheckpointStore, m: Manifest, templates: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Every shared tensor of checkpoint ``m`` (shaped like ``templates``), hash-verified.
    A checkpoint of islands is assembled from its shards (:func:`load_ranges`). Raises
    :class:`CheckpointCorrupt` naming the first tensor that fails."""
    if m.shards:
        wants = {n: (0, t.numel(), tuple(t.shape)) for n, t in templates.items()}
        flat = load_ranges(store, m, wants, {n: t.dtype for n, t in templates.items()})
        out = {n: flat[n].view(templates[n].shape) for n in templates}
        d = store.dirname(m.revision)
        for n, t in out.items():
            if hash_hex(layout_hash(t), tuple(t.shape), str(t.dtype)) != m.hashes.get(n):
                raise CheckpointCorrupt(
                    f"{store.url}/{d}: tensor {n!r} assembled from its shards does not match "
                    "its layout hash in the manifest"
                )
        return out
    d = store.dirname(m.revision)
    out = {}
    for k, names in enumerate(m.parts):
        if not names:
            continue
        part = {n: torch.empty_like(templates[n], device="cpu") for n in names}
        try:
            store.load(part, d, f"shared-{k}")
        except Exception as e:  # DCP raises many kinds for a damaged part: all mean unusable
            raise CheckpointCorrupt(f"{store.url}/{d}/shared-{k} cannot be read: {e}") from None
        for n, t in part.items():
            if tensor_hash(t) != m.hashes.get(n):
                raise CheckpointCorrupt(
                    f"{store.url}/{d}/shared-{k}: tensor {n!r} does not match its hash in the manifest"
                )
        out.update(part)
    return out


def load_ranges(
    store: CheckpointStore,
    m: Manifest,
    wants: Mapping[str, tuple[int, int, tuple[int, ...]]],
    dtypes: Mapping[str, torch.dtype],
) -> dict[str, torch.Tensor]:
    """Flat elements ``[start, stop)`` of each tensor in ``wants`` (name -> ``(start, stop,
    full shape)``), read from the parts that hold them, whichever peers or islands wrote them:
    the shards of a checkpoint of islands, or the whole tensors of one of single peers (read
    whole, then cut). Each piece read is checked against its xxh3 in the manifest first.
    Returns name -> a flat CPU tensor of ``stop - start`` elements. Raises
    :class:`CheckpointCorrupt` naming the part and tensor that cannot be read, does not match
    its hash, or that no part holds."""
    d = store.dirname(m.revision)
    if m.shards:
        shards = m.shards
    else:
        numels = {str(n): math.prod(shape) for n, shape, _ in m.schema}
        shards = whole_shards(m.parts, m.hashes, numels)
    plan: dict[int, list[tuple[str, int, int]]] = {}
    for n, (lo, hi, _shape) in wants.items():
        try:
            for p, s, e in reads(shards, n, lo, hi):
                plan.setdefault(p, []).append((n, s, e))
        except ValueError as e:
            raise CheckpointCorrupt(f"{store.url}/{d}: {e}") from None
    out = {n: torch.empty(hi - lo, dtype=dtypes[n]) for n, (lo, hi, _) in wants.items()}
    for p, pieces in sorted(plan.items()):
        part = {
            n: torch.empty((e - s,) if m.shards else wants[n][2], dtype=dtypes[n])
            for n, s, e in pieces
        }
        where = f"{store.url}/{d}/shared-{p}"
        try:
            store.load(part, d, f"shared-{p}")
        except Exception as e:  # DCP raises many kinds for a damaged part: all mean unusable
            raise CheckpointCorrupt(f"{where} cannot be read: {e}") from None
        for n, s, e in pieces:
            got = part[n]
            if tensor_hash(got) != shards[str(p)][n][2]:
                raise CheckpointCorrupt(
                    f"{where}: tensor {n!r} (elements [{s}, {e})) does not match its hash in "
                    "the manifest"
                )
            lo, hi, _ = wants[n]
            a, b = max(lo, s), min(hi, e)
            out[n][a - lo : b - lo] = got.reshape(-1)[a - s : b - s]
    return out


def _load_island(
    store: CheckpointStore, rev: int, state: Any, where: str
) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """This rank's part of checkpoint ``rev`` for an island's state (every rank of the island
    calls it together): each rank reads the manifest and the pieces that overlap what it holds,
    checks them by xxh3, and the island checks every full tensor's layout hash (summed over its
    ranks) against the manifest. The verdict is the island's: when any rank failed, every rank
    raises the same error (:class:`CheckpointMismatch` if a rank found another model's state,
    else :class:`CheckpointCorrupt`), so all of them go on, fall back to an older checkpoint or
    stop together."""
    island = state.island
    wants: dict[str, tuple[int, int, tuple[int, ...]]] = {}
    for n, t in state.items():
        p = state.placements[n]
        full = tuple(state.full_shape(n))
        wants[n] = (0, t.numel(), full) if p is None else (p.start, p.stop, full)
    error: tuple[str, str] | None = None
    loaded: dict[str, torch.Tensor] = {}
    try:
        m = read_manifest(store, rev)
        _check_schema(m, state, where)
        loaded = load_ranges(store, m, wants, {n: t.dtype for n, t in state.items()})
    except (ValueError, OSError) as e:  # CheckpointCorrupt and CheckpointMismatch among them
        error = (type(e).__name__, str(e))
    errors = [e for e in island.gather(error) if e]
    if errors:
        mismatch = [msg for kind, msg in errors if kind == CheckpointMismatch.__name__]
        if mismatch:
            raise CheckpointMismatch(mismatch[0])
        raise CheckpointCorrupt(errors[0][1])
    if m.hash_kind == "layout":
        mine = []
        for n, _t in state.items():
            p = state.placements[n]
            counts = p is not None or island.leader  # a replicated tensor counts once
            mine.append(layout_hash(loaded[n], p) if counts else 0)
        totals = island.sum_int64(torch.tensor(mine, dtype=torch.int64)).tolist()
        for (n, t), total in zip(state.items(), totals, strict=True):
            if hash_hex(total, state.full_shape(n), str(t.dtype)) != m.hashes.get(n):
                raise CheckpointCorrupt(
                    f"{where}: tensor {n!r} read by the island's ranks does not match its layout "
                    "hash in the manifest"
                )
    return m, {n: loaded[n].view(t.shape) for n, t in state.items()}


def load_latest(
    url: str,
    state: MutableMapping[str, torch.Tensor],
    *,
    slot: str | None = None,
    local_template: dict[str, Any] | None = None,
    upto: int | None = None,
) -> tuple[Manifest, dict[str, Any] | None]:
    """Load the newest usable complete checkpoint at ``url`` (of revision ``upto`` or older,
    when given) into ``state`` (in place), and the local state of ``slot`` into a copy of
    ``local_template`` (None if it has none or without a slot).

    Raises :class:`StorageError` for a missing or unreadable location, :class:`NoCheckpoint` if
    no complete checkpoint can be used, :class:`CheckpointMismatch` for another model's
    checkpoint. Nothing in ``state`` changes unless the whole shared state verified.
    """
    store = CheckpointStore(url)
    revisions = [r for r in store.revisions() if upto is None or r <= upto]
    if not revisions:
        at_most = "" if upto is None else f" of revision {upto} or older"
        raise NoCheckpoint(f"no complete checkpoint{at_most} at {url!r}")
    for rev in reversed(revisions):
        where = f"{url}/{store.dirname(rev)}"
        try:
            if getattr(state, "island", None) is not None:  # the island's ranks in lockstep
                m, loaded = _load_island(store, rev, state, where)
            else:
                m = read_manifest(store, rev)
                _check_schema(m, state, where)
                loaded = load_shared(store, m, state)
        except (CheckpointCorrupt, ValueError, OSError) as e:
            if isinstance(e, CheckpointMismatch):
                raise
            log.warning("checkpoint %s is unusable (%s); trying the previous one", where, e)
            continue
        for n, t in loaded.items():
            state[n].copy_(t)
        local = None
        if slot is not None and local_template is not None and slot in m.local:
            local = local_template
            try:
                store.load(local, store.dirname(rev), f"local-{slot}")
            except Exception as e:  # the shared state is what matters; the slot starts afresh
                log.warning(
                    "local state of %s in %s cannot be read (%s): starting it afresh",
                    slot,
                    where,
                    e,
                )
                local = None
        return m, local
    raise NoCheckpoint(
        f"no usable complete checkpoint at {url!r} (all {len(revisions)} failed to verify)"
    )
