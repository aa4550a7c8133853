"""A user's whole model is shared: parameters (tied ones once, frozen ones too) and persistent
buffers, across kills and joins, in bf16, and with one peer bit for bit; and what a checkpoint
holds of a strategy (its local state) continues training exactly.

Several peers run ``scripts/model_peer.py`` as real processes against a coordinator in this
process (so a kill is a real SIGKILL); one-peer runs use a real session in this process.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import TOKEN, Cluster, assert_bitwise_equal
from isthmus import Session
from isthmus.checkpoint import CheckpointStore
from isthmus.comm.state import tensor_bytes
from isthmus.run import forkserver
from isthmus.run.forkserver import PeerProcess
from isthmus.strategies import Strategy, make_strategy

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import model_peer  # noqa: E402 (the peers' own models, imported from the script beside us)

pytestmark = pytest.mark.usefixtures("one_thread")


def spawn(c: Cluster, name: str, *args: str) -> PeerProcess:
    log = c.dir / f"{name}.log"
    log.write_bytes(b"")
    p = forkserver.popen(
        [
            sys.executable,
            str(SCRIPTS / "model_peer.py"),
            f"--coordinator={c.coord.address}",
            f"--token={TOKEN}",
            f"--name={name}",
            f"--out={c.dir}",
            *args,
        ],
        env=dict(os.environ),
        log_path=log,
    )
    c.procs[name] = p
    return p


def record(c: Cluster, name: str) -> dict[str, Any]:
    path = c.dir / f"{name}.pt"
    assert path.exists(), f"{name} wrote no record; log:\n{c.log(name)}"
    return torch.load(path, weights_only=False)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and bytes(tensor_bytes(a)) == bytes(tensor_bytes(b))


# -- several peers: a kill, a join, parity of the whole state_dict ------------------------------


def kill_and_join(c: Cluster, common: list[str], *joiner: str) -> list[dict[str, Any]]:
    """Peers a, b, c; b is killed in the round of step 10 and j joins; returns the records of
    a, c and j once everyone finished (each asserted to have exited cleanly)."""
    spawn(c, "a", *common)
    spawn(c, "b", *common, "--fault=kill@collective:step=10")
    spawn(c, "c", *common)
    c.wait_until(
        lambda st: any(p["name"] == "b" and p["state"] == "dead" for p in st["peers"]),
        "b to be dead",
    )
    spawn(c, "j", *common, *joiner)
    codes = c.wait(timeout=240)
    assert codes == {"a": 0, "b": -signal.SIGKILL, "c": 0, "j": 0}, c.log("j")
    assert c.coord.status()["counters"]["rounds_aborted"] >= 1
    out = [record(c, n) for n in ("a", "c", "j")]
    for other in out[1:]:
        assert_bitwise_equal(out[0]["state_dict"], other["state_dict"])
        assert other["digest"] == out[0]["digest"]
    return out


@pytest.mark.parametrize(
    ("strategy", "model", "h"),
    [
        # make test keeps DDP on the BatchNorm CNN (the DiLoCo family's global copy runs in the
        # bf16 test below); the other combinations are slow tests (make test-slow)
        ("ddp", "cnn", 1),
        pytest.param("ddp", "tied", 1, marks=pytest.mark.slow),
        pytest.param("diloco", "cnn", 5, marks=pytest.mark.slow),
        pytest.param("diloco", "tied", 5, marks=pytest.mark.slow),
        # buffers that keep gathering statistics while a round is in flight (rebased on the mean)
        pytest.param("eager", "cnn", 5, marks=pytest.mark.slow),
        pytest.param("streaming", "tied", 6, marks=pytest.mark.slow),
    ],
)
def test_kill_and_join_end_with_every_state_dict_bitwise_equal(cluster, strategy, model, h):
    # min_peers=3: after the kill the survivors wait for the joiner, which therefore joins while
    # the killed round is being retried
    c = cluster(start_peers=3, min_peers=3)
    common = [f"--strategy={strategy}", f"--model={model}", "--steps=20", f"--sync-every={h}"]
    # the joiner starts with another value of the frozen parameter: the parity check repairs it
    ra, _, rj = kill_and_join(c, common, "--frozen-offset=1.0")
    assert ra["step"] == rj["step"] == 20
    keys = list(ra["state_dict"])
    assert any(k.endswith("running_mean") for k in keys)
    assert any(k.endswith("num_batches_tracked") for k in keys)
    assert "pixel_mean" not in keys and "inv_freq" not in keys  # non-persistent: local
    frozen = "scale" if model == "cnn" else "pos"
    assert torch.equal(ra["state_dict"][frozen], model_peer.build(model).frozen())
    # the joiner really arrived mid-run and was repaired (its frozen value among the rest)
    assert rj["rounds"][0]["resynced"] and rj["rounds"][0]["round"] > 0
    # every state_dict key (tied ones too) names a shared tensor
    names = {n for n, _ in ra["schema"]}
    assert set(ra["model_keys"]) == set(keys) and set(ra["model_keys"].values()) <= names
    if model == "tied":
        assert ra["model_keys"]["head.weight"] == ra["model_keys"]["emb.weight"]


def test_bf16_model_under_diloco_ends_in_parity_with_fp32_global_state(cluster):
    c = cluster(start_peers=3, min_peers=3)
    common = ["--strategy=diloco", "--model=cnn", "--dtype=bf16", "--steps=20", "--sync-every=5"]
    ra, _, _ = kill_and_join(c, common)
    schema = dict(ra["schema"])
    assert ra["state_dict"]["head.weight"].dtype == torch.bfloat16
    assert ra["state_dict"]["features.1.running_mean"].dtype == torch.bfloat16
    assert schema["global/head.weight"] == "torch.float32"
    assert schema["global/features.1.running_mean"] == "torch.float32"
    assert schema["outer/0/momentum_buffer"] == "torch.float32"
    assert schema["model/scale"] == "torch.bfloat16"  # frozen: shared as the model holds it
    assert schema["model/features.1.num_batches_tracked"] == "torch.int64"


# -- one peer: the round machinery changes nothing ----------------------------------------------


STRATEGIES: dict[str, dict[str, Any]] = {
    "ddp": {},
    "diloco": {"sync_every": 3},
    "localsgd": {"sync_every": 3},
    # the models have no numbered layers: fragments of about equal size instead
    "streaming": {"sync_every": 4, "fragments": 2, "overlap": 1, "pattern": "balanced"},
    "eager": {"sync_every": 3},
    "co2": {"sync_every": 3},
    "gossip": {"total_steps": 10},
    # SparseLoCo on Streaming's fragments, a round in flight behind one step
    "sparseloco": {"sync_every": 4, "fragments": 2, "overlap": 1, "pattern": "balanced"},
}


def make(
    name: str, session: Session | None, model: torch.nn.Module, opt: Any, **reduction: Any
) -> Strategy:
    return make_strategy(name, session, model, opt, **reduction, **STRATEGIES[name])


def train(st: Strategy, model: torch.nn.Module, kind: str, until: int, *, end: bool) -> None:
    while st.step_count < until:
        model_peer.loss_of(model, kind, st.step_count, 0).backward()
        st.step()
        st.optimizer.zero_grad()
    if end:
        st.finish()


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_ddp_one_peer_equals_plain_torch_bit_for_bit_batchnorm_included(one_peer):
    plain, wrapped = model_peer.build("cnn"), model_peer.build("cnn")
    opt_plain, opt_wrapped = adamw(plain), adamw(wrapped)
    session = one_peer()
    st = make("ddp", session, wrapped, opt_wrapped)
    for step in range(8):
        model_peer.loss_of(plain, "cnn", step, 0).backward()
        opt_plain.step()
        opt_plain.zero_grad()
    train(st, wrapped, "cnn", 8, end=True)
    assert session.revision == 8
    assert_bitwise_equal(plain.state_dict(), wrapped.state_dict())
    assert int(wrapped.state_dict()["features.1.num_batches_tracked"]) == 8


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_one_peer_session_equals_no_session_for_every_strategy(one_peer, name):
    """The catch-up round of a session (the DiLoCo family's and gossip's first step) drops its
    forward pass's statistics with its gradient, so the buffers too are those of no session."""
    options = STRATEGIES[name]
    if name in ("streaming", "sparseloco"):
        # one fragment: with a session the catch-up round takes round number 0 and shifts the
        # fragment schedule by one against a run without a session (which has no catch-up)
        options = {**options, "fragments": 1}
    alone_model, peer_model = model_peer.build("cnn"), model_peer.build("cnn")
    alone = make_strategy(name, None, alone_model, adamw(alone_model), **options)
    train(alone, alone_model, "cnn", 10, end=True)
    peer = make_strategy(name, one_peer(), peer_model, adamw(peer_model), **options)
    train(peer, peer_model, "cnn", 10, end=True)
    assert_bitwise_equal(alone_model.state_dict(), peer_model.state_dict())


