"""Checkpoints for a strategy configured through its session: what ``SessionConfig(resume=...)``
and ``SessionConfig(checkpoint_dir=..., checkpoint_every=...)`` do, for the built-in job and a
user's own loop alike (:class:`isthmus.strategies.Strategy` calls these once it is built).

The strategy is taken by what it offers (``local_state``, ``load_local_state``, ``model_keys``,
``name``, ``config``), so this layer imports nothing above it.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Protocol

from isthmus.checkpoint.island import IslandCheckpointer, island_local_key, local_tree, merge_local
from isthmus.checkpoint.load import load_latest
from isthmus.checkpoint.save import Checkpointer, slot_of

__all__ = ["checkpointer_for", "restore_shared", "resume_from"]

log = logging.getLogger("isthmus.checkpoint")


class _Strategy(Protocol):
    name: str
    config: Any

    def local_state(self) -> dict[str, Any]: ...

    def load_local_state(self, state: Any) -> None: ...

    def model_keys(self) -> dict[str, str]: ...


def resume_from(session: Any, strategy: _Strategy, url: str, upto: int | None = None) -> int:
    """Load the latest complete checkpoint at ``url`` (of revision ``upto`` or older, when
    given) into the session's shared state and this peer slot's local state (if the checkpoint
    has it), before the first round; returns its revision, which becomes the session's.

    Until the first round says otherwise the peer assumes the membership that wrote the
    checkpoint (ranks follow peer names), so the first batch it draws is the one the run would
    have drawn next and a resume on the same peers is invisible. Raises what
    :func:`~isthmus.checkpoint.load.load_latest` raises (no checkpoint, another model's, an
    unreadable location); nothing is changed then.
    """
    name = session.name
    island = getattr(session, "island", None)
    template = strategy.local_state()
    if island is None:
        manifest, local = load_latest(
            url, session.state, slot=slot_of(name), local_template=template, upto=upto
        )
    else:  # each rank its own local state, as its DTensors' shards
        key = island_local_key(slot_of(name), island.rank, island.size)
        manifest, local = load_latest(
            url, session.state, slot=key, local_template=local_tree(template), upto=upto
        )
        local = None if local is None else merge_local(template, local)
        # the island's ranks step together: all of them take their local state, or none does
        if not all(island.gather(local is not None)):
            local = None
    if local is not None:
        strategy.load_local_state(local)
    session.revision = manifest.revision
    slots = sorted({slot_of(k) for k in manifest.local})
    if slot_of(name) in slots:
        session.rank, session.world = slots.index(slot_of(name)), len(slots)
    log.info("%s resumed from revision %d of %s", name, manifest.revision, url)
    return manifest.revision


def restore_shared(session: Any, url: str, revision: int) -> int:
    """Load the shared state of checkpoint ``revision`` at ``url`` (or an older one, if that
    one fails to verify) into a session that has been running: what a peer does when the
    coordinator answers ``restore``. Local state is not touched (the coordinator makes this
    peer's next round drop its work instead). Returns the revision loaded; raises what
    :func:`~isthmus.checkpoint.load.load_latest` raises, changing nothing then."""
    manifest, _ = load_latest(url, session.state, upto=revision)
    log.warning(
        "%s restored the shared state of checkpoint %d at %s", session.name, manifest.revision, url
    )
    return manifest.revision


def checkpointer_for(session: Any, strategy: _Strategy) -> Checkpointer | None:
    """The checkpointer the session's config asks for, or None without ``checkpoint_dir``."""
    cfg = session.config
    if not cfg.checkpoint_dir:
        return None
    options = strategy.config
    if dataclasses.is_dataclass(options) and not isinstance(options, type):
        options = {
            f.name: getattr(options, f.name)
            for f in dataclasses.fields(options)
            if f.init and isinstance(getattr(options, f.name), (int, float, str, bool, type(None)))
        }
    # the shared tensors only rounds write (the strategy names them, and waits for the copy,
    # Checkpointer.settle, before each of its rounds) are copied by the writer thread
    named = getattr(strategy, "round_written_shared", None)
    # likewise the local tensors only its optimizer's step writes (it settles before each step)
    stepped = getattr(strategy, "step_written_local", None)
    kind = Checkpointer if getattr(session, "island", None) is None else IslandCheckpointer
    ck = kind(
        session,
        cfg.checkpoint_dir,
        # 0: only at the end of the run (the strategy's finish() forces one)
        every=cfg.checkpoint_every or 1 << 62,
        keep=cfg.checkpoint_keep,
        local_state=strategy.local_state,
        strategy=strategy.name,
        strategy_config=options if isinstance(options, dict) else {},
        model_keys=strategy.model_keys(),
        background_shared=set(named()) if named is not None else (),
    )
    if stepped is not None:
        ck.background_local = stepped(ck.settle)
    return ck
