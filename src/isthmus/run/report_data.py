"""A run directory's records, read once for the reports: :class:`LoadedRun` and :func:`load_run`.

Both :mod:`isthmus.run.report` (the plots, ``report.md``) and :mod:`isthmus.run.report_html`
(the self-contained pages) draw from a :class:`LoadedRun`; it lives here so that neither of them
imports the other's module to name it. Imports only the run record (:mod:`isthmus.run.record`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from isthmus.run.record import RunDir, Summary

__all__ = ["LoadedRun", "load_run"]


@dataclass
class LoadedRun:
    """A run directory's records, read once for plotting."""

    dir: Path
    metrics: list[dict[str, Any]]
    events: list[dict[str, Any]]
    links: list[dict[str, Any]]
    churn: list[dict[str, Any]]
    summary: Summary | None


def load_run(run_dir: str | Path) -> LoadedRun:
    """Read a run directory's records (its summary too, if it has one).

    Raises FileNotFoundError naming the directory if it holds no ``metrics.jsonl``.
    """
    d = RunDir(run_dir)
    if not (d.path / "metrics.jsonl").exists():
        raise FileNotFoundError(f"{d} is not a run directory (no metrics.jsonl)")
    return LoadedRun(
        dir=d.path,
        metrics=d.metrics(),
        events=d.events(),
        links=d.links(),
        churn=d.churn(),
        summary=d.summary() if d.summary_path.exists() else None,
    )
