"""A ``transformers.Trainer`` script under `isthmus run` with the Hugging Face integration
(isthmus.integrations.hf): two peers, DiLoCo, a tiny Llama built from a config and a
``datasets.Dataset`` made in the script. Every peer ends with the same model bit for bit; a peer
SIGKILLed inside a collective is started again, joins at the run's step and ends on the run's
shared state; the reader uses every row of an epoch exactly once across the kill; the model
``save_pretrained`` wrote and the last isthmus checkpoint are that model."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the Trainer integration needs transformers")
pytest.importorskip("datasets", reason="the Trainer integration reads a datasets.Dataset")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")

import torch
from safetensors.torch import load_file

from isthmus.checkpoint import export, inspect
from support.cli import run_cli

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "hf_trainer.py"
PEER = Path(__file__).resolve().parent / "scripts" / "hf_trainer_peer.py"
ROWS, GLOBAL_BATCH = 96, 8
LINE = re.compile(
    r"^(\S+): step (\d+), state ([0-9a-f]+), model ([0-9a-f]+), joined at step (\d+)$", re.M
)
"""The line each peer prints last (examples/hf_trainer.py)."""


def _isthmus_run(run_dir: Path, *args: str) -> tuple[int, str]:
    return run_cli(
        # a 10 s heartbeat bound: these runs test the Trainer integration, and under make test's
        # workers a peer starved of the CPU for over the 3 s default was once evicted alive
        # (eviction itself is tested in test_silent_peer and test_fault_runs)
        "run", "--no-progress", "--run-dir", str(run_dir),
        "--summary-json", str(run_dir.parent / "s.json"), "--heartbeat-timeout", "10", *args,
    )  # fmt: skip


def _ends(run_dir: Path) -> dict[str, tuple[int, str, str, int]]:
    """Each peer's last line, from its log in the run directory: name -> (step, state digest,
    model digest, step it joined at)."""
    return {
        m[1]: (int(m[2]), m[3], m[4], int(m[5]))
        for log in run_dir.glob("peer*.log")
        for m in LINE.finditer(log.read_text())
    }


def _saved_weights_equal(saved: Path, state: dict[str, torch.Tensor]) -> None:
    """The weights ``save_pretrained`` wrote are ``state``'s, bit for bit (a tied weight is
    written once, under one of its names)."""
    from transformers import LlamaForCausalLM

    loaded = LlamaForCausalLM.from_pretrained(saved).state_dict()
    file = load_file(str(saved / "model.safetensors"))
    assert file, "save_pretrained wrote no tensors"
    for name, t in file.items():
        assert torch.equal(t, state[name]), name
        assert torch.equal(loaded[name], t), name


def test_two_peers_end_with_the_same_model_and_save_it_once(tmp_path: Path) -> None:
    out = tmp_path / "model"
    code, said = _isthmus_run(
        tmp_path / "run", "--peers", "2", str(EXAMPLE), "--steps", "24", "--sync-every", "4",
        "--out", str(out), "--trainer-dir", str(tmp_path / "trainer"),
    )  # fmt: skip
    assert code == 0, said
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["peers_final"] == 2 and s["parity_failures"] == 0, s
    # a catch-up round, then one outer round every 4 of the 24 steps
    assert s["rounds_committed"] == 7, s
    ends = _ends(tmp_path / "run")
    assert set(ends) == {"peer0", "peer1"}, said
    assert {e[0] for e in ends.values()} == {24}
    assert len({e[1] for e in ends.values()}) == 1, ends  # the same shared state
    assert len({e[2] for e in ends.values()}) == 1, ends  # the same model, every byte
    assert s["final_digest"] == ends["peer0"][1]
    # exactly one peer wrote the model
    logs = {n: (tmp_path / "run" / f"{n}.log").read_text() for n in ("peer0", "peer1")}
    wrote = [n for n, log in logs.items() if f"{n} wrote the model to {out}" in log]
    assert len(wrote) == 1, wrote
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    # no Trainer checkpoint-N directories: isthmus's checkpoints replace them
    assert not list((tmp_path / "trainer").glob("checkpoint-*"))


def test_a_killed_peer_restarts_joins_and_every_row_is_used_once(tmp_path: Path) -> None:
    """peer1 SIGKILLs itself inside the outer all-reduce at step 12 (the round aborts and the
    survivor retries it alone); the launcher starts it again as peer1.1, which joins at the
    run's step, and both end on the same model. Every row of every whole epoch is used by
    exactly one committed round; the last checkpoint and save_pretrained hold that model."""
    used, ck, out = tmp_path / "used", tmp_path / "ck", tmp_path / "model"
    used.mkdir()
    # five epochs of 12 global batches and more; the pace leaves the restarted peer (it imports
    # transformers afresh) the time to join well before the end
    steps = 64
    code, said = _isthmus_run(
        tmp_path / "run", "--peers", "2", "--max-restarts", "1", str(PEER),
        "--fault", "kill@collective:step=12", "--delay", "0.3",
        "--steps", str(steps), "--sync-every", "4", "--rows", str(ROWS),
        "--global-batch", str(GLOBAL_BATCH), "--out", str(out), "--used-dir", str(used),
        "--checkpoint-dir", str(ck), "--checkpoint-every", "4",
        "--trainer-dir", str(tmp_path / "trainer"),
    )  # fmt: skip
    assert code == 0, said
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["restarts"] == 1 and s["exit_codes"]["peer1"] == -9, s
    assert s["exit_codes"]["peer0"] == 0 and s["exit_codes"]["peer1.1"] == 0, s
    assert s["rounds_aborted"] >= 1 and s["resyncs"] >= 1, s
    assert s["peers_final"] == 2 and s["parity_failures"] == 0, s

    ends = _ends(tmp_path / "run")
    assert set(ends) == {"peer0", "peer1.1"}, said
    # the restarted peer continued from the run's state: it jumped to the run's step at its
    # catch-up round (not step 1), stopped at the run's end, and holds the same bytes
    assert ends["peer1.1"][3] > 12, ends
    assert ends["peer0"][3] == 0, ends
    assert ends["peer0"][0] == ends["peer1.1"][0] == steps, ends
    assert ends["peer0"][1] == ends["peer1.1"][1] == s["final_digest"], ends
    assert ends["peer0"][2] == ends["peer1.1"][2], ends
    # and its learning-rate schedule jumped with it: both logged the same rate at step 60
    rates = [
        re.findall(r"'learning_rate': '([^']+)'", (tmp_path / "run" / f"{n}.log").read_text())
        for n in ("peer0", "peer1.1")
    ]
    assert rates[0] and rates[1] and rates[0][-1] == rates[1][-1], rates

    # every member logged the same use of each committed round; whole epochs once each
    by_round: dict[tuple[int, int], list[int]] = {}
    for f in used.glob("used-*.jsonl"):
        for line in f.read_text().splitlines():
            d = json.loads(line)
            key = (d["round"], d["epoch"])
            assert by_round.setdefault(key, d["used"]) == d["used"], key
    assert {f.name for f in used.glob("*.jsonl")} == {
        "used-peer0.jsonl", "used-peer1.jsonl", "used-peer1.1.jsonl"
    }  # fmt: skip
    per_epoch: dict[int, list[int]] = defaultdict(list)
    for (_, epoch), idx in sorted(by_round.items()):
        per_epoch[epoch].extend(idx)
    last = max(per_epoch)
    assert last >= 2, sorted(per_epoch)
    for epoch in range(last):
        assert sorted(per_epoch[epoch]) == list(range(ROWS)), f"epoch {epoch}"
    assert len(per_epoch[last]) == len(set(per_epoch[last]))

    # the last isthmus checkpoint (written at the end) is the model save_pretrained wrote
    info = inspect(str(ck))
    assert info["verified"] is True and not info["incomplete"], info
    export(str(ck), tmp_path / "ck.safetensors")
    _saved_weights_equal(out, load_file(str(tmp_path / "ck.safetensors")))
