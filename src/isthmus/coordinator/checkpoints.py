"""The coordinator's book of checkpoints: which parts of which checkpoint are written, and the
latest complete one. Pure (no sockets, no clock of its own), like :mod:`.membership`.

A checkpoint of revision R is written by the members of the round that produced R: each writes
a disjoint part of the shared state (and its own local state) and reports it with the hashes of
the tensors it wrote. The report that completes the set is answered with every part's hashes and
the instruction to write the manifest; that peer writes it (atomically) and reports it, and only
then is the checkpoint *complete* and the latest. A checkpoint whose writer dies before its part
or its manifest is written never becomes complete; the previous complete one stays the latest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["CheckpointBook", "PartReport"]


@dataclass(frozen=True)
class PartReport:
    """One peer's part of the checkpoint of ``revision``: written ``ok`` (with its tensors'
    hashes and bytes) or failed (``error``)."""

    revision: int
    part: int
    parts: int
    ok: bool
    hashes: dict[str, str] = field(default_factory=dict)
    nbytes: int = 0
    writer: str = ""
    local: str = ""
    """The peer slot whose local state this writer saved too ("" if none)."""
    error: str = ""


@dataclass
class _Pending:
    parts: int
    started: float
    done: dict[int, PartReport] = field(default_factory=dict)
    manifest_asked: bool = False
    failed: str = ""


class CheckpointBook:
    """Parts in progress per revision, the latest complete checkpoint, and counters."""

    def __init__(self, url: str | None = None, keep_pending: int = 4) -> None:
        self.url = url
        self.pending: dict[int, _Pending] = {}
        self.latest: dict[str, Any] | None = None
        self.written = 0
        self.failures = 0
        self.keep_pending = keep_pending

    def part(self, report: PartReport, now: float) -> dict[str, Any]:
        """Record one part. The answer says whether the checkpoint is now fully written and, to
        exactly one reporter, ``write_manifest`` with every part's hashes and writers."""
        p = self.pending.get(report.revision)
        if p is None:
            p = self.pending[report.revision] = _Pending(report.parts, now)
            for old in sorted(self.pending)[: -self.keep_pending]:
                del self.pending[old]  # abandoned attempts (a writer died) are not kept forever
        if not report.ok:
            p.failed = report.error or "a part failed"
            self.failures += 1
            return {"complete": False, "failed": p.failed}
        p.done[report.part] = report
        complete = not p.failed and len(p.done) == p.parts
        if complete and not p.manifest_asked:
            p.manifest_asked = True
            hashes: dict[str, str] = {}
            for r in p.done.values():
                hashes.update(r.hashes)
            return {
                "complete": True,
                "write_manifest": True,
                "hashes": hashes,
                "writers": {str(k): r.writer for k, r in sorted(p.done.items())},
                "bytes": {str(k): r.nbytes for k, r in sorted(p.done.items())},
                "local": sorted({r.local for r in p.done.values() if r.local}),
            }
        return {"complete": complete, "write_manifest": False}

    def manifest(self, revision: int, path: str, now: float) -> None:
        """The manifest of ``revision`` is durably written at ``path``: it is the latest."""
        self.pending.pop(revision, None)
        if self.latest is None or revision >= int(self.latest["revision"]):
            self.latest = {"revision": revision, "path": path, "t": now}
        self.written += 1

    def status(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "latest": self.latest,
            "written": self.written,
            "failures": self.failures,
            "in_progress": sorted(self.pending),
        }
