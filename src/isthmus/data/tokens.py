"""Token files on disk, memory-mapped, cut into fixed next-token windows.

The format is the one nanoGPT writes: a flat ``.bin`` file holding a raw little-endian array of
``uint16`` or ``uint32`` token ids, with no header. A dataset is one such file, or a directory of
such *shards* read as one stream in sorted name order. :func:`isthmus.data.prepare` writes a
directory of shards plus a ``meta.json`` (format below); when a directory holds one, it is the
authority on the dtype, the vocabulary size, the tokenizer and each shard's token count, so a
shard that was cut short or replaced is caught before training instead of being read as garbage.

A lone ``.bin`` needs its dtype from the caller (``dtype=``) or from a sidecar JSON file next to
it (``train.bin.json`` or ``train.json``, holding at least ``{"dtype": "uint16"}`` and optionally
``"vocab_size"``); nanoGPT's own files are uint16. A single shard of a prepared directory is
described by that directory's ``meta.json``.

Samples are fixed windows of ``block_size + 1`` tokens that overlap by one token: sample ``i`` is
tokens ``[i * block_size, i * block_size + block_size + 1)``, split into inputs ``x`` (the first
``block_size``) and next-token targets ``y`` (the last ``block_size``). ``len(dataset)`` counts the
whole windows; a trailing partial window is never returned. Windows may cross shard boundaries.

Nothing is read up front: shards are opened with :class:`numpy.memmap` (read-only) and only the
windows asked for are paged in. The one exception is the id check (``verify=True``, the default
when the vocabulary size is known), which reads every shard once in bounded chunks so that an
out-of-range id fails here, with the file and offset, rather than as an index error deep inside
an embedding on some peer hours later.

``meta.json`` (written by ``prepare``)::

    {"format": "isthmus-tokens", "version": 1, "dtype": "uint16", "vocab_size": 256,
     "tokenizer": "bytes", "tokenizer_file": null, "eot_id": null,
     "splits": {"train": [{"file": "train_000000.bin", "tokens": 1234}], "val": [...]}}
"""

from __future__ import annotations

import bisect
import json
import operator
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, SupportsIndex

import numpy as np
import torch

__all__ = [
    "DTYPES",
    "META_FORMAT",
    "META_NAME",
    "ShardInfo",
    "TokenDataError",
    "TokenDataset",
    "TokenMeta",
    "dtype_for_vocab",
]

META_NAME = "meta.json"
META_FORMAT = "isthmus-tokens"
# Explicitly little-endian: the files are raw arrays, and nanoGPT writes them on little-endian
# machines with numpy's native order.
DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
# Tokens per chunk when scanning ids: 2^24 tokens is 32-64 MiB of pages touched at a time.
_VERIFY_CHUNK = 1 << 24


class TokenDataError(ValueError):
    """Token data on disk that cannot be used as given; the message names the file and the fix."""


def _dtype_name(dtype: object, where: str) -> str:
    """Normalize ``"uint16"``, ``np.uint16`` or ``np.dtype("<u2")`` to a key of :data:`DTYPES`."""
    try:
        dt = np.dtype(dtype)  # type: ignore[call-overload]
    except TypeError as e:
        raise TokenDataError(f"{where}: unknown dtype {dtype!r}; use 'uint16' or 'uint32'") from e
    for name, known in DTYPES.items():
        if dt.kind == known.kind and dt.itemsize == known.itemsize:
            if dt.byteorder == ">":
                raise TokenDataError(
                    f"{where}: dtype {dtype!r} is big-endian; token files are little-endian"
                )
            return name
    raise TokenDataError(f"{where}: dtype {dtype!r} is not supported; use 'uint16' or 'uint32'")


