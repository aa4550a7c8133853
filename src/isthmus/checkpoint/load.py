"""Loading: the latest complete checkpoint, verified, into a run of any number of peers.

The shared state is *consolidated* on load: every part is read, whichever peer wrote it, so a
checkpoint written by 3 peers resumes on 1, 2 or 5. Every tensor is checked against the
manifest's hash before anything is overwritten. A checkpoint whose part is truncated or corrupted
is skipped with a warning naming the tensor, and the previous complete one is used; a checkpoint
of another model (a tensor missing, or of another shape or dtype) is refused with the tensor's
name, because falling back would only find the same mismatch.

Local state (inner optimizer, error feedback, RNG) belongs to a peer *slot* (``peer1``). A slot
the checkpoint has no local state for (a run resumed on more peers) starts its local state as a
joiner does: a fresh inner optimizer and empty error feedback, its parameters from the shared
state. That is the rule because the shared state is the only state every peer agrees on;
borrowing another slot's inner optimizer would give two peers the same moments for different data.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from isthmus.checkpoint.manifest import Manifest
from isthmus.checkpoint.store import CheckpointStore, StorageError
from isthmus.comm.state import tensor_hash

__all__ = [
    "CheckpointCorrupt",
    "CheckpointMismatch",
    "NoCheckpoint",
    "load_latest",
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


def _check_schema(m: Manifest, state: Mapping[str, torch.Tensor], where: str) -> None:
    saved = {str(n): (tuple(shape), str(dtype)) for n, shape, dtype in m.schema}
    for n, t in state.items():
        if n not in saved:
            raise CheckpointMismatch(f"{where}: tensor {n!r} of this run is not in the checkpoint")
        shape, dtype = saved[n]
        if shape != tuple(t.shape) or dtype != str(t.dtype):
            raise CheckpointMismatch(
                f"{where}: tensor {n!r} is {list(shape)} {dtype} in the checkpoint but "
                f"{list(t.shape)} {t.dtype} in this run"
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
    Raises :class:`CheckpointCorrupt` naming the first tensor that fails."""
    d = store.dirname(m.revision)
    out: dict[str, torch.Tensor] = {}
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
