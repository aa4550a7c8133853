"""Watching a real run from outside: ``/metrics`` scraped at the end of a run agrees with its
summary, the peers' TensorBoard event files hold what they logged, and the run's report.html
stands alone."""

from __future__ import annotations

import json
import math
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from isthmus.run.builtin_run import publish, run_builtin
from isthmus.run.config import from_flat
from isthmus.run.launch import Hook, Launcher
from isthmus.run.record import RunDir

try:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
except ImportError:  # the tensorboard extra is not installed
    EventAccumulator = None


class ScrapeAtTheEnd(Hook):
    """Reads /metrics once every peer has exited, before the coordinator stops."""

    def __init__(self) -> None:
        self.text = ""

    def stop(self, launcher: Launcher) -> None:
        req = urllib.request.Request(
            f"http://{launcher.address}/metrics",
            headers={"Authorization": f"Bearer {launcher.token}"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            self.text = r.read().decode()


def _samples(text: str) -> dict[str, list[Any]]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_metrics_match_the_summary_and_tensorboard_holds_the_logged_scalars(
    tmp_path: Path,
) -> None:
    if EventAccumulator is None:
        pytest.skip("the tensorboard package is not installed: pip install 'isthmus[tensorboard]'")
    tb = tmp_path / "tb"
    # a failed collective (an abort) and a flipped bit (a parity failure and its repair): every
    # counter moves
    cfg = from_flat(
        peers=3, steps=16, model="tiny", strategy="ddp", corpus_bytes=200_000, batch_size=4,
        fault={1: ["fail@collective:step=3", "corrupt@step:step=11"]},
        run_dir=str(tmp_path / "run"), progress=False, tensorboard=str(tb),
    )  # fmt: skip
    scrape = ScrapeAtTheEnd()
    summary, _, run_dir = run_builtin(cfg, hooks=[scrape])
    publish(summary, run_dir)
    s = json.loads(run_dir.summary_path.read_text())
    assert s["peers_final"] == 3, s

    m = _samples(scrape.text)
    for name in (
        "rounds_committed",
        "rounds_aborted",
        "parity_checks",
        "parity_failures",
        "resyncs",
    ):
        assert m[f"isthmus_{name}"][0].value == s[name], name
    assert s["rounds_aborted"] >= 1 and s["parity_failures"] >= 1 and s["resyncs"] >= 1, s
    by_op: dict[str, float] = {}
    for x in m["isthmus_peer_bytes_sent"]:
        by_op[x.labels["op"]] = by_op.get(x.labels["op"], 0) + x.value
    assert by_op == s["bytes_by_op"]
    assert sum(by_op.values()) == s["bytes_sent_total"]
    counts = {
        x.labels["outcome"]: x.value
        for x in m["isthmus_round_duration_seconds"]
        if x.name.endswith("_count")
    }
    # a round shorter than one turn of the coordinator's loop can finish unseen
    assert 0 < counts["committed"] <= s["rounds_committed"]
    assert counts["aborted"] <= s["rounds_aborted"]

    # TensorBoard: one run per peer, one point per step it trained, the same losses
    d = RunDir(run_dir.path)
    for name in ("peer0", "peer1", "peer2"):
        acc = EventAccumulator(str(tb / name))
        acc.Reload()
        tags = set(acc.Tags()["scalars"])
        assert {"loss", "lr", "comm/world_size", "comm/bytes_sent"} <= tags, (name, tags)
        records = d.records(name)
        losses = acc.Scalars("loss")
        assert [e.step for e in losses] == [r["step"] for r in records]
        assert all(
            math.isclose(e.value, r["loss"], rel_tol=1e-6)
            for e, r in zip(losses, records, strict=True)
        )
        assert all(math.isclose(e.value, cfg.optim.lr, rel_tol=1e-6) for e in acc.Scalars("lr"))
        assert [e.value for e in acc.Scalars("comm/world_size")] == [r["world"] for r in records]
        sent = [e.value for e in acc.Scalars("comm/bytes_sent")]
        assert sent == sorted(sent) and sent[-1] > 0

    # the run's page: plots inside it, a timeline, and no address of anything outside it
    page = (run_dir.path / "report.html").read_text()
    assert "<svg" in page and "data:image/png;base64," in page
    assert "://" not in re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", page)
