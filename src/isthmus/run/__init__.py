"""The one way to start and describe a run: :class:`RunConfig`, the launcher behind
``isthmus run``, ``isthmus demo`` and ``isthmus lab run``, the built-in peer job, and the run
record (:class:`RunDir`, :class:`Summary`). See docs/ARCHITECTURE.md."""

from isthmus.run.config import RunConfig, apply_overrides, from_flat
from isthmus.run.record import PeerResult, RunDir, Summary

__all__ = ["PeerResult", "RunConfig", "RunDir", "Summary", "apply_overrides", "from_flat"]
