"""Durable runs: checkpoints that outlive every peer, resumed on any number of peers.

Saving (:class:`Checkpointer`): the members of a round each write a disjoint part of the shared
state with torch.distributed.checkpoint, in the background; a manifest written last makes a
checkpoint complete. Loading (:func:`load_latest`): every part, consolidated and verified, into a
run of any size; a corrupted checkpoint falls back to the previous one. Tools: :func:`inspect`,
:func:`export` (a plain safetensors state dict). Storage: a directory or any fsspec URL.
Ideas from Universal Checkpointing (distributed representation for saving, consolidated for
loading, resume on any configuration). Islands (peers of several local ranks) write with every
rank, each its own flat shards (:mod:`isthmus.checkpoint.island`, :mod:`.shards`); the same
loader reads those on islands of any size and on single peers.

checkpoint may import reduce, comm (a round's members and their group), the coordinator and the
floor. Never imports runconfig, strategies, lab, integrations, run or cli: a strategy hands it the shared state
(docs/ARCHITECTURE.md, "Layers"; tools/structure.py checks it).
"""

from isthmus.checkpoint.inspect import export, inspect
from isthmus.checkpoint.load import (
    CheckpointCorrupt,
    CheckpointMismatch,
    NoCheckpoint,
    load_latest,
    read_manifest,
)
from isthmus.checkpoint.manifest import Manifest, assign_parts
from isthmus.checkpoint.save import Checkpointer, slot_of
from isthmus.checkpoint.store import CheckpointStore, StorageError

__all__ = [
    "CheckpointCorrupt",
    "CheckpointMismatch",
    "CheckpointStore",
    "Checkpointer",
    "Manifest",
    "NoCheckpoint",
    "StorageError",
    "assign_parts",
    "export",
    "inspect",
    "load_latest",
    "read_manifest",
    "slot_of",
]
