"""The coordinator's web side: a live dashboard at ``/`` and ``/metrics`` for Prometheus.

:class:`Dashboard` adds the routes to the coordinator's server; :class:`RunView` keeps the
run's recent history; the page itself is ``static/`` (plain HTML, CSS and JavaScript, no
library, no network access beyond this coordinator).
"""

from isthmus.coordinator.web.app import Dashboard
from isthmus.coordinator.web.view import RunView

__all__ = ["Dashboard", "RunView"]
