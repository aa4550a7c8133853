"""report.html and compare.html: one file each, referencing nothing outside itself, with the
run's events on a timeline (joins, kills, aborts marked)."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from isthmus.cli import main as cli_main
from isthmus.run.report import compare_runs, plot_run

T0 = 1_800_000_000.0


def _fake_run(d: Path, strategy: str = "diloco") -> Path:
    """A small run directory as the launcher writes it: two peers, one killed and replaced."""
    d.mkdir(parents=True)
    metrics = []
    for peer, steps in (("peer0", range(20)), ("peer1", range(8)), ("peer2", range(12, 20))):
        for s in steps:
            metrics.append(
                {"peer": peer, "step": s, "ts": T0 + 1 + s * 0.1, "loss": 5 - s * 0.1,
                 "world": 2, "revision": s // 4, "bytes_sent": 1000 * s}
            )  # fmt: skip
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    events = [
        {"t": 0.5, "ts": T0 + 0.5, "kind": "register", "peer": 0, "name": "peer0"},
        {"t": 0.6, "ts": T0 + 0.6, "kind": "register", "peer": 1, "name": "peer1"},
        {"t": 0.7, "ts": T0 + 0.7, "kind": "epoch", "epoch": 1, "members": [0, 1], "world": 2},
        {"t": 1.4, "ts": T0 + 1.4, "kind": "commit", "round": 0, "epoch": 1, "world": 2},
        {"t": 1.8, "ts": T0 + 1.8, "kind": "dead", "peer": 1, "name": "peer1", "reason": "<gone>"},
        {"t": 1.8, "ts": T0 + 1.8, "kind": "abort", "round": 1, "epoch": 1, "reason": "peer 1 died"},
        {"t": 1.9, "ts": T0 + 1.9, "kind": "epoch", "epoch": 2, "members": [0], "world": 1},
        {"t": 2.2, "ts": T0 + 2.2, "kind": "register", "peer": 2, "name": "peer2"},
        {"t": 2.3, "ts": T0 + 2.3, "kind": "epoch", "epoch": 3, "members": [0, 2], "world": 2},
        {"t": 2.3, "ts": T0 + 2.3, "kind": "resync",
         "transfers": [{"src": 0, "dst": 2, "names": ["a", "b"]}]},
    ]  # fmt: skip
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    churn = [
        {"ts": T0 + 1.8, "action": "kill", "peer": 1, "name": "peer1"},
        {"ts": T0 + 2.0, "action": "join", "peer": 2, "name": "peer2"},
    ]
    (d / "churn.jsonl").write_text("".join(json.dumps(c) + "\n" for c in churn))
    summary = {"strategy": strategy, "rounds_committed": 5, "rounds_aborted": 1, "kills": 1}
    (d / "summary.json").write_text(json.dumps(summary))
    return d


class _Refs(HTMLParser):
    """Every attribute that could load something, and the tags seen."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[str] = []
        self.tags: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        self.refs += [v or "" for k, v in attrs if k in ("src", "href", "srcset", "data", "poster")]


def assert_self_contained(page: str) -> None:
    refs = _Refs()
    refs.feed(page)
    assert refs.refs, "no embedded image at all"
    assert all(r.startswith("data:image/png;base64,") for r in refs.refs), refs.refs
    assert not refs.tags & {"script", "link", "iframe", "object", "embed", "base"}, refs.tags
    without_data = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", page)
    assert "://" not in without_data and "url(" not in without_data
    assert "@import" not in without_data


def test_report_html_stands_alone_and_marks_joins_kills_and_aborts(tmp_path: Path) -> None:
    d = _fake_run(tmp_path / "run")
    written = plot_run(d)
    assert d / "report.html" in written and d / "report.md" in written
    page = (d / "report.html").read_text()
    assert_self_contained(page)
    assert page.count("<img") == len([p for p in written if p.suffix == ".png"])
    timeline = page[page.index("<svg") : page.index("</svg>")]
    for mark in ("join (registered)", "killed / evicted", "round aborted", "resync",
                 "launcher: kill", "launcher: join"):  # fmt: skip
        assert mark in timeline, mark
    assert "&lt;gone&gt;" in page and "<gone>" not in page  # event text is escaped
    assert "<td>abort</td>" in page and "<td>commit</td>" not in page  # commits are counted


def test_lab_report_and_compare_write_html(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = _fake_run(tmp_path / "a")
    b = _fake_run(tmp_path / "b", strategy="ddp")
    assert cli_main(["lab", "report", str(a)]) == 0
    assert str(a / "report.html") in capsys.readouterr().out
    assert cli_main(["lab", "report", str(tmp_path / "nothing")]) == 2
    written = compare_runs([a, b], tmp_path / "cmp")
    page = (tmp_path / "cmp" / "compare.html").read_text()
    assert tmp_path / "cmp" / "compare.html" in written
    assert_self_contained(page)
    assert page.count("<svg") == 2 and "<th>a<br>" in page and "<th>b<br>" in page
