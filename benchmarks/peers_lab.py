"""Runs one system of ``benchmarks/peers.py`` in the lab and measures it.

isthmus runs through ``isthmus.run.lab_run.run_lab`` (what ``isthmus lab run`` does) on a scenario
written from the :class:`Setup` (``peers_lab_isthmus.py``). torchft and
hivemind run as worker processes of the peers' virtual environment inside a ``WanNetwork`` built
from the same scenario's ``[network]``: one worker per peer namespace, torchft's lighthouse and
the start barrier's TCPStore in the coordinator's namespace, link counters read before and after.

Each worker of a foreign run runs as a host of its own: a UTS namespace with the name of its network
namespace as host name, and ``/etc/netns/<ns>/hosts`` in every namespace naming every node (``ip
netns exec`` mounts it over ``/etc/hosts``), as machines on a real network would have. torchft
needs it: its Gloo groups take their address from the host name (else they bind 127.0.0.1), and
its checkpoint server advertises ``http://<host name>:port`` to the peer that heals from it. The
files are removed with the network.

Every wait is bounded: the start by ``Setup.start_timeout``, the run by ``Setup.run_timeout``; a
worker still alive then is killed, and the network's teardown kills whatever is left in its
namespaces (a DHT daemon included).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peers_goodput import Failure, failure_schedule, goodput_row, starters, torchft_attempts
from peers_measure import (
    eval_curve,
    first_after,
    hivemind_commits,
    start_time,
    torchft_commits,
    wire_tx,
)

from isthmus.models.gpt import PRESETS, GPTConfig

HERE = Path(__file__).resolve().parent
LIGHTHOUSE_PORT = 29510


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


@dataclass(kw_only=True)
class Setup:
    """What every system shares (see ``benchmarks/peers.py``'s help for each)."""

    peers: int = 4
    rate: str = "100mbit"
    rtt_ms: float = 50.0
    steps: int = 300
    batch_size: int = 16
    lr: float = 1e-3
    weight_decay: float = 0.1
    corpus_bytes: int = 2_000_000
    seed: int = 0
    eval_every: int = 20
    eval_batches: int = 8
    sync_every: int = 20
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    fragments: int = 2
    overlap: int = 2
    alpha: float = 0.5
    target_batch: int = 0
    matchmaking_time: float = 2.0
    collective_timeout: float = 30.0
    heartbeat_timeout: float = 3.0
    start_timeout: float = 180.0
    run_timeout: float = 900.0
    victim: int = 3
    kill_at: float = 10.0
    join_at: float = 20.0
    step_delay: float = 0.1
    fault_steps: tuple[int, int] = (150, 500)
    fault_limit: float = 150.0
    targets: list[float] = dataclasses.field(default_factory=lambda: [3.0, 2.8, 2.6])
    model: str = "tiny"
    fail_every: float = 0.0
    restart_after: float = 5.0
    fail_until: float = 120.0
    fail_seed: int = 0
    fail_poisson: bool = False
    network: str = ""
    """A ``[network]`` section (with its sub-tables) replacing the one of ``peers``, ``rate``
    and ``rtt_ms`` (``--network FILE``: the section of a scenario file, e.g. two regions)."""

    def __post_init__(self) -> None:
        """Refuses a setup that cannot run, naming the setting (the command line's flag)."""
        for name in ("peers", "steps", "batch_size", "eval_every", "sync_every", "fragments"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be an int >= 1, got {v!r}")
        if self.peers < 2:
            raise ValueError(f"--peers: at least 2 peers to compare anything, got {self.peers}")
        if self.sync_every % self.fragments:
            raise ValueError(
                f"--sync-every ({self.sync_every}) must be a multiple of --fragments "
                f"({self.fragments})"
            )
        if not 0 <= self.overlap < self.sync_every // self.fragments:
            raise ValueError(f"--overlap: must be in 0..{self.sync_every // self.fragments - 1}")
        if not 0 <= self.victim < self.peers or self.victim == 0:
            # peer 0 hosts hivemind's bootstrap node: kill another one
            raise ValueError(f"--victim: a peer in 1..{self.peers - 1}, got {self.victim}")
        if not 0 < self.kill_at < self.join_at:
            raise ValueError(
                f"--kill-at ({self.kill_at}) must be > 0 and before --join-at ({self.join_at})"
            )
        if self.model not in PRESETS:
            raise ValueError(f"--model: one of {', '.join(PRESETS)}, got {self.model!r}")
        if self.rtt_ms < 0 or self.step_delay < 0 or self.fault_limit <= self.join_at:
            raise ValueError(
                "--rtt-ms and --step-delay must be >= 0 and --fault-limit after --join-at"
            )

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def scenario(
        self,
        name: str,
        strategy: str,
        options: dict[str, Any],
        fault: bool,
        *,
        compression: str = "none",
        failures: Sequence[Failure] = (),
    ) -> str:
        """The isthmus scenario (TOML) of one run; its ``[network]`` is every system's. A fault
        run kills and restarts ``victim``; ``failures`` (a goodput run) kill and restart each
        listed peer at its times."""
        opts = "".join(f"{k} = {v!r}\n" for k, v in options.items())
        text = (
            f'[run]\nname = "{name}"\nsteps = {self.steps}\nseed = {self.seed}\n'
            f'model = "{self.model}"\n'
            f'[strategy]\nname = "{strategy}"\ncompression = "{compression}"\n'
            + (f"[strategy.options]\n{opts}" if opts else "")
            + (
                self.network
                or f'[network]\npeers = {self.peers}\nrate = "{self.rate}"\nrtt_ms = {self.rtt_ms}\n'
            )
        )
        if fault:
            text += (
                f'[[churn]]\naction = "kill"\npeer = {self.victim}\nat_seconds = {self.kill_at}\n'
                f'[[churn]]\naction = "join"\npeer = {self.victim}\nat_seconds = {self.join_at}\n'
            )
        for f in failures:
            text += (
                f'[[churn]]\naction = "kill"\npeer = {f.peer}\nat_seconds = {f.at_s}\n'
                f'[[churn]]\naction = "join"\npeer = {f.peer}\nat_seconds = {f.back_s}\n'
            )
        return text

    @property
    def block_size(self) -> int:
        """Tokens per sample of the model (its block size)."""
        return GPTConfig.preset(self.model).block_size

    def failures(self) -> list[Failure]:
        """A goodput run's failures (none without ``fail_every``)."""
        if not self.fail_every:
            return []
        return failure_schedule(
            every_s=self.fail_every,
            restart_after_s=self.restart_after,
            until_s=self.fail_until,
            peers=self.peers,
            seed=self.fail_seed,
            poisson=self.fail_poisson,
        )

    def steps_for(self, name: str, fault: bool) -> int:
        """isthmus's budget. A fault run's is long enough for the joiner to come back (DDP is
        slower per step, so it gets fewer). The other systems' fault runs have no budget: the
        driver stops them 5 s after the joiner contributed, or ``fault_limit`` seconds after the
        start."""
        if not fault:
            return self.steps
        ddp_like = name.endswith(("-ddp", "-allreduce", "-dp", "-sync"))
        return self.fault_steps[0] if ddp_like else self.fault_steps[1]


def network_section(text: str) -> str:
    """The ``[network]`` table of a scenario file's text with its sub-tables (``[[network.x]]``),
    up to the next table of another name. Raises ValueError when there is none."""
    out: list[str] = []
    inside = False
    for line in text.splitlines():
        head = line.strip()
        if head.startswith("["):
            inside = head.strip("[]").split(".")[0].strip() == "network"
        if inside:
            out.append(line)
    if not out:
        raise ValueError("the scenario file has no [network] section")
    return "\n".join(out) + "\n"


def run_system(
    name: str, setup: Setup, out: Path, *, fault: bool, python: str, goodput: bool = False
) -> dict[str, Any]:
    """One run of system ``name``; a row of the result (errors are recorded, not raised). A
    ``goodput`` run is a main run (the same budget) under ``setup.failures()``, with the
    committed and theoretical fractions added."""
    label = f"{name}{'-fault' if fault else ''}{'-goodput' if goodput else ''}"
    row: dict[str, Any] = {"system": name, "fault": fault, "load_before": load(), "errors": []}
    failures = setup.failures() if goodput else []
    if goodput:
        row["goodput"] = True
    t = time.monotonic()
    try:
        if name.startswith("isthmus-"):
            from peers_lab_isthmus import run_isthmus  # it builds on this module's Setup

            row.update(run_isthmus(name, setup, out / label, fault, failures))
        else:
            row.update(_foreign(name, setup, out / label, fault, python, failures))
    except Exception as e:  # one system failing must not lose the others' rows
        row["errors"].append(f"{type(e).__name__}: {e}")
    row["wall_s"] = round(time.monotonic() - t, 1)
    row["load_after"] = load()
    return row


# ------------------------------------------------------------------------------------ foreign


@contextlib.contextmanager
def _hosts_files(namespaces: list[str], ips: list[str]) -> Iterator[None]:
    """``/etc/netns/<ns>/hosts`` in every namespace, naming every node by its namespace (each
    worker runs with that as its host name, see :func:`_as_host`)."""
    table = "127.0.0.1 localhost\n" + "".join(
        f"{ip} {ns}\n" for ns, ip in zip(namespaces, ips, strict=True)
    )
    _remove_stale_hosts_files()
    made = []
    try:
        for ns in namespaces:
            d = Path("/etc/netns") / ns
            d.mkdir(parents=True, exist_ok=False)
            made.append(d)
            (d / "hosts").write_text(table)
        yield
    finally:
        for d in made:
            shutil.rmtree(d, ignore_errors=True)
        with contextlib.suppress(OSError):
            Path("/etc/netns").rmdir()  # only if nothing else is left in it


def _remove_stale_hosts_files() -> None:
    """Hosts files of earlier runs whose driver died without removing them (SIGKILL): the
    namespace names hold the driver's pid (``isthp-<pid>-...``)."""
    for d in Path("/etc/netns").glob("isthp-*"):
        pid = d.name.split("-")[1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)


def _as_host(name: str, argv: list[str]) -> list[str]:
    """``argv`` run with host name ``name``, in a UTS namespace of its own. ``unshare`` and the
    shell exec, so the process the driver holds (and SIGKILLs) is the worker itself."""
    return ["unshare", "--uts", "--", "sh", "-c", f'hostname {name} && exec "$@"', "sh", *argv]


def _job(name: str, setup: Setup, run_dir: Path, fault: bool, net: Any, store_port: int) -> dict:
    system, mode = name.split("-", 1)
    target = setup.target_batch or setup.peers * setup.batch_size * setup.sync_every
    if mode == "sync":
        mode, target = "dp", setup.peers * setup.batch_size
    return {
        "system": system,
        "mode": mode,
        "peers": setup.peers,
        "hosts": [p.ip for p in net.peers],
        "store_host": net.coordinator.ip,
        "store_port": store_port,
        # a fault run goes on until the joiner contributed (the driver stops it then)
        "steps": 10**6 if fault else setup.steps,
        "batch_size": setup.batch_size,
        "lr": setup.lr,
        "weight_decay": setup.weight_decay,
        "corpus_bytes": setup.corpus_bytes,
        "data_seed": setup.seed,
        "model_seed": setup.seed,
        "eval_every": setup.eval_every,
        "eval_batches": setup.eval_batches,
        "sync_every": setup.sync_every,
        "outer_lr": setup.outer_lr,
        "outer_momentum": setup.outer_momentum,
        "fragments": setup.fragments,
        "overlap": setup.overlap,
        "alpha": setup.alpha,
        "collective_timeout": setup.collective_timeout,
        "heartbeat_timeout": setup.heartbeat_timeout,
        "start_timeout": setup.start_timeout,
        "step_delay": setup.step_delay if fault else 0.0,
        "out": str(run_dir),
        "model": setup.model,
        # torchft
        "lighthouse": f"http://{net.coordinator.ip}:{LIGHTHOUSE_PORT}",
        "min_replicas": 2,
        "quorum_timeout": setup.run_timeout,
        # hivemind
        "target_batch": target,
        "matchmaking_time": setup.matchmaking_time,
    }


def _foreign(
    name: str,
    setup: Setup,
    run_dir: Path,
    fault: bool,
    python: str,
    failures: Sequence[Failure] = (),
) -> dict[str, Any]:
    import json

    import torch.distributed as dist

    from isthmus.lab.netns import inside_namespace
    from isthmus.lab.scenario import parse_scenario
    from isthmus.lab.wan import WanNetwork
    from isthmus.run.record import read_jsonl

    run_dir.mkdir(parents=True, exist_ok=False)
    system = name.split("-", 1)[0]
    script = str(HERE / f"peers_{system}.py")
    network = parse_scenario(setup.scenario(name, "ddp", {}, False), source=name).network
    n, victim = setup.peers, setup.victim
    logs: list[Any] = []
    applied: dict[str, float] = {}
    with WanNetwork.from_spec(network, prefix="isthp") as net:
        nodes = [net.coordinator, *net.peers]
        with _hosts_files([x.netns for x in nodes], [x.ip for x in nodes]):
            with inside_namespace(net.coordinator.netns):
                store = dist.TCPStore(
                    net.coordinator.ip,
                    0,
                    is_master=True,
                    wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=setup.start_timeout),
                )
            job = _job(name, setup, run_dir, fault, net, store.port)
            (run_dir / "job.json").write_text(json.dumps(job, indent=1))

            def spawn(where: Any, argv: list[str], log: str) -> subprocess.Popen[bytes]:
                f = (run_dir / f"{log}.log").open("wb")
                logs.append(f)
                env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
                argv = _as_host(net.node(where).netns, argv)
                return net.popen(where, argv, env=env, stdout=f, stderr=subprocess.STDOUT)

            before = net.counters()
            if system == "torchft":
                # min_replicas 2, join timeout 10 s (torchft's README example), the heartbeat
                # timeout isthmus's
                beat = str(int(setup.heartbeat_timeout * 1000))
                argv = [python, script, "--lighthouse", str(LIGHTHOUSE_PORT), "2", "10000", beat]
                spawn("coordinator", argv, "lighthouse")
            job_path = str(run_dir / "job.json")
            procs = {
                f"peer{i}": spawn(i, [python, script, job_path, str(i), f"peer{i}"], f"peer{i}")
                for i in range(n)
            }
            deadline = time.monotonic() + setup.start_timeout
            while store.add("start", 0) < n:
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs.values()):
                    raise RuntimeError(
                        f"the peers did not all start (see {run_dir}/peer*.log): "
                        f"{store.add('start', 0)} of {n} passed the start barrier"
                    )
                time.sleep(0.05)
            t_start = time.time()
            joiner = f"peer{victim}.1"
            deadline = time.monotonic() + (setup.fault_limit if fault else setup.run_timeout)
            survivors_done: float | None = None
            contributed_at: float | None = None
            check_at = 0.0
            # a goodput run's kills and restarts, in time order; the process of each slot now
            pending = sorted(
                [(f.at_s, 1, f.peer) for f in failures] + [(f.back_s, 0, f.peer) for f in failures]
            )
            current = {i: f"peer{i}" for i in range(n)}
            killed: set[int] = set()
            kills = 0
            while time.monotonic() < deadline:
                now = time.time() - t_start
                while pending and now >= pending[0][0]:
                    _, is_kill, slot = pending.pop(0)
                    if is_kill and procs[current[slot]].poll() is None:
                        procs[current[slot]].send_signal(signal.SIGKILL)
                        killed.add(slot)
                        kills += 1
                    elif not is_kill and slot in killed:  # a finished peer is not restarted
                        killed.discard(slot)
                        current[slot] = f"peer{slot}.r{kills}"
                        argv = [python, script, job_path, str(slot), current[slot], "--join"]
                        procs[current[slot]] = spawn(slot, argv, current[slot])
                running = [procs[current[i]] for i in range(n) if i not in killed]
                if failures and all(p.poll() is not None for p in running):
                    break  # every slot that runs finished its budget
                if fault and "kill" not in applied and now >= setup.kill_at:
                    procs[f"peer{victim}"].send_signal(signal.SIGKILL)
                    applied["kill"] = time.time()
                if fault and "join" not in applied and now >= setup.join_at:
                    argv = [python, script, job_path, str(victim), joiner, "--join"]
                    procs[joiner] = spawn(victim, argv, joiner)
                    applied["join"] = time.time()
                if contributed_at is None and "join" in applied and time.monotonic() > check_at:
                    check_at = time.monotonic() + 1.0  # the records grow: read them once a second
                    if _contributed(system, job["mode"], run_dir):
                        contributed_at = time.monotonic()
                if contributed_at is not None and time.monotonic() - contributed_at > 5:
                    break  # both measurements are in, with a few seconds of records after
                others = [p for k, p in procs.items() if k != joiner]
                if all(p.poll() is not None for p in others):
                    if joiner not in procs or procs[joiner].poll() is not None:
                        break
                    # the joiner may run on alone once the others finished: a grace, then stop
                    survivors_done = survivors_done or time.monotonic()
                    if time.monotonic() - survivors_done > 20:
                        break
                time.sleep(0.05)
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=10)
            after = net.counters()
            codes = {k: p.returncode for k, p in procs.items()}
    for f in logs:
        f.close()
    records = {k: read_jsonl(run_dir / f"{k}.jsonl") for k in procs}
    errors = [
        f"{k}: {r['error']}" for k, recs in records.items() for r in recs if r["kind"] == "error"
    ]
    starting = [f"peer{i}" for i in range(n)]
    t0 = start_time(records, starting)
    row: dict[str, Any] = {"exit_codes": codes, "run_dir": str(run_dir), "errors": errors}
    tx = wire_tx(
        {str(k): dataclasses.asdict(v) for k, v in before.items()},
        {str(k): dataclasses.asdict(v) for k, v in after.items()},
    )
    commits, contributed = _foreign_commits(system, job["mode"], records)
    if not fault:
        finals = [r["eval_loss"] for recs in records.values() for r in recs if r["kind"] == "final"]
        last = [r["ts"] for recs in records.values() for r in recs if r["kind"] == "step"]
        peer_tx = {f"peer{i}": tx[str(i)] for i in range(n)}
        row.update(
            curve=eval_curve(starters(records), t0),
            final_eval_loss=round(sum(finals) / len(finals), 6) if finals else None,
            train_wall_s=round(max(last) - t0, 3) if last else None,
            tx_per_peer=peer_tx,
            tx_per_peer_mean=sum(peer_tx.values()) / n,
            tokens=sum(r["kind"] == "step" for recs in records.values() for r in recs)
            * setup.batch_size
            * setup.block_size,
            commits=len(commits.get("peer0", [])),
            hivemind=_hivemind_counts(records) if system == "hivemind" else None,
        )
        if failures:
            row.update(goodput_row(*torchft_attempts(records["peer0"]), kills))
            # the samples of the steps that committed with the process taking part (isthmus's
            # records hold committed steps only, so its ``tokens`` are already these)
            mine = [r for recs in records.values() for r in recs if r["kind"] == "commit"]
            done = sum(bool(r.get("ok")) and bool(r.get("participating")) for r in mine)
            row["tokens_committed"] = done * setup.batch_size * setup.block_size
        return row
    survivors = [k for k in starting if k != f"peer{victim}"]
    after_kill = [ts for k in survivors for ts in commits.get(k, [])]
    smaller = _foreign_commits(system, job["mode"], records, fewer_than=n)[0]
    without = [ts for k in survivors for ts in smaller.get(k, [])]
    if "kill" in applied:
        row["kill_t_s"] = round(applied["kill"] - t0, 3)
        row["kill_to_any_commit_s"] = first_after(applied["kill"], after_kill)
        row["kill_to_commit_s"] = first_after(applied["kill"], without)
    if "join" in applied:
        row["join_t_s"] = round(applied["join"] - t0, 3)
        mine = contributed.get(joiner, [])
        ready = [r["ts"] for r in records.get(joiner, []) if r["kind"] == "ready"]
        if mine:
            row["join_to_contribution_s"] = round(min(mine) - applied["join"], 3)
            if ready:
                row["ready_to_contribution_s"] = round(min(mine) - ready[0], 3)
        else:
            errors.append(f"{joiner} never contributed to a committed synchronization")
    if system == "hivemind":
        row["hivemind"] = _hivemind_counts(records)
    return row


