"""Byte corpora for the tiny GPT, with deterministic sharding across a changing set of peers.

The default corpus is the Python standard library's own ``.py`` source: real text, present on
every machine that runs isthmus, written by nobody on this project. It is read in sorted
relative-path order and split into a training and an evaluation part *per file*, by a stable
hash of the file's relative path (xxhash64, never Python's salted ``hash()``), so every process
that reads the same files builds exactly the same corpus.

Which files are read (see :func:`stdlib_files`): every ``*.py`` under
``sysconfig.get_paths()["stdlib"]`` except directories named ``site-packages``,
``dist-packages``, ``__pycache__``, ``test``, ``tests`` or ``idle_test`` (the test suites hold
deliberately odd encodings and generated data, not ordinary source), ``encodings`` (1.4 MB of
machine-generated code-page tables, mostly hex literals, which would fill a third of the default
4 MB), the ``config-*`` build directory and ``_sysconfigdata*.py`` (both are generated at build
time and carry the build machine's paths, so two machines with the same Python version would
otherwise disagree).

Different Python versions (and distributions that patch the stdlib) ship different files, so
**all peers of a run must use the same corpus**: ship a file and use :meth:`Corpus.from_file`, or
run the same Python build everywhere. :attr:`Corpus.fingerprint` (xxhash64 of the split bytes)
is what peers compare to detect a mismatch before training.

Sharding (:meth:`Corpus.batch`) is a pure function of ``(rank, world)``: when membership changes,
each peer simply recomputes its shard from its new rank and world size, so reassignment needs no
coordination. Two layouts:

* ``"interleaved"``: the training bytes are cut into fixed chunks (4 KiB by default) dealt
  round-robin to ranks; every rank sees a little of every module, close to IID data.
* ``"contiguous"``: rank ``k`` gets the ``k``-th contiguous ``1/world`` of the file-ordered stream,
  so peers train on different modules: a deliberately non-IID split for experiments.

Batches are drawn with a private ``torch.Generator`` seeded from a stable mix of
``(seed, step, rank, world)``: the global RNG is never read or advanced.
"""

from __future__ import annotations

import math
import os
import struct
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import torch
import xxhash

__all__ = ["SHARD_MODES", "Corpus", "evaluate", "stdlib_files"]

SHARD_MODES = ("interleaved", "contiguous")

# Directory names never descended into when reading the stdlib (see the module docstring).
_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "encodings"}
)
_U64 = (1 << 64) - 1


def _check_int(name: str, value: object, *, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _mix(tag: bytes, *parts: int) -> int:
    """A stable 64-bit seed from non-negative ints (the same in every process and version)."""
    return xxhash.xxh64_intdigest(tag + struct.pack(f"<{len(parts)}Q", *parts))


def _to_tensor(data: bytes | bytearray) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    # frombuffer needs a writable buffer to avoid a warning; the copy also decouples the tensor
    # from whatever the caller does with ``data`` afterwards.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def stdlib_files(root: str | os.PathLike[str] | None = None) -> list[str]:
    """Relative POSIX paths of the ``.py`` files :meth:`Corpus.from_stdlib` reads, sorted.

    ``root`` defaults to ``sysconfig.get_paths()["stdlib"]``. Raises ``FileNotFoundError`` if the
    root is not a directory."""
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise FileNotFoundError(f"stdlib directory {str(base)!r} does not exist")
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(base):
        # Pruning in place stops os.walk from descending into skipped directories.
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("config-")]
        rel_dir = Path(dirpath).relative_to(base)
        for name in filenames:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                found.append((rel_dir / name).as_posix())
    return sorted(found)


