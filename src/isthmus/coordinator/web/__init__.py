"""The coordinator's web side: a live dashboard at ``/`` and ``/metrics`` for Prometheus.

:class:`Dashboard` adds the routes to the coordinator's server; :class:`RunView` keeps the
run's recent history; the page itself is ``static/`` (plain HTML, CSS and JavaScript, no
library, no network access beyond this coordinator).

web belongs to the coordinator's layer: it may import the rest of the coordinator and the floor.
Never imports comm, reduce, testing, checkpoint, runconfig, strategies, lab, integrations, run or
cli(docs/ARCHITECTURE.md, "Layers"; tools/structure.py checks it).
"""

from isthmus.coordinator.web.app import Dashboard
from isthmus.coordinator.web.view import RunView

__all__ = ["Dashboard", "RunView"]
