"""``isthmus checkpoint inspect`` and ``export``: look into a checkpoint, take the model out.

:func:`inspect` reads a checkpoint's manifest, the size of every part and (``verify=True``) the
hash of every tensor. :func:`export` writes the model's state dict, consolidated from the parts,
as one safetensors file that plain torch loads without isthmus (``safetensors.torch.load_file``,
then ``model.load_state_dict``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from isthmus.checkpoint.load import CheckpointCorrupt, NoCheckpoint, load_shared, read_manifest
from isthmus.checkpoint.store import CheckpointStore

__all__ = ["export", "inspect", "templates"]


def _pick(store: CheckpointStore, revision: int | None) -> int:
    revisions = store.revisions()
    if not revisions:
        raise NoCheckpoint(f"no complete checkpoint at {store.url!r}")
    if revision is None:
        return revisions[-1]
    if revision not in revisions:
        raise NoCheckpoint(
            f"no complete checkpoint of revision {revision} at {store.url!r} (there are "
            f"{', '.join(map(str, revisions))})"
        )
    return revision


def templates(schema: list[list[Any]]) -> dict[str, torch.Tensor]:
    """Empty tensors shaped like a manifest's schema, to load a checkpoint into."""
    return {
        str(n): torch.empty(tuple(shape), dtype=getattr(torch, str(dtype).removeprefix("torch.")))
        for n, shape, dtype in schema
    }


def inspect(url: str, *, revision: int | None = None, verify: bool = True) -> dict[str, Any]:
    """What a checkpoint holds: its manifest, the bytes of each part, and with ``verify`` whether
    every tensor matches its hash (``verified``: True, or the error naming the first that fails).
    Lists the complete and incomplete checkpoints at ``url`` too."""
    store = CheckpointStore(url)
    rev = _pick(store, revision)
    m = read_manifest(store, rev)
    out: dict[str, Any] = {
        "url": url,
        "checkpoints": store.revisions(),
        "incomplete": store.incomplete(),
        "revision": rev,
        "manifest": {k: v for k, v in m.__dict__.items() if k not in ("schema", "hashes")},
        "tensors": len(m.schema),
        "state_bytes": sum(
            int(torch.Size(shape).numel())
            * torch.empty(0, dtype=getattr(torch, str(dt).removeprefix("torch."))).element_size()
            for _, shape, dt in m.schema
        ),
        "sizes": store.size(rev),
    }
    if verify:
        try:
            load_shared(store, m, templates(m.schema))
            out["verified"] = True
        except CheckpointCorrupt as e:
            out["verified"] = str(e)
    return out


def export(url: str, out: str | Path, *, revision: int | None = None) -> dict[str, Any]:
    """Write the model's state dict of a checkpoint to the safetensors file ``out``.

    Keys are the model's own state_dict keys (tied weights appear under each of their names).
    Raises :class:`NoCheckpoint` or :class:`CheckpointCorrupt` (naming the tensor) if the
    checkpoint cannot be read or verified; nothing is written then."""
    from safetensors.torch import save_file

    store = CheckpointStore(url)
    rev = _pick(store, revision)
    m = read_manifest(store, rev)
    shared = load_shared(store, m, templates(m.schema))
    if m.model_keys:
        tensors = {key: shared[name].clone().contiguous() for key, name in m.model_keys.items()}
    else:  # a strategy that did not name the model's keys: the whole shared state, as saved
        tensors = {name: t.contiguous() for name, t in shared.items()}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"isthmus_revision": str(rev), "strategy": m.strategy})
    tmp.replace(out)
    return {
        "revision": rev,
        "tensors": len(tensors),
        "path": str(out),
        "model_keys": bool(m.model_keys),
    }
