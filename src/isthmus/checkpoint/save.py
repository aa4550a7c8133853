"""Saving: every peer of a round writes a disjoint part of the shared state, in the background.

:class:`Checkpointer` is called between training steps (:meth:`Checkpointer.maybe_save`). Every
``every`` committed rounds it takes a *snapshot* (a copy of its part of the shared state and of
its own local state: the only cost the training thread pays) and writes it with
torch.distributed.checkpoint on a background thread. The members of the round that produced the
revision split the shared tensors by bytes (:func:`~isthmus.checkpoint.manifest.assign_parts`),
so each peer writes about 1/N of the state. Each reports its part to the coordinator with the
hashes of what it wrote; the report that completes the set is told to write the manifest, which
makes the checkpoint complete (:mod:`isthmus.coordinator.checkpoints`). Only the last ``keep``
complete checkpoints are kept.

The copies go into staging buffers kept from one save to the next (:mod:`.staging`), so a steady
run allocates them once. The shared tensors named in ``background_shared`` are copied by the
background thread instead: the strategy declares that only its rounds write them (when a round
begins: repairs, restores; when one commits: its result), and calls :meth:`Checkpointer.settle`,
which waits for that copy, before each of its rounds. Likewise the local tensors
``background_local`` picks (an inner optimizer's state and the parameters it steps: only its
``step()`` writes them, and the strategy settles before it); a mapping that held only such
tensors at the last save is handed over whole, unwalked (:class:`~.staging.Staging`). Other
shared tensors (an elastic sampler's position moves at every step) and the rest of the local
state (floating buffers: a forward pass writes them; the RNG state, counters) are copied on the
training thread. The writer thread is started, and what it writes with imported, when the
checkpointer is built; the split into parts is computed again only when the shared state or
the membership changed; hashing, writing, fsync and the manifest all run on the writer thread.

A rank of an island (a peer of several local ranks) writes its own shards instead, with no
gather: :class:`~isthmus.checkpoint.island.IslandCheckpointer`.

On failure: a part that cannot be written (disk full, permission, an unreachable store) is
logged and counted (:attr:`Checkpointer.failures`); training goes on and the previous complete
checkpoint stays the latest. A peer that dies mid-save leaves a directory without a manifest,
which is never listed and is removed by a later save.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol

import torch

from isthmus.checkpoint.manifest import Manifest, assign_parts
from isthmus.checkpoint.staging import Staging
from isthmus.checkpoint.store import CheckpointStore
from isthmus.checkpoint.write_wait import WriteWait
from isthmus.checkpoint.writer import BackgroundWriter, Job
from isthmus.comm.state import SharedState, tensor_hash
from isthmus.version import __version__

__all__ = ["STALL_PARTS", "Checkpointer", "slot_of"]

log = logging.getLogger("isthmus.checkpoint")

STALL_PARTS = ("wait_write", "assign", "shared", "local_state", "local", "hand_over", "settle")
"""What the training thread's time in a checkpoint is split into: waiting for the previous
write, finding this peer's part, copying the shared tensors copied at once, calling the
strategy's ``local_state``, copying the local state (deferred tensors are only recorded),
handing the write to the writer thread, and waiting in :meth:`Checkpointer.settle` for the
background copies."""


class _Session(Protocol):
    state: SharedState
    revision: int
    rank: int
    world: int
    name: str
    run_id: str

    def report_checkpoint(self, body: dict[str, Any]) -> dict[str, Any]: ...


def slot_of(name: str) -> str:
    """The peer slot a process name belongs to: ``peer1.2`` (a restart) -> ``peer1``."""
    return name.split(".", 1)[0]


class Checkpointer:
    """Periodic, asynchronous checkpoints of one peer's share (see the module docstring).

    ``local_state`` returns this peer's local state (a nested dict of tensors and plain values:
    inner optimizer state, error-feedback residuals, RNG states) or None; ``meta`` fills the
    manifest (strategy, its config, the model's state_dict keys). Raises
    :class:`~isthmus.checkpoint.store.StorageError` at once if the location cannot be created.
    """

    def __init__(
        self,
        session: _Session,
        url: str,
        *,
        every: int,
        keep: int = 3,
        local_state: Callable[[], dict[str, Any] | None] | None = None,
        strategy: str = "",
        strategy_config: Mapping[str, Any] | None = None,
        model_keys: Mapping[str, str] | None = None,
        background_shared: Collection[str] = (),
        background_local: Callable[[tuple[Any, ...]], bool] | None = None,
    ) -> None:
        if every < 1 or keep < 1:
            raise ValueError(f"every and keep must be >= 1, got {every} and {keep}")
        self.session = session
        self.store = CheckpointStore(url, create=True)
        self.every = every
        self.keep = keep
        self.local_state = local_state
        self.strategy = strategy
        self.strategy_config = dict(strategy_config or {})
        self.model_keys = dict(model_keys or {})
        self.written = 0
        """Parts this peer wrote."""
        self.manifests = 0
        """Checkpoints this peer completed (wrote the manifest of)."""
        self.failures = 0
        self.stall_s = 0.0
        """Time the training thread spent in :meth:`maybe_save` (snapshots, waiting for a write
        still running) and in :meth:`settle`."""
        self.stall_split = dict.fromkeys(STALL_PARTS, 0.0)
        """:attr:`stall_s` by part (:data:`STALL_PARTS`; they add up to it)."""
        self.last_revision = session.revision
        self.background_shared = frozenset(background_shared)
        """Shared tensors copied on the writer thread (the strategy must call :meth:`settle`
        before a round can write them)."""
        # the writer's imports now, not on its thread during the first save (store.py: why)
        self.store.prepare()
        self._background = BackgroundWriter()  # one thread kept between saves (writer.py: why)
        # started now, so that the first checkpoint does not wait for a thread to start
        self._background.start()
        self._split: tuple[Any, list[list[str]]] | None = None  # the last split, by its key
        self._job: Job | None = None  # the write in progress, or the last one
        self._shared_staging = Staging()
        self._background_staging = Staging()
        self._local_staging = Staging()
        self.background_local = background_local
        """Which tensors of the local state (by their path of keys) are copied on the writer
        thread (whatever writes them must call :meth:`settle` first)."""
        self._copied: threading.Event | None = None  # set once the background copies are done
        # the write in progress: its revision, and how many of its steps are done (copied,
        # each part saved, reported, the manifest): what wait_progressing watches with its bytes
        self._writing: int | None = None
        self._steps = 0

    def due(self) -> bool:
        r = self.session.revision
        return r > self.last_revision and r % self.every == 0

    def maybe_save(self, *, force: bool = False) -> bool:
        """Snapshot and start writing if a checkpoint is due (or, with ``force``, if this revision
        is not saved yet: the end of a run); True if one was started. Every member of the round
        must call it at the same revision, or that checkpoint never completes."""
        r = self.session.revision
        if not (self.due() or (force and r > self.last_revision)):
            return False
        clock = time.perf_counter
        t0 = clock()
        self.wait()  # one write at a time: a slow store costs a stall, never unbounded memory
        t1 = clock()
        s = self.session
        revision = s.revision
        rank, parts, names = self._assignment()
        later = {n: s.state[n] for n in names if n in self.background_shared}
        at_once = {n: s.state[n] for n in names if n not in self.background_shared}
        t2 = clock()
        snapshot = self._shared_staging.copy(at_once)
        t3 = clock()
        local = self.local_state() if self.local_state is not None else None
        t4 = clock()
        local = self._local_staging.copy(local, self.background_local) if local else None
        t5 = clock()
        copied = threading.Event()
        if not later and not self._local_staging.pending:
            copied.set()
        self._copied = copied
        self.last_revision = revision
        self._writing = revision
        self._job = self._background.submit(
            self._copy_and_write, revision, rank, parts, names, snapshot, later, local, copied
        )
        t6 = clock()  # handing the write over is the training thread's too
        split = self.stall_split
        for part, dt in (
            ("wait_write", t1 - t0),
            ("assign", t2 - t1),
            ("shared", t3 - t2),
            ("local_state", t4 - t3),
            ("local", t5 - t4),
            ("hand_over", t6 - t5),
        ):
            split[part] += dt
        self.stall_s += t6 - t0
        return True

    def _assignment(self) -> tuple[int, list[list[str]], list[str]]:
        """This writer's part number, every part's tensors, and the tensors it snapshots: the
        round's members split the shared tensors by bytes, one part each."""
        s = self.session
        sizes = {n: t.numel() * t.element_size() for n, t in s.state.items()}
        parts = self._parts(sizes, s.world)
        return s.rank, parts, parts[s.rank]

    def _parts(self, sizes: dict[str, int], world: int) -> list[list[str]]:
        """:func:`assign_parts` of ``sizes`` among ``world`` writers, computed again only when
        the sizes or the world changed since the last save (the lists are shared between
        saves: nobody changes them)."""
        key = (world, tuple(sizes.items()))
        if self._split is None or self._split[0] != key:
            self._split = (key, assign_parts(sizes, world))
        return self._split[1]

    def _stored(self, snapshot: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What is written for a part's snapshot (here: the tensors as they are)."""
        return snapshot

    def _part_hashes(self, rank: int, snapshot: dict[str, torch.Tensor]) -> dict[str, str]:
        """The ``hashes`` of a part's report: the xxh3 of every tensor written."""
        return {n: tensor_hash(t) for n, t in snapshot.items()}

    def _writer(self) -> str:
        """Who wrote a part, as the manifest names it (here: the peer's name)."""
        return str(self.session.name)

    def _local_key(self) -> str:
        """The name under which this process's local state is saved (``local-<key>``)."""
        return slot_of(self.session.name)

    def settle(self) -> None:
        """Return once the background copies of the snapshot being taken are done (at once when
        there are none). A strategy that names ``background_shared`` or ``background_local``
        calls it before anything writes those tensors (its rounds, its optimizer's step)."""
        copied = self._copied
        if copied is not None and not copied.is_set():
            t0 = time.perf_counter()
            copied.wait()
            dt = time.perf_counter() - t0
            self.stall_s += dt
            self.stall_split["settle"] += dt

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the write in progress (bounded by ``timeout`` if given)."""
        if self._job is not None:
            self._job.wait(timeout)

    def progress_mark(self) -> tuple[int, int]:
        """What changes while the write in progress advances: the writer's steps done and, on
        the local file system, the bytes its revision's files hold so far (-1 where they
        cannot be listed; 0 on other stores, where a file shows only once it is complete)."""
        steps, revision = self._steps, self._writing
        if revision is None or not self.store.local:
            return steps, 0
        try:
            return steps, sum(self.store.size(revision).values())
        except OSError:  # not created yet, or being replaced: no bytes to count
            return steps, -1

    def wait_progressing(
        self,
        *,
        idle_s: float,
        limit_s: float,
        unseen_min_s: float = 0.0,
        poll_s: float = 1.0,
    ) -> bool:
        """Wait for the write in progress while it progresses (:meth:`progress_mark` changes);
        True once it ended (or when none runs). It is given up, with a warning, once the mark
        has not changed for ``idle_s``, or after ``limit_s`` in any case: then this returns
        False, the write goes on in the background, and the checkpoint before it stays the
        last complete one. Where the store cannot show a file's bytes before the file is
        complete (anything but the local file system), the wait lasts at least
        ``unseen_min_s``. A pause that adds no bytes (the final flush to disk) counts as no
        progress too. The mark is sampled every ``poll_s``."""
        t = self._job
        if t is None or t.done:
            return True
        min_s = 0.0 if self.store.local else min(unseen_min_s, limit_s)
        w = WriteWait(time.monotonic(), idle_s=idle_s, limit_s=limit_s, min_s=min_s)
        w.observe(w.started, self.progress_mark())
        while True:
            if t.wait(poll_s):
                return True
            now = time.monotonic()
            w.observe(now, self.progress_mark())
            why = w.give_up(now)
            if why is not None:
                log.warning(
                    "checkpoint of revision %s: %s; not waiting for it (the one before it stays "
                    "the last complete checkpoint)",
                    self._writing,
                    why,
                )
                return False

    def _copy_and_write(
        self,
        revision: int,
        rank: int,
        parts: list[list[str]],
        names: list[str],
        snapshot: dict[str, torch.Tensor],
        later: dict[str, torch.Tensor],
        local: dict[str, Any] | None,
        copied: threading.Event,
    ) -> None:
        try:
            if later:
                later = self._background_staging.copy(later)
                snapshot = {n: (later[n] if n in later else snapshot[n]) for n in names}
            self._local_staging.finish()
        except Exception as e:  # as a failed write: counted, reported, training goes on
            self.failures += 1
            log.warning("checkpoint of revision %d: copying part %d failed: %s", revision, rank, e)
            return
        finally:
            copied.set()  # never leave the training thread waiting, even if the copy failed
        self._steps += 1
        self._write(revision, rank, parts, snapshot, local)

    def _write(
        self,
        revision: int,
        rank: int,
        parts: list[list[str]],
        snapshot: dict[str, torch.Tensor],
        local: dict[str, Any] | None,
    ) -> None:
        s, store = self.session, self.store
        d = store.dirname(revision)
        slot = self._local_key()
        try:
            store.unseal(revision)  # a revision this run wrote before it went back to an older one
            if snapshot:
                store.save(self._stored(snapshot), d, f"shared-{rank}")
                self._steps += 1
            if local:
                store.save(local, d, f"local-{slot}")
                self._steps += 1
            faults = getattr(s, "faults", None)
            if faults is not None:  # tests: a peer that dies with its part written, unreported
                faults.check("checkpoint", round=revision)
            answer = s.report_checkpoint(
                {
                    "revision": revision,
                    "part": rank,
                    "parts": len(parts),
                    "ok": True,
                    "hashes": self._part_hashes(rank, snapshot),
                    "bytes": sum(t.numel() * t.element_size() for t in snapshot.values()),
                    "writer": self._writer(),
                    "local": slot if local else "",
                }
            )
            self.written += 1
            self._steps += 1
            if answer.get("write_manifest"):
                self._finish(revision, parts, answer)
        except Exception as e:  # a save never stops training; the last complete one stays
            self.failures += 1
            log.warning("checkpoint of revision %d: writing part %d failed: %s", revision, rank, e)
            with contextlib.suppress(Exception):
                s.report_checkpoint(
                    {
                        "revision": revision,
                        "part": rank,
                        "parts": len(parts),
                        "ok": False,
                        "error": str(e)[:500],
                    }
                )

    def _finish(self, revision: int, parts: list[list[str]], answer: dict[str, Any]) -> None:
        s, store = self.session, self.store
        manifest = self._manifest(revision, parts, answer)
        path = store.path(store.dirname(revision), "manifest.json")
        store.write_atomic(path, manifest.to_bytes())
        # the root, so that the coordinator can restart the run from it (RestorePoint)
        s.report_checkpoint({"revision": revision, "manifest": path, "url": store.url})
        self.manifests += 1
        self._prune(revision)

    def _manifest(self, revision: int, parts: list[list[str]], answer: dict[str, Any]) -> Manifest:
        """The manifest of a checkpoint whose every part was reported (``answer``: the
        coordinator's merge of the reports)."""
        s = self.session
        return Manifest(
            run_id=s.run_id,
            revision=revision,
            strategy=self.strategy,
            strategy_config=self.strategy_config,
            schema=[sp.to_json() for sp in s.state.schema()],
            hashes=dict(answer["hashes"]),
            parts=parts,
            writers=dict(answer.get("writers", {})),
            local=sorted(answer.get("local", [])),
            model_keys=self.model_keys,
            bytes=dict(answer.get("bytes", {})),
            isthmus_version=__version__,
        )

    def _prune(self, latest: int) -> None:
        """Keep the last ``keep`` complete checkpoints; drop incomplete ones older than the new
        latest (their writers died or failed)."""
        complete = self.store.revisions()
        for r in complete[: -self.keep]:
            self.store.remove(r)
        for r in self.store.incomplete():
            if r < latest:
                self.store.remove(r)

    def metrics(self) -> dict[str, Any]:
        return {
            "checkpoints_written": self.manifests,
            "checkpoint_parts_written": self.written,
            "checkpoint_failures": self.failures,
            "checkpoint_stall_s": round(self.stall_s, 4),
            "checkpoint_stall_split_s": {k: round(v, 6) for k, v in self.stall_split.items()},
        }
