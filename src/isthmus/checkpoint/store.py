"""Where checkpoints live: a local directory or any fsspec URL (``memory://``, ``s3://``, ...).

A checkpoint root holds one directory per checkpoint, named by the revision it saves
(``rev-00000042``); inside, one torch.distributed.checkpoint (DCP) directory per part of the
shared state (``shared-<rank>``), one per peer slot's local state (``local-<slot>``), and, written
last and atomically, ``manifest.json``. A directory without a manifest is incomplete (its writer
died, or a write failed) and is never listed.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from typing import Any

__all__ = ["CheckpointStore", "StorageError"]

_REV = re.compile(r"^rev-(\d{8,})$")
# DCP warns that it runs without a process group: that is the design (each peer writes its part)
_SINGLE_PROCESS = ".*assuming the intent is to (save|load) in a single process.*"


class StorageError(OSError):
    """The checkpoint location cannot be read or written (missing, unreadable, a bad URL)."""


class CheckpointStore:
    """One checkpoint root, through fsspec (a plain path is the local file system).

    Raises :class:`StorageError` naming the URL if fsspec cannot open it (an unknown protocol,
    a missing package for it)."""

    def __init__(self, url: str, *, create: bool = False) -> None:
        import fsspec

        self.url = str(url)
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url)
        except (ValueError, ImportError) as e:
            raise StorageError(f"cannot open checkpoint location {self.url!r}: {e}") from None
        self.root = self.root.rstrip("/") or "/"
        if create:
            try:
                self.fs.makedirs(self.root, exist_ok=True)
            except OSError as e:
                raise StorageError(
                    f"cannot create checkpoint directory {self.url!r}: {e}"
                ) from None
        elif not self.fs.exists(self.root):
            raise StorageError(f"no checkpoint directory at {self.url!r}")

    @property
    def local(self) -> bool:
        return getattr(self.fs, "protocol", None) in ("file", ("file", "local"))

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def url_of(self, *parts: str) -> str:
        """A URL DCP's fsspec reader and writer accept for ``parts`` under the root."""
        p = self.path(*parts)
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return p if protocol in ("file", "local") else f"{protocol}://{p.lstrip('/')}"

    @staticmethod
    def dirname(revision: int) -> str:
        return f"rev-{revision:08d}"

    def revisions(self) -> list[int]:
        """Revisions of the *complete* checkpoints (their manifest exists), oldest first."""
        out = []
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        for e in entries:
            m = _REV.match(e.rstrip("/").rsplit("/", 1)[-1])
            if m and self.fs.exists(self.path(m.group(0), "manifest.json")):
                out.append(int(m.group(1)))
        return sorted(out)

    def incomplete(self) -> list[int]:
        """Revisions of directories without a manifest."""
        out = []
        with contextlib.suppress(FileNotFoundError):
            for e in self.fs.ls(self.root, detail=False):
                m = _REV.match(e.rstrip("/").rsplit("/", 1)[-1])
                if m and not self.fs.exists(self.path(m.group(0), "manifest.json")):
                    out.append(int(m.group(1)))
        return sorted(out)

    def write_atomic(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` so that readers see all of it or nothing: a temporary name,
        flushed and fsynced where the file system allows, then renamed into place."""
        tmp = f"{path}.tmp-{os.getpid()}"
        with self.fs.open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            with contextlib.suppress(AttributeError, OSError, ValueError):
                os.fsync(f.fileno())
        self.fs.mv(tmp, path)
        if self.local:
            # the rename itself must survive a power cut: fsync the directory that holds it
            with contextlib.suppress(OSError):
                fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def read(self, path: str) -> bytes:
        with self.fs.open(path, "rb") as f:
            data: bytes = f.read()
        return data

    def unseal(self, revision: int) -> None:
        """Remove ``revision``'s manifest, if it has one, leaving its parts: before a revision is
        written again. That happens when a run went back to an older checkpoint (every peer
        died after writing a newer one the coordinator never heard of) and reached the revision
        anew; without this, a reader would take the old manifest over a mix of old and new
        parts until the new manifest replaces it."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(self.dirname(revision), "manifest.json"))

    def remove(self, revision: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(self.dirname(revision)), recursive=True)

    def size(self, revision: int) -> dict[str, int]:
        """Bytes of each part directory of a checkpoint."""
        out: dict[str, int] = {}
        base = self.path(self.dirname(revision))
        for e in self.fs.ls(base, detail=True):
            name = e["name"].rstrip("/").rsplit("/", 1)[-1]
            out[name] = int(self.fs.du(e["name"])) if e["type"] == "directory" else int(e["size"])
        return out

    @staticmethod
    def prepare() -> None:
        """Import what :meth:`save` writes with (torch.distributed.checkpoint: over a second of
        Python the first time), so that the first save does not: a checkpointer calls it when
        it is built, before training, instead of its writer thread holding the interpreter
        against the training thread while that import runs."""
        import torch.distributed.checkpoint  # noqa: F401
        from torch.distributed.checkpoint import _fsspec_filesystem  # noqa: F401

    def save(self, state: dict[str, Any], *parts: str) -> None:
        """Write ``state`` (a nested dict of tensors and plain values) as one DCP checkpoint
        under ``parts``, files synced. Runs in this process alone (no process group)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
            # DCP warns on every overwrite, even one asked for
            warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
            dcp.save(
                state,
                # overwrite: a revision written again (see unseal) replaces its old parts
                storage_writer=FsspecWriter(self.url_of(*parts), sync_files=True, overwrite=True),
                no_dist=True,
            )

    def load(self, state: dict[str, Any], *parts: str) -> None:
        """Fill ``state`` in place from the DCP checkpoint under ``parts`` (shapes, dtypes and
        structure as saved). Raises what DCP raises for a missing or damaged checkpoint."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
            dcp.load(state, storage_reader=FsspecReader(self.url_of(*parts)), no_dist=True)