def dtype_for_vocab(vocab_size: int) -> str:
    """The smallest supported dtype that holds ids ``0 .. vocab_size - 1``.

    Raises TokenDataError if ``vocab_size`` is below 1 or above 2^32.
    """
    if vocab_size < 1 or vocab_size > 1 << 32:
        raise TokenDataError(f"vocab_size must be in [1, 2^32], got {vocab_size}")
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _check_vocab(vocab_size: int, dtype: str, where: str) -> None:
    capacity = int(np.iinfo(DTYPES[dtype]).max) + 1
    if vocab_size > capacity:
        raise TokenDataError(
            f"{where}: vocab_size {vocab_size} does not fit in {dtype} (at most {capacity} ids): "
            f"the ids were written in a wider type or the vocabulary is wrong; re-run "
            f"`isthmus data prepare` (it picks uint32 above {1 << 16}) or fix the vocab_size"
        )
    if vocab_size < 1:
        raise TokenDataError(f"{where}: vocab_size must be >= 1, got {vocab_size}")


@dataclass(frozen=True)
class ShardInfo:
    """One shard listed in ``meta.json``: its file name (relative to the directory) and size."""

    file: str
    tokens: int

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "tokens": self.tokens}


@dataclass(frozen=True)
class TokenMeta:
    """The contents of a token directory's ``meta.json``."""

    dtype: str
    vocab_size: int
    tokenizer: str
    splits: dict[str, tuple[ShardInfo, ...]]
    tokenizer_file: str | None = None
    eot_id: int | None = None
    """Id of the end-of-text token placed between documents, if the tokenizer has one."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Informational fields (sources, counts) that readers may ignore."""

    def to_json(self) -> dict[str, Any]:
        return {
            "format": META_FORMAT,
            "version": 1,
            "dtype": self.dtype,
            "vocab_size": self.vocab_size,
            "tokenizer": self.tokenizer,
            "tokenizer_file": self.tokenizer_file,
            "eot_id": self.eot_id,
            "splits": {k: [s.to_json() for s in v] for k, v in self.splits.items()},
            **self.extra,
        }

    @staticmethod
    def read(path: Path) -> TokenMeta:
        """Parse ``path``. Raises TokenDataError naming the file for unreadable JSON, another
        format, or a missing or mistyped field."""
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TokenDataError(
                f"{path}: cannot read it ({e}); re-run `isthmus data prepare`"
            ) from e
        if not isinstance(raw, dict) or raw.get("format") != META_FORMAT:
            raise TokenDataError(
                f"{path}: not an isthmus token directory's meta.json (no "
                f'"format": "{META_FORMAT}"); move it away or re-run `isthmus data prepare`'
            )
        try:
            dtype = _dtype_name(raw["dtype"], str(path))
            splits = {
                str(name): tuple(ShardInfo(str(s["file"]), int(s["tokens"])) for s in shards)
                for name, shards in dict(raw["splits"]).items()
            }
            known = {"format", "version", "dtype", "vocab_size", "tokenizer", "splits"}
            known |= {"tokenizer_file", "eot_id"}
            return TokenMeta(
                dtype=dtype,
                vocab_size=int(raw["vocab_size"]),
                tokenizer=str(raw.get("tokenizer", "unknown")),
                splits=splits,
                tokenizer_file=raw.get("tokenizer_file"),
                eot_id=None if raw.get("eot_id") is None else int(raw["eot_id"]),
                extra={k: v for k, v in raw.items() if k not in known},
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, TokenDataError):
                raise
            raise TokenDataError(
                f"{path}: malformed field ({type(e).__name__}: {e}); re-run `isthmus data prepare`"
            ) from e

    def write(self, path: Path) -> None:
        """Write atomically (a temporary file renamed into place), so a reader never sees half."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        os.replace(tmp, path)


def _sidecar(path: Path) -> Path | None:
    for cand in (path.with_name(path.name + ".json"), path.with_suffix(".json")):
        if cand != path and cand.is_file():
            return cand
    return None


class TokenDataset:
    """Fixed next-token windows over memory-mapped token files.

    ``path`` is a ``.bin`` file or a directory of shards. ``split`` picks a directory's shards:
    with a ``meta.json``, the named split (default ``"train"``); without one, the files named
    ``{split}.bin`` or ``{split}_*.bin`` (default: every ``*.bin``, unless both ``train*`` and
    ``val*`` files are present, which is an error asking for ``split``). ``dtype`` and
    ``vocab_size`` are needed only where no ``meta.json`` or sidecar gives them, and must agree
    with it otherwise.

    ``ds[i]`` is ``(x, y)``, two int64 tensors of shape ``(block_size,)``; ``ds.batch(indices)``
    stacks windows into ``(len(indices), block_size)``.

    On failure (all raised here, before training, as :class:`TokenDataError` naming the file and
    what to do, except a missing path, which raises FileNotFoundError): a directory with no
    shards; a shard whose byte size is not a multiple of the dtype's (truncated) or differs from
    ``meta.json``'s count; an empty shard; a ``vocab_size`` the dtype cannot hold (e.g. 70000
    with uint16); a token id ``>= vocab_size`` (found by one chunked scan; ``verify=False`` skips
    it); fewer than ``block_size + 1`` tokens in all. Without a known ``vocab_size`` ids are not
    checked.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        block_size: int,
        *,
        split: str | None = None,
        dtype: str | np.dtype[Any] | type | None = None,
        vocab_size: int | None = None,
        verify: bool = True,
    ) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self.path = Path(path)
        self.block_size = block_size
        self.split = split
        self.meta: TokenMeta | None = None
        self.meta_path: Path | None = None
        """The ``meta.json`` that described the data, if one did."""
        if not self.path.exists():
            raise FileNotFoundError(
                f"token data {str(self.path)!r} does not exist: give a .bin file or a directory "
                f"written by `isthmus data prepare`"
            )
        arg_dtype = None if dtype is None else _dtype_name(dtype, "dtype argument")
        if self.path.is_dir():
            files, meta_dtype, meta_vocab, counts = self._from_directory(arg_dtype)
        else:
            files, meta_dtype, meta_vocab, counts = self._from_file(arg_dtype)
        source = str(self.meta_path or self.path)
        if arg_dtype is not None and meta_dtype is not None and arg_dtype != meta_dtype:
            raise TokenDataError(
                f"{source} says dtype {meta_dtype} but dtype={arg_dtype} was passed: drop the "
                f"argument (the file is the authority) or fix the file"
            )
        resolved = meta_dtype or arg_dtype
        if resolved is None:
            raise TokenDataError(
                f"{self.path}: the token dtype is unknown: pass dtype='uint16' or 'uint32' "
                f"(nanoGPT writes uint16), or write a sidecar {self.path.name}.json with "
                f'{{"dtype": "uint16"}}'
            )
        if vocab_size is not None and meta_vocab is not None and vocab_size != meta_vocab:
            raise TokenDataError(
                f"{source} says vocab_size {meta_vocab} but vocab_size={vocab_size} was passed: "
                f"drop the argument or fix the file"
            )
        self.dtype: str = resolved
        self.vocab_size: int | None = meta_vocab if meta_vocab is not None else vocab_size
        if self.vocab_size is not None:
            _check_vocab(self.vocab_size, self.dtype, source)
        self.shards: tuple[Path, ...] = tuple(files)
        self._np_dtype = DTYPES[self.dtype]
        self._sizes = [
            self._shard_tokens(f, counts[i] if counts else None) for i, f in enumerate(files)
        ]
        self._offsets = [0]
        for n in self._sizes:
            self._offsets.append(self._offsets[-1] + n)
        self.num_tokens = self._offsets[-1]
        if self.num_tokens < block_size + 1:
            raise TokenDataError(
                f"{self.path}: {self.num_tokens} tokens cannot fill one window of block_size "
                f"{block_size} (it needs {block_size + 1} tokens: inputs plus the next-token "
                f"target); use a smaller block_size or more text"
            )
        self._maps: list[np.memmap[Any, Any]] | None = None
        if verify and self.vocab_size is not None:
            self.check_ids()

    # -- locating shards -----------------------------------------------------------------------
    def _from_directory(
        self, arg_dtype: str | None
    ) -> tuple[list[Path], str | None, int | None, list[int] | None]:
        meta_path = self.path / META_NAME
        if meta_path.is_file():
            self.meta = meta = TokenMeta.read(meta_path)
            self.meta_path = meta_path
            name = self.split or "train"
            if name not in meta.splits:
                raise TokenDataError(
                    f"{meta_path} has no split {name!r} (it has {sorted(meta.splits)}): pass "
                    f"split= one of those"
                )
            infos = meta.splits[name]
            if not infos:
                raise TokenDataError(
                    f"{meta_path}: split {name!r} has no shards (prepare wrote none, e.g. "
                    f"eval_fraction=0 for 'val'); use another split or re-run prepare"
                )
            files = [self.path / s.file for s in infos]
            for f in files:
                if not f.is_file():
                    raise TokenDataError(
                        f"{f} is listed in {meta_path} but missing: copy the whole directory "
                        f"or re-run `isthmus data prepare`"
                    )
            return files, meta.dtype, meta.vocab_size, [s.tokens for s in infos]
        bins = sorted(p for p in self.path.glob("*.bin") if p.is_file())
        if self.split is not None:
            bins = [p for p in bins if p.stem == self.split or p.name.startswith(self.split + "_")]
        elif any(p.name.startswith("train") for p in bins) and any(
            p.name.startswith("val") for p in bins
        ):
            raise TokenDataError(
                f"{self.path} holds both train* and val* shards and no meta.json: pass "
                f"split='train' or split='val' so they are not read as one stream"
            )
        if not bins:
            what = f" for split {self.split!r}" if self.split else ""
            raise TokenDataError(
                f"{self.path}: no .bin token files{what}: write them with "
                f"`isthmus data prepare TEXT... --out {self.path}` or point at the right directory"
            )
        return bins, None, None, None

    def _from_file(
        self, arg_dtype: str | None
    ) -> tuple[list[Path], str | None, int | None, list[int] | None]:
        side = _sidecar(self.path)
        parent_meta = self.path.parent / META_NAME
        if side is None and parent_meta.is_file():
            # One shard of a prepared directory: its meta.json knows the shard.
            meta = TokenMeta.read(parent_meta)
            for infos in meta.splits.values():
                for info in infos:
                    if info.file == self.path.name:
                        self.meta, self.meta_path = meta, parent_meta
                        return [self.path], meta.dtype, meta.vocab_size, [info.tokens]
        if side is None:
            return [self.path], None, None, None
        try:
            raw = json.loads(side.read_text())
            dt = _dtype_name(raw["dtype"], str(side)) if "dtype" in raw else None
            vocab = int(raw["vocab_size"]) if raw.get("vocab_size") is not None else None
        except TokenDataError:
            raise
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise TokenDataError(
                f"{side}: cannot read the sidecar ({type(e).__name__}: {e}); it should hold "
                f'{{"dtype": "uint16", "vocab_size": 50257}}'
            ) from e
        return [self.path], dt, vocab, None

    def _shard_tokens(self, f: Path, expected: int | None) -> int:
        size = f.stat().st_size
        item = self._np_dtype.itemsize
        if size == 0:
            raise TokenDataError(
                f"{f} is empty: a write was interrupted; delete it or re-run `isthmus data prepare`"
            )
        if size % item:
            raise TokenDataError(
                f"{f} is truncated: {size} bytes is not a multiple of {item} ({self.dtype}); the "
                f"file was cut short while being written or copied: copy it again or re-run "
                f"`isthmus data prepare`"
            )
        n = size // item
        if expected is not None and n != expected:
            raise TokenDataError(
                f"{f} holds {n} tokens but {self.meta_path} says {expected}: the shard was "
                f"truncated or replaced; copy the directory again or re-run `isthmus data prepare`"
            )
        return n

    # -- reading -------------------------------------------------------------------------------
    def _mapped(self) -> list[np.memmap[Any, Any]]:
        if self._maps is None:
            self._maps = [np.memmap(f, dtype=self._np_dtype, mode="r") for f in self.shards]
        return self._maps

    def __getstate__(self) -> dict[str, Any]:
        # Memory maps do not pickle as maps (they would be copied whole); DataLoader workers and
        # spawned processes reopen the files instead.
        state = dict(self.__dict__)
        state["_maps"] = None
        return state

    def check_ids(self) -> None:
        """Scan every shard once (in bounded chunks) for ids ``>= vocab_size``.

        Raises TokenDataError naming the file, the token offset and the id. Does nothing when
        the vocabulary size is unknown.
        """
        if self.vocab_size is None:
            return
        for f, m in zip(self.shards, self._mapped(), strict=True):
            for s in range(0, len(m), _VERIFY_CHUNK):
                chunk = m[s : s + _VERIFY_CHUNK]
                top = int(chunk.max())
                if top >= self.vocab_size:
                    at = s + int(np.argmax(chunk >= self.vocab_size))
                    raise TokenDataError(
                        f"{f}: token {at} has id {int(m[at])}, outside the vocabulary of "
                        f"{self.vocab_size}: the file was written with another tokenizer or is "
                        f"corrupt; re-run `isthmus data prepare` (or pass the right vocab_size)"
                    )

    def tokens(self, start: int, stop: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Tokens ``[start, stop)`` of the whole stream as int64 (a copy; may span shards).

        Raises IndexError outside ``[0, num_tokens]``.
        """
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"token range [{start}, {stop}) outside [0, {self.num_tokens})")
        maps = self._mapped()
        out = np.empty(stop - start, dtype=np.int64)
        i = bisect.bisect_right(self._offsets, start) - 1
        pos = start
        while pos < stop:
            base = self._offsets[i]
            end = min(stop, self._offsets[i + 1])
            out[pos - start : end - start] = maps[i][pos - base : end - base]
            pos = end
            i += 1
        return out

    def __len__(self) -> int:
        return (self.num_tokens - 1) // self.block_size

    def _window(self, i: SupportsIndex) -> np.ndarray[Any, np.dtype[np.int64]]:
        k = operator.index(i)
        n = len(self)
        if k < 0:
            k += n
        if not 0 <= k < n:
            raise IndexError(f"sample {operator.index(i)} out of range for {n} windows")
        s = k * self.block_size
        return self.tokens(s, s + self.block_size + 1)

    def __getitem__(self, i: SupportsIndex) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.from_numpy(self._window(i))
        return w[:-1], w[1:]

    def batch(
        self, indices: Iterable[SupportsIndex] | torch.Tensor | np.ndarray[Any, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stack windows ``indices`` into inputs and targets of shape ``(n, block_size)``.

        An empty ``indices`` gives two ``(0, block_size)`` tensors. Raises IndexError for an
        index out of range.
        """
        if isinstance(indices, torch.Tensor | np.ndarray):
            idx: Sequence[SupportsIndex] = [int(i) for i in indices.reshape(-1).tolist()]
        else:
            idx = list(indices)
        out = np.empty((len(idx), self.block_size + 1), dtype=np.int64)
        for row, i in enumerate(idx):
            out[row] = self._window(i)
        w = torch.from_numpy(out)
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    # -- description ---------------------------------------------------------------------------
    @property
    def tokenizer(self) -> str | None:
        """``"bytes"``, ``"bpe"`` (from ``meta.json``), or None when unknown."""
        return self.meta.tokenizer if self.meta else None

    @property
    def tokenizer_path(self) -> Path | None:
        """The saved Hugging Face tokenizer next to the shards, if ``prepare`` wrote one."""
        if self.meta is None or self.meta_path is None or not self.meta.tokenizer_file:
            return None
        return self.meta_path.parent / self.meta.tokenizer_file

    def shard_tokens(self) -> Mapping[Path, int]:
        """Token count per shard, in stream order."""
        return dict(zip(self.shards, self._sizes, strict=True))

    def __repr__(self) -> str:
        return (
            f"TokenDataset({str(self.path)!r}, block_size={self.block_size}, "
            f"shards={len(self.shards)}, tokens={self.num_tokens}, dtype={self.dtype}, "
            f"vocab_size={self.vocab_size}, samples={len(self)})"
        )