def _contributed(system: str, mode: str, run_dir: Path) -> bool:
    """Whether the joiner's records already hold a committed synchronization it took part in."""
    from isthmus.run.record import read_jsonl

    path = next(run_dir.glob("peer*.1.jsonl"), None)
    if path is None:
        return False
    _, mine = _foreign_commits(system, mode, {"joiner": read_jsonl(path)})
    return bool(mine["joiner"])


def _foreign_commits(
    system: str,
    mode: str,
    records: dict[str, list[dict[str, Any]]],
    fewer_than: int | None = None,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per process: the times of its committed synchronizations, and of those it contributed
    to (see ``peers_measure``); with ``fewer_than``, only those of a smaller group."""
    if system == "torchft":
        commits = {k: torchft_commits(r, fewer_than=fewer_than) for k, r in records.items()}
        mine = {
            k: torchft_commits(r, participating=True, fewer_than=fewer_than)
            for k, r in records.items()
        }
        return commits, mine
    what = "parameters" if mode == "local" else "gradients"
    commits = {k: hivemind_commits(r, what, fewer_than=fewer_than) for k, r in records.items()}
    return commits, commits


def _hivemind_counts(records: dict[str, list[dict[str, Any]]]) -> dict[str, int]:
    from peers_measure import hivemind_events

    out: dict[str, int] = {}
    for recs in records.values():
        for e in hivemind_events(recs):
            key = e["kind"] + (f" {e['what']}" if e["what"] else "")
            out[key] = out.get(key, 0) + 1
    return out


if __name__ == "__main__":
    print("run benchmarks/peers.py", file=sys.stderr)
    raise SystemExit(2)
