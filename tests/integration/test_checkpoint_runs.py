"""Durable runs end to end: the built-in job on 3 real peers writes checkpoints, every peer is
SIGKILLed, and a new run resumes from the latest complete checkpoint (on 3, 2 or 5 peers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from isthmus.checkpoint import CheckpointStore, inspect, load_latest
from isthmus.cli import main as cli_main
from isthmus.run.builtin_run import demo_config, run_builtin
from isthmus.run.record import Summary
from support.cli import run_cli

BASE: dict[str, Any] = {
    "model": "tiny",
    "corpus_bytes": 200_000,
    "batch_size": 8,
    "progress": False,
    "collective_timeout": 20.0,
    "timeout": 240.0,
    "peers": 3,
}


def _run(tmp: Path, name: str, **over: Any) -> Summary:
    cfg = demo_config({**BASE, "run_dir": str(tmp / name), **over})
    summary, _, _ = run_builtin(cfg)
    return summary


@pytest.mark.parametrize(
    ("strategy", "steps", "kill_at", "every"),
    [("ddp", 16, 10, 3), ("diloco", 32, 22, 1)],
    ids=["ddp", "diloco"],
)
def test_stopping_every_peer_and_resuming_is_invisible(
    tmp_path: Path, strategy: str, steps: int, kill_at: int, every: int
) -> None:
    """Checkpointed, every peer SIGKILLed in the middle of the run, resumed on 3 peers: the
    final shared state equals the uninterrupted run's bit for bit."""
    opts = {
        "strategy": strategy,
        "steps": steps,
        "option": {"sync_every": 4} if strategy == "diloco" else {},
    }
    whole = _run(tmp_path, "whole", **opts)
    assert whole.peers_final == 3 and whole.parity_failures == 0, whole
    ck = tmp_path / "ck"
    killed = _run(
        tmp_path,
        "killed",
        **opts,
        checkpoint_dir=str(ck),
        checkpoint_every=every,
        fault={p: [f"kill@step:step={kill_at}"] for p in range(3)},
    )
    assert killed.peers_final == 0 and killed.kills == 3, killed
    revisions = CheckpointStore(str(ck)).revisions()
    assert revisions and 0 < revisions[-1] < whole.rounds_committed
    resumed = _run(tmp_path, "resumed", **opts, resume=str(ck))
    assert resumed.resumed_from_round == revisions[-1]
    assert resumed.peers_final == 3 and resumed.parity_failures == 0, resumed
    assert resumed.final_digest == whole.final_digest
    assert resumed.final_model_digest == whole.final_model_digest


def test_resume_on_fewer_and_more_peers_and_export(tmp_path: Path) -> None:
    """A 3-peer checkpoint resumed on 2 and on 5 peers goes on from its loss, in parity; its
    export loads into the model class with plain torch and evaluates like the run's end."""
    from safetensors.torch import load_file

    from isthmus.data import Corpus, evaluate
    from isthmus.models import GPT, GPTConfig

    ck = tmp_path / "ck"
    first = _run(
        tmp_path, "first", strategy="diloco", steps=30, option={"sync_every": 5},
        checkpoint_dir=str(ck), checkpoint_every=2,
    )  # fmt: skip
    assert first.checkpoints_written >= 3 and first.checkpoint_stall_s > 0, first
    info = inspect(str(ck))
    assert info["verified"] is True and info["manifest"]["local"] == ["peer0", "peer1", "peer2"]
    out = tmp_path / "model.safetensors"
    assert cli_main(["checkpoint", "export", str(ck), "--out", str(out)]) == 0
    model = GPT(GPTConfig.tiny(), seed=123)  # other initial weights: every one must be replaced
    model.load_state_dict(load_file(str(out)))
    loss = evaluate(model, Corpus.from_stdlib(max_bytes=200_000), batch_size=8, n_batches=8)
    assert loss == pytest.approx(first.final_eval_loss, abs=1e-6)  # the summary rounds to 1e-6
    for peers in (2, 5):
        s = _run(
            tmp_path, f"on{peers}", strategy="diloco", steps=45, option={"sync_every": 5},
            resume=str(ck), peers=peers,
        )  # fmt: skip
        assert s.resumed_from_round == first.rounds_committed  # the first run's end
        assert s.peers_final == peers and s.parity_failures == 0, s
        # it goes on from the first run's loss, not from the initial model's
        assert s.final_eval_loss < first.initial_eval_loss - 1.0
        assert s.final_eval_loss <= first.final_eval_loss + 0.05


def test_a_peer_killed_while_saving_leaves_no_listed_checkpoint(tmp_path: Path) -> None:
    """peer1 SIGKILLs itself in its writer thread after writing its part of revision 4's
    checkpoint and before reporting it: that checkpoint never completes; a later one does."""
    ck = tmp_path / "ck"
    s = _run(
        tmp_path, "run", strategy="ddp", steps=12, step_delay=0.05,
        checkpoint_dir=str(ck), checkpoint_every=2, fault={1: ["kill@checkpoint:round=4"]},
    )  # fmt: skip
    assert s.exit_codes["peer1"] == -9 and s.peers_final == 2, s
    store = CheckpointStore(str(ck))
    assert 4 not in store.revisions()
    later = [r for r in store.revisions() if r > 4]
    assert later, store.revisions()
    assert inspect(str(ck), revision=later[-1])["verified"] is True


@pytest.mark.slow  # tests/unit/test_checkpoint.py refuses another model's checkpoint by name too
def test_a_checkpoint_of_another_model_is_refused_by_name(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    _run(tmp_path, "tiny", strategy="ddp", steps=4, checkpoint_dir=str(ck), peers=1)
    state = {"model/tok_emb.weight": torch.zeros(256, 160)}

    class Fake(dict):  # what load_latest reads of a shared state
        pass

    with pytest.raises(ValueError, match=r"tensor 'model/tok_emb.weight' is \[256, 32\]"):
        load_latest(str(ck), Fake(state))
    s = _run(tmp_path, "default", strategy="ddp", steps=4, peers=1, model="default", resume=str(ck))
    assert s.peers_final == 0
    log = (tmp_path / "default" / "peer0.log").read_text()
    assert "tok_emb.weight" in log and "in the checkpoint but" in log


@pytest.mark.slow  # the same Strategy path as the built-in job's runs above
def test_a_users_script_checkpoints_through_its_session_and_resumes(tmp_path: Path) -> None:
    """SessionConfig(checkpoint_dir=..., checkpoint_every=2, resume=...) in a user's own loop under
    `isthmus run`: the strategy writes the checkpoints and a second run resumes from the last."""
    script = Path(__file__).resolve().parent / "scripts" / "user_train.py"
    ck = tmp_path / "ck"

    def run(name: str, *extra: str) -> tuple[int, str]:
        return run_cli(
            "run", "--no-progress", "--run-dir", str(tmp_path / name), "--peers", "2",
            str(script), *extra,
        )  # fmt: skip

    code, said = run("first", "--steps", "20", "--checkpoint-dir", str(ck))
    assert code == 0, said
    revisions = CheckpointStore(str(ck)).revisions()
    assert revisions, "no complete checkpoint"
    code, said = run("second", "--steps", "40", "--resume", str(ck))
    assert code == 0, said
    logs = "".join((tmp_path / "second" / f"peer{i}.log").read_text() for i in range(2))
    assert logs.count(f"resumed from revision {revisions[-1]}") == 2, logs
