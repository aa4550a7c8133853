"""A user's own job through `isthmus run`: token files on disk, the elastic sampler's
exactly-once guarantee across a kill inside a collective, its restart as a joiner and the
aborted round, and the Hugging Face example end to end (save_pretrained loads back)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from isthmus.data import TokenDataset, prepare
from support.cli import run_cli

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository's own docs, byte-tokenized: about 190k tokens."""
    out = tmp_path_factory.mktemp("tokens") / "data"
    prepare([ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))], out, progress=False)
    return out


def _isthmus_run(run_dir: Path, *args: str) -> tuple[int, str]:
    return run_cli(
        "run", "--no-progress", "--run-dir", str(run_dir),
        "--summary-json", str(run_dir / "s.json"), *args,
    )  # fmt: skip


def test_every_sample_is_used_once_across_a_kill_an_abort_and_a_join(
    tokens: Path, tmp_path: Path
) -> None:
    """3 peers, DDP, a global batch of 12 windows; peer1 SIGKILLs itself inside the collective of
    step 5 (that round aborts for everyone and is retried by the survivors), the launcher starts
    it again as a joiner (the survivors slow down while it is away, so that it comes back before
    the end on a loaded box). Every index of the first epoch appears in exactly one committed
    round."""
    used_dir = tmp_path / "used"
    used_dir.mkdir()
    small = tmp_path / "small"
    # a small dataset, so that the run goes through a whole epoch: the peers' script itself
    # (about 160 windows of 16 tokens; not the README, whose growth made this run ever longer)
    prepare([SCRIPTS / "sampled_train.py"], small, progress=False)
    n = len(TokenDataset(small, 16, split="train"))
    steps = -(-n // 12) + 8
    code, said = _isthmus_run(
        tmp_path / "run", "--peers", "3", "--max-restarts", "1",
        str(SCRIPTS / "sampled_train.py"), "--data", str(small), "--steps", str(steps),
        "--used-dir", str(used_dir), "--fault", "kill@collective:step=5", "--delay", "0.2",
        "--short-delay", "1",
    )  # fmt: skip
    assert code == 0, said
    s = json.loads((tmp_path / "run" / "s.json").read_text())
    assert s["restarts"] == 1 and s["exit_codes"]["peer1"] == -9, s
    assert s["rounds_aborted"] >= 1 and s["peers_final"] == 3 and s["parity_failures"] == 0, s
    by_round: dict[tuple[int, int], list[int]] = {}
    for f in used_dir.glob("used-*.jsonl"):
        for line in f.read_text().splitlines():
            d = json.loads(line)
            key = (d["round"], d["epoch"])
            # every member logged the same use of a committed round
            assert by_round.setdefault(key, d["used"]) == d["used"], key
    per_epoch: dict[int, list[int]] = defaultdict(list)
    for (_, epoch), idx in sorted(by_round.items()):
        per_epoch[epoch].extend(idx)
    assert sorted(per_epoch[0]) == list(range(n)), "epoch 0 must use every window exactly once"
    assert len(per_epoch[1]) == len(set(per_epoch[1]))


def test_the_hugging_face_example_on_two_peers(tokens: Path, tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the Hugging Face example needs transformers")
    out = tmp_path / "model"
    code, said = _isthmus_run(
        tmp_path / "run", "--peers", "2", str(ROOT / "examples" / "hf_causal_lm.py"),
        "--data", str(tokens), "--steps", "40", "--sync-every", "10", "--out", str(out),
    )  # fmt: skip
    assert code == 0, said
    s = json.loads((tmp_path / "run" / "s.json").read_text())
    assert s["peers_final"] == 2 and s["parity_failures"] == 0, s
    import torch
    from transformers import LlamaForCausalLM

    from isthmus.comm.state import tensor_hash

    model = LlamaForCausalLM.from_pretrained(out)
    assert model.config.tie_word_embeddings
    # both peers ended on the same shared state (their last log lines say so)
    logs = [(tmp_path / "run" / f"peer{i}.log").read_text() for i in range(2)]
    digests = {
        line.split("state ")[1] for log in logs for line in log.splitlines() if ", state " in line
    }
    assert len(digests) == 1, logs
    x = TokenDataset(tokens, 32, split="val")[0][0].unsqueeze(0)
    assert torch.isfinite(model(input_ids=x).logits).all()
    assert tensor_hash(model.model.embed_tokens.weight) == tensor_hash(model.lm_head.weight)
