"""The built-in job spends one forward and backward pass per step and evaluates after trained
steps only: the catch-up round of the DiLoCo family runs before the first forward pass
(``strategy.join()``), not as a first step whose work is dropped."""

from __future__ import annotations

from pathlib import Path

from isthmus.run.builtin_run import run_builtin
from isthmus.run.config import from_flat
from isthmus.run.record import RunDir


def test_the_job_trains_each_step_once_and_evaluates_only_after_trained_steps(
    tmp_path: Path,
) -> None:
    cfg = from_flat(
        peers=2, steps=8, model="tiny", strategy="diloco", option={"sync_every": 4},
        eval_every=4, eval_batches=1, corpus_bytes=200_000, batch_size=4,
        heartbeat_timeout=15, run_dir=str(tmp_path / "run"), progress=False,
    )  # fmt: skip
    summary, _, run_dir = run_builtin(cfg)
    assert summary.peers_final == 2 and summary.parity_failures == 0, summary
    # the catch-up round, then the rounds after steps 3 and 7
    assert summary.rounds_committed == 3 and summary.rounds_aborted == 0, summary
    d = RunDir(run_dir.path)
    for name in ("peer0", "peer1"):
        records = d.records(name)
        # one record per forward and backward pass: step 0 is not run twice
        assert [r["step"] for r in records] == list(range(8)), name
        # no eval at step 0, after a step that trained nothing
        assert [r["step"] for r in records if "eval_loss" in r] == [3, 7], name
