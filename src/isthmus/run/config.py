"""The run's typed config, under the runner's name: everything here is :mod:`isthmus.runconfig`
(which sits below the lab, so a scenario file can be read into a :class:`RunConfig`)."""

from __future__ import annotations

from isthmus import runconfig
from isthmus.runconfig import *  # noqa: F403

__all__ = runconfig.__all__
