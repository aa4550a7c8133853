"""The summary table the CLI prints after a run shows the run's isolations next to its resyncs."""

from __future__ import annotations

import pytest

from isthmus.cli.common import print_summary
from isthmus.run.record import Summary


def test_the_summary_table_prints_isolations(capsys: pytest.CaptureFixture[str]) -> None:
    print_summary(Summary(strategy="", isolations=3, resyncs=2, run_dir="runs/x"))
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "isolations" in line)
    assert "3" in row.split("isolations", 1)[1]