# -- checkpoints: local state through CheckpointStore continues training exactly ----------------


def checkpoint(st: Strategy, session: Session, store: CheckpointStore) -> int:
    store.save(session.state.snapshot(), "shared")
    store.save(st.local_state(), "local")
    return session.revision


def resume(
    name: str, session: Session, store: CheckpointStore, revision: int, **reduction: Any
) -> Strategy:
    """A fresh process's view: another initial model, a fresh optimizer and strategy, then the
    shared state and this peer's local state loaded from the store."""
    model = model_peer.build("tied", seed=123)
    st = make(name, session, model, adamw(model), **reduction)
    shared = {n: torch.empty_like(t) for n, t in session.state.items()}
    store.load(shared, "shared")
    for n, t in shared.items():
        session.state[n].copy_(t)
    local = st.local_state()
    store.load(local, "local")
    st.load_local_state(local)
    # what resuming a run does: a fresh coordinator adopts the highest revision its peers hold
    session.revision = revision
    return st


@pytest.mark.parametrize(
    ("name", "compression"),
    [
        ("ddp", None),
        ("diloco", None),
        ("diloco", "topk:0.2+ef"),  # error feedback is local state
        ("streaming", None),
        ("eager", None),
        ("co2", None),
        ("sparseloco", None),  # its accumulators are local state, and the message in flight
    ],
)
def test_local_state_round_trip_continues_training_bit_for_bit(
    one_peer, tmp_path, name, compression
):
    # 7 steps: DiLoCo's rounds at 3 and 6 and one step of local progress; eager's and CO2's
    # round issued at step 6 is in flight; Streaming's at step 7 too (issued one step early)
    total, cut = 14, 7
    ref_model = model_peer.build("tied")
    ref = make(name, one_peer(), ref_model, adamw(ref_model), compression=compression)
    torch.manual_seed(5)
    train(ref, ref_model, "tied", total, end=True)

    model = model_peer.build("tied")
    s1 = one_peer()
    st = make(name, s1, model, adamw(model), compression=compression)
    torch.manual_seed(5)
    train(st, model, "tied", cut, end=False)
    store = CheckpointStore(str(tmp_path / "ckpt"), create=True)
    if name in ("streaming", "eager", "co2", "sparseloco"):
        assert st.local_state()["flight"]["present"] == 1  # a round was in flight: it is saved
    if compression:
        assert len(st.local_state()["compressor"]) > 1000  # the residuals are in it
    if name == "sparseloco":  # so are its accumulators, and they hold something
        assert any(bool(e.abs().sum() > 0) for e in st.local_state()["error"].values())
    revision = checkpoint(st, s1, store)

    s2 = one_peer()
    again = resume(name, s2, store, revision, compression=compression)
    train(again, again.model, "tied", total, end=True)
    assert_bitwise_equal(ref_model.state_dict(), again.model.state_dict())
    assert ref.session is not None
    assert_bitwise_equal(ref.session.state.snapshot(), s2.state.snapshot())
