"""The pre-trained starting point of fine-tuning runs (``isthmus demo --strategy zo``): the
pre-training slice is held out from the run's corpus, the saved model is what every peer loads
through ``model.init_from``, and a file that does not fit is refused naming the setting."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from isthmus.run.config import RunConfig, apply_overrides
from isthmus.run.job import build_corpus, build_model
from isthmus.run.pretrain import pretrain, pretraining_corpus


@pytest.fixture(scope="module")
def run() -> RunConfig:
    return apply_overrides(RunConfig(), {"model": "tiny", "corpus_bytes": 100_000, "steps": 2})


def test_the_pretraining_slice_shares_no_file_with_the_runs_corpus(run):
    own = build_corpus(run)
    held_out = pretraining_corpus(run, max_bytes=200_000)
    mine = set(own.train_sources) | set(own.eval_sources)
    theirs = set(held_out.train_sources) | set(held_out.eval_sources)
    assert theirs and not mine & theirs


def test_every_peer_loads_the_pretrained_model_through_init_from(run, tmp_path):
    path = tmp_path / "pre.pt"
    losses = pretrain(run, path, steps=3, max_bytes=200_000)
    assert set(losses) == {"initial", "pretrained"} and path.exists()
    start = dataclasses.replace(run, model=dataclasses.replace(run.model, init_from=str(path)))
    a, b = build_model(start), build_model(start)
    saved = torch.load(path, weights_only=True)
    for name, t in a.state_dict().items():
        assert torch.equal(t, saved[name]) and torch.equal(t, b.state_dict()[name])
    # and it is not the initialization: three steps of AdamW moved it
    fresh = build_model(run).state_dict()
    assert any(not torch.equal(t, fresh[n]) for n, t in a.state_dict().items())


def test_a_file_that_does_not_fit_is_refused_naming_the_setting(run, tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"w": torch.zeros(3)}, path)
    bad = dataclasses.replace(run, model=dataclasses.replace(run.model, init_from=str(path)))
    with pytest.raises(ValueError, match=r"model\.init_from"):
        build_model(bad)
    missing = dataclasses.replace(
        run, model=dataclasses.replace(run.model, init_from=str(tmp_path / "none.pt"))
    )
    with pytest.raises(ValueError, match=r"model\.init_from"):
        build_model(missing)