class _Model(Protocol):
    training: bool

    def __call__(
        self, idx: torch.Tensor, targets: torch.Tensor | None = ...
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def train(self, mode: bool = ...) -> object: ...

    def parameters(self) -> Iterable[torch.Tensor]: ...


class Corpus:
    """Training and evaluation bytes (``uint8`` tensors) plus the names of the pieces they came
    from, in order. Build one with :meth:`from_stdlib`, :meth:`from_file` or :meth:`from_bytes`.

    The split is per piece (a file for the stdlib, a fixed-size slice for a single blob): a piece
    goes to evaluation when ``xxhash64(name, seed) / 2**64 < eval_fraction``. If that leaves the
    evaluation part empty while ``eval_fraction > 0``, the piece with the smallest hash is moved
    there, so small corpora still get an evaluation split.
    """

    def __init__(
        self,
        *,
        train_data: torch.Tensor,
        eval_data: torch.Tensor,
        train_sources: Sequence[str] = (),
        eval_sources: Sequence[str] = (),
    ) -> None:
        for name, t in (("train_data", train_data), ("eval_data", eval_data)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
                raise ValueError(f"Corpus {name} must be a 1-D uint8 tensor")
        if train_data.numel() == 0:
            raise ValueError(
                "Corpus has no training bytes; give it more data or lower eval_fraction"
            )
        self.train_data = train_data.contiguous()
        self.eval_data = eval_data.contiguous()
        self.train_sources = tuple(train_sources)
        self.eval_sources = tuple(eval_sources)
        self._fingerprint: str | None = None
        self._segment_cache: dict[tuple[int, int, str, int], tuple[torch.Tensor, torch.Tensor]] = {}

    # ----------------------------------------------------------------------------- construction

    @classmethod
    def from_pieces(
        cls,
        pieces: Iterable[tuple[str, bytes]],
        *,
        eval_fraction: float = 0.05,
        seed: int = 0,
    ) -> Corpus:
        """Split named pieces into train/eval by the stable hash of each name (see the class
        docstring). Raises ``ValueError`` on a bad ``eval_fraction`` or ``seed``, on duplicate
        names, or if the split cannot give both parts a piece (fewer than two pieces with
        ``eval_fraction > 0``)."""
        if not isinstance(eval_fraction, (int, float)) or not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction!r}")
        _check_int("seed", seed, minimum=0)
        items = list(pieces)
        names = [n for n, _ in items]
        if len(set(names)) != len(names):
            raise ValueError("piece names must be unique: the split is keyed by name")
        # u in [0, 1): where this piece's name falls; seed & _U64 because xxhash wants 64 bits.
        u = [xxhash.xxh64_intdigest(n.encode("utf-8"), seed=seed & _U64) / 2.0**64 for n in names]
        is_eval = [x < eval_fraction for x in u]
        if eval_fraction > 0 and not any(is_eval):
            if len(items) < 2:
                raise ValueError(
                    "cannot split a single piece into train and eval; give more data or "
                    "set eval_fraction=0"
                )
            is_eval[min(range(len(items)), key=u.__getitem__)] = True
        if all(is_eval):
            raise ValueError(
                "every piece landed in the eval split; lower eval_fraction or give more data"
            )
        train = bytearray()
        evals = bytearray()
        for (_, data), ev in zip(items, is_eval, strict=True):
            (evals if ev else train).extend(data)
        return cls(
            train_data=_to_tensor(train),
            eval_data=_to_tensor(evals),
            train_sources=[n for n, ev in zip(names, is_eval, strict=True) if not ev],
            eval_sources=[n for n, ev in zip(names, is_eval, strict=True) if ev],
        )

    @classmethod
    def from_stdlib(
        cls,
        *,
        max_bytes: int | None = 4_000_000,
        eval_fraction: float = 0.05,
        seed: int = 0,
        root: str | os.PathLike[str] | None = None,
    ) -> Corpus:
        """The Python standard library's ``.py`` files (see the module docstring for which), in
        sorted relative-path order, stopping at ``max_bytes`` in total (the last file read is cut
        there; ``None`` reads everything). ``root`` overrides the stdlib directory.

        The result depends on the Python build: compare :attr:`fingerprint` across peers.
        Raises ``FileNotFoundError`` if the directory is missing and ``ValueError`` on bad
        arguments or if no file was found."""
        if max_bytes is not None:
            _check_int("max_bytes", max_bytes, minimum=1)
        base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
        rels = stdlib_files(base)
        if not rels:
            raise ValueError(f"no .py files under {str(base)!r}")
        pieces: list[tuple[str, bytes]] = []
        total = 0
        for rel in rels:
            if max_bytes is not None and total >= max_bytes:
                break
            data = (base / rel).read_bytes()
            if max_bytes is not None:
                data = data[: max_bytes - total]
            if data:
                pieces.append((rel, data))
                total += len(data)
        return cls.from_pieces(pieces, eval_fraction=eval_fraction, seed=seed)

    @classmethod
    def from_bytes(
        cls,
        data: bytes | bytearray,
        *,
        max_bytes: int | None = None,
        eval_fraction: float = 0.05,
        seed: int = 0,
        piece_bytes: int | None = None,
    ) -> Corpus:
        """Any text as bytes, cut (after ``max_bytes``) into pieces of ``piece_bytes`` named by
        their index and split like files. ``piece_bytes`` defaults to ``len(data) // 64`` clamped
        to [256, 65536], so even small inputs give an evaluation split.

        Raises ``ValueError`` on empty data or bad arguments."""
        if not isinstance(data, (bytes, bytearray)):
            raise ValueError(f"data must be bytes, got {type(data).__name__}")
        if max_bytes is not None:
            _check_int("max_bytes", max_bytes, minimum=1)
            data = data[:max_bytes]
        if not data:
            raise ValueError("data is empty")
        if piece_bytes is None:
            piece_bytes = min(65536, max(256, len(data) // 64))
        _check_int("piece_bytes", piece_bytes, minimum=1)
        pieces = [
            (str(i), bytes(data[off : off + piece_bytes]))
            for i, off in enumerate(range(0, len(data), piece_bytes))
        ]
        return cls.from_pieces(pieces, eval_fraction=eval_fraction, seed=seed)

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike[str],
        *,
        max_bytes: int | None = None,
        eval_fraction: float = 0.05,
        seed: int = 0,
        piece_bytes: int | None = None,
    ) -> Corpus:
        """The bytes of one file, as :meth:`from_bytes`. Raises ``FileNotFoundError`` if it is
        missing and ``ValueError`` if it is empty."""
        p = Path(path)
        with p.open("rb") as f:
            data = (
                f.read()
                if max_bytes is None
                else f.read(_check_int("max_bytes", max_bytes, minimum=1))
            )
        return cls.from_bytes(data, eval_fraction=eval_fraction, seed=seed, piece_bytes=piece_bytes)

    # ----------------------------------------------------------------------------- identity

    @property
    def fingerprint(self) -> str:
        """xxhash64 (16 hex digits) of the training length, training bytes and evaluation bytes.
        Peers compare it to make sure they train on the same data."""
        if self._fingerprint is None:
            h = xxhash.xxh64()
            # The length makes the train/eval boundary part of the identity.
            h.update(struct.pack("<Q", self.train_data.numel()))
            h.update(self.train_data.numpy().tobytes())
            h.update(self.eval_data.numpy().tobytes())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def __repr__(self) -> str:
        return (
            f"Corpus(train={self.train_data.numel()} bytes from {len(self.train_sources)} pieces, "
            f"eval={self.eval_data.numel()} bytes from {len(self.eval_sources)} pieces, "
            f"fingerprint={self.fingerprint})"
        )

    # ----------------------------------------------------------------------------- sharding

    def shard_ranges(
        self, *, rank: int, world: int, shard: str = "interleaved", chunk_bytes: int = 4096
    ) -> list[tuple[int, int]]:
        """The ``[start, stop)`` byte ranges of the training split that belong to ``rank``.

        Over all ranks of one ``world`` the ranges are disjoint and cover the training split.
        Raises ``ValueError`` on a bad rank, world, shard mode or chunk size, or when some rank
        would get no bytes at all."""
        starts, lengths = self._segments(rank, world, shard, chunk_bytes)
        return [(s, s + n) for s, n in zip(starts.tolist(), lengths.tolist(), strict=True)]

    def _segments(
        self, rank: int, world: int, shard: str, chunk_bytes: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _check_int("world", world, minimum=1)
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world:
            raise ValueError(
                f"rank {rank!r} is out of range for world {world} (need 0 <= rank < world)"
            )
        if shard not in SHARD_MODES:
            raise ValueError(f"shard must be one of {SHARD_MODES}, got {shard!r}")
        _check_int("chunk_bytes", chunk_bytes, minimum=2)
        key = (rank, world, shard, chunk_bytes)
        cached = self._segment_cache.get(key)
        if cached is not None:
            return cached
        n = self.train_data.numel()
        if shard == "contiguous":
            lo, hi = rank * n // world, (rank + 1) * n // world
            if hi <= lo:
                raise ValueError(
                    f"the training split ({n} bytes) is too small for {world} contiguous shards"
                )
            starts = torch.tensor([lo], dtype=torch.int64)
            lengths = torch.tensor([hi - lo], dtype=torch.int64)
        else:
            n_chunks = math.ceil(n / chunk_bytes)
            if n_chunks < world:
                raise ValueError(
                    f"the training split has {n_chunks} chunks of {chunk_bytes} bytes, fewer than "
                    f"world={world}; lower chunk_bytes, use shard='contiguous' or add data"
                )
            starts = torch.arange(rank, n_chunks, world, dtype=torch.int64) * chunk_bytes
            lengths = torch.clamp(n - starts, max=chunk_bytes)
        self._segment_cache[key] = (starts, lengths)
        return starts, lengths

    def batch_starts(
        self,
        *,
        step: int,
        rank: int,
        world: int,
        batch_size: int,
        block_size: int,
        seed: int = 0,
        shard: str = "interleaved",
        chunk_bytes: int = 4096,
    ) -> torch.Tensor:
        """Start offsets (int64 ``[batch_size]``) into the training split of the windows
        :meth:`batch` returns. Each window of ``block_size + 1`` bytes lies inside one range of
        :meth:`shard_ranges`; windows are uniform over all such positions of the shard."""
        _check_int("step", step, minimum=0)
        _check_int("batch_size", batch_size, minimum=1)
        _check_int("block_size", block_size, minimum=1)
        _check_int("seed", seed, minimum=0)
        starts, lengths = self._segments(rank, world, shard, chunk_bytes)
        # A window holds block_size inputs plus one more target byte.
        counts = torch.clamp(lengths - block_size, min=0)
        total = int(counts.sum())
        if total == 0:
            raise ValueError(
                f"block_size {block_size} is too large for rank {rank}'s shard (world {world}, "
                f"shard={shard!r}): its longest range is {int(lengths.max())} bytes and a window "
                f"needs {block_size + 1}; lower block_size"
                + (", raise chunk_bytes" if shard == "interleaved" else "")
                + " or use fewer peers"
            )
        gen = torch.Generator(device="cpu")
        gen.manual_seed(_mix(b"isthmus.corpus.batch", seed & _U64, step, rank, world))
        u = torch.randint(0, total, (batch_size,), generator=gen, dtype=torch.int64)
        ends = torch.cumsum(counts, 0)
        seg = torch.searchsorted(ends, u, right=True)
        before = ends[seg] - counts[seg]
        return starts[seg] + (u - before)

    def batch(
        self,
        *,
        step: int,
        rank: int,
        world: int,
        batch_size: int,
        block_size: int,
        seed: int = 0,
        shard: str = "interleaved",
        chunk_bytes: int = 4096,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-byte targets, int64 ``[batch_size, block_size]`` each, drawn only from
        ``rank``'s shard of the training split (see :meth:`shard_ranges`).

        Deterministic in ``(seed, step, rank, world)`` (and the shard layout); the global RNG is
        not touched. When membership changes, call it with the new ``rank`` and ``world``: the
        shards are recomputed from those alone. Raises ``ValueError`` with what to change on an
        out-of-range rank, a negative step or seed, an unknown shard mode, or a ``block_size``
        that does not fit in the shard."""
        starts = self.batch_starts(
            step=step,
            rank=rank,
            world=world,
            batch_size=batch_size,
            block_size=block_size,
            seed=seed,
            shard=shard,
            chunk_bytes=chunk_bytes,
        )
        return self._windows(self.train_data, starts, block_size)

    def windows(self, starts: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-byte targets of the training windows starting at ``starts`` (int64
        offsets into the training split, each at most ``len(train_data) - block_size - 1``).
        Raises IndexError for a window that does not fit."""
        return self._windows(self.train_data, starts, block_size)

    @staticmethod
    def _windows(
        data: torch.Tensor, starts: torch.Tensor, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + torch.arange(block_size + 1, dtype=torch.int64)
        w = data[idx].to(torch.int64)
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    # ----------------------------------------------------------------------------- evaluation

    def eval_batches(
        self, *, batch_size: int, block_size: int, n_batches: int, seed: int = 0
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``n_batches`` fixed ``(x, y)`` batches from the evaluation split.

        The ``batch_size * n_batches`` windows are evenly spaced over the split (lower variance
        than random windows for the same cost), shifted by a phase derived from ``seed``, so the
        same arguments always give the same batches. Raises ``ValueError`` if the evaluation
        split is shorter than ``block_size + 1`` bytes (e.g. ``eval_fraction=0``)."""
        _check_int("batch_size", batch_size, minimum=1)
        _check_int("block_size", block_size, minimum=1)
        _check_int("n_batches", n_batches, minimum=1)
        _check_int("seed", seed, minimum=0)
        valid = self.eval_data.numel() - block_size
        if valid <= 0:
            raise ValueError(
                f"the evaluation split has {self.eval_data.numel()} bytes, too few for a window "
                f"of {block_size + 1}; build the corpus with a larger eval_fraction or more data"
            )
        n = batch_size * n_batches
        phase = (_mix(b"isthmus.corpus.eval", seed & _U64) >> 11) / 2.0**53
        # float64 positions are exact enough: any real corpus is far below 2**53 bytes.
        pos = torch.floor((torch.arange(n, dtype=torch.float64) + phase) * (valid / n))
        starts = pos.to(torch.int64).clamp_(0, valid - 1)
        return [
            self._windows(self.eval_data, starts[i * batch_size : (i + 1) * batch_size], block_size)
            for i in range(n_batches)
        ]


def evaluate(
    model: _Model,
    corpus: Corpus,
    *,
    batch_size: int = 16,
    block_size: int | None = None,
    n_batches: int = 8,
    seed: int = 0,
) -> float:
    """Mean next-byte cross entropy of ``model`` over :meth:`Corpus.eval_batches`.

    ``model(x, y)`` must return ``(logits, loss)``, as :class:`isthmus.models.GPT` does.
    ``block_size`` defaults to ``model.config.block_size``. Runs under ``torch.no_grad()`` in eval
    mode and restores the model's previous mode, even on error. Batches are moved to the device of
    the model's first parameter. A diverged model's NaN/Inf loss is returned as is (this is a
    local measurement, nothing is shared). Raises ``ValueError`` if no block size can be found
    or the model returns no loss.
    """
    if block_size is None:
        config = getattr(model, "config", None)
        block_size = getattr(config, "block_size", None)
        if not isinstance(block_size, int):
            raise ValueError("pass block_size: the model has no config.block_size")
    batches = corpus.eval_batches(
        batch_size=batch_size, block_size=block_size, n_batches=n_batches, seed=seed
    )
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    was_training = model.training
    model.train(False)
    try:
        total = 0.0
        with torch.no_grad():
            for x, y in batches:
                _, loss = model(x.to(device), y.to(device))
                if loss is None:
                    raise ValueError("model(x, y) returned no loss; it must return (logits, loss)")
                total += float(loss)
        # Every batch has the same shape, so the mean of batch means is the mean over tokens.
        return total / len(batches)
    finally:
        model.train(was_training)
