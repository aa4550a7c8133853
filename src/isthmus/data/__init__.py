"""isthmus.data: token files, the elastic exactly-once sampler, and byte corpora.

* :class:`TokenDataset`: memory-mapped token files (nanoGPT's flat ``.bin`` format, or a
  directory of shards with ``meta.json``) cut into fixed next-token windows.
* :func:`prepare`: text files to that format (bytes, or a trained byte-level BPE).
* :class:`ElasticSampler`: splits each global batch among the current peers so that every
  sample of an epoch is used exactly once by a committed round, across kills, joins and aborts.
* :class:`Corpus`: byte corpora (the Python stdlib by default) with deterministic sharding.

data is part of the floor: it imports numpy and torch, and nothing of isthmus outside data. Never
imports coordinator, comm, reduce, testing, checkpoint, runconfig, strategies, lab, integrations, run or
cli(docs/ARCHITECTURE.md, "Layers"; tools/structure.py checks it).
"""

from isthmus.data.corpus import SHARD_MODES, Corpus, evaluate, stdlib_files
from isthmus.data.prepare import PrepareError, PrepareResult, prepare
from isthmus.data.sampler import ElasticSampler, LedgerOverflow
from isthmus.data.tokens import TokenDataError, TokenDataset

__all__ = [
    "SHARD_MODES",
    "Corpus",
    "ElasticSampler",
    "LedgerOverflow",
    "PrepareError",
    "PrepareResult",
    "TokenDataError",
    "TokenDataset",
    "evaluate",
    "prepare",
    "stdlib_files",
]
