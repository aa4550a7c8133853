"""Lab scenarios: one TOML file is a run (a :class:`~isthmus.runconfig.RunConfig`) plus the lab's own
sections, the emulated network and the churn.

A scenario file holds:

* the run, in the lab's spelling: ``[run]`` (``name``, ``steps`` or ``tokens``, ``seed``,
  ``model``), ``[strategy]`` (``name``, ``[strategy.options]``, ``compression``, ``aggregator``,
  ``connections``, ``probe_links``), ``[[byzantine]]`` entries, ``[[fault]]`` entries and
  ``[checkpoint]`` (``every``, ``keep``, ``dir``);
* any of the RunConfig's own sections as ``config.json`` writes them: ``[data]``, ``[optim]``,
  ``[eval]``, ``[timeouts]``, ``[output]``, ``[stragglers]``;
* the lab's sections: ``[network]`` (:mod:`isthmus.lab.netspec`), ``[[churn]]`` and
  ``[random_churn]``;
* optionally ``[job]``: the user's own peer script instead of the built-in job
  (:mod:`isthmus.lab.jobspec`; ``[strategy]`` is then optional, the script brings its own).

:func:`load_scenario` (and :func:`parse_scenario` for text) is the one loader: it builds the
RunConfig with the config's own checks (strict about TOML types: ``steps = "10"`` is no integer)
and the lab's sections with theirs. Every error is a :class:`~isthmus.spec.SpecError` whose
message names the file, the key as the file writes it (``network.rate[2]``, ``churn[1].peer``,
``run.model``) and what to write instead; an unknown key gets the closest known key as a
suggestion, because a misspelt option that is silently ignored turns a week of lab runs into
noise. docs/LAB.md documents every key; the examples live in ``scenarios/``.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from isthmus.lab.checks import (
    array_of_tables,
    check_int,
    check_options,
    check_str,
    construct,
)
from isthmus.lab.churn_plan import Planned, check_sequences, starting_slots
from isthmus.lab.churnspec import CHURN_ACTIONS, ChurnEvent, RandomChurn
from isthmus.lab.jobspec import JobSpec, check_script_scenario, parse_job
from isthmus.lab.netspec import (
    CONGESTION_CONTROL_NAME,
    MAX_LAB_PEERS,
    Impairment,
    NetworkSpec,
    Site,
    SiteLink,
    Sites,
    parse_network,
)
from isthmus.lab.rates import format_rate, parse_rate
from isthmus.runconfig import ByzantinePeer, DataConfig, ModelConfig, RunConfig, StrategyConfig
from isthmus.runconfig import from_dict as _run_from_dict
from isthmus.settings import check_keys
from isthmus.spec import SpecError, format_spec
from isthmus.strategies import STRATEGIES as _strategy_registry

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser is published as tomli
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = [
    "CHURN_ACTIONS",
    "CONGESTION_CONTROL_NAME",
    "MAX_LAB_PEERS",
    "MODEL_PRESETS",
    "STRATEGIES",
    "CheckpointSpec",
    "ChurnEvent",
    "FaultEntry",
    "Impairment",
    "JobSpec",
    "NetworkSpec",
    "RandomChurn",
    "RunSpec",
    "Scenario",
    "Site",
    "SiteLink",
    "Sites",
    "SpecError",
    "format_rate",
    "load_scenario",
    "parse_rate",
    "parse_scenario",
]

STRATEGIES = tuple(_strategy_registry.names())  # the strategies are named once, in their registry
MODEL_PRESETS = ("tiny", "default", "medium")

_MOVED: dict[str, tuple[Any, str]] = {
    "ScenarioError": (SpecError, "isthmus.spec.SpecError"),
    "StrategySpec": (
        StrategyConfig,
        "isthmus.run.config.StrategyConfig (Scenario.config.strategy)",
    ),
    "ByzantineSpec": (ByzantinePeer, "isthmus.run.config.ByzantinePeer"),
}


def __getattr__(name: str) -> Any:
    # the scenario's run-side types are the RunConfig's: one loader builds both
    if name in _MOVED:
        new, where = _MOVED[name]
        warnings.warn(f"isthmus.lab.scenario.{name} is {where}", DeprecationWarning, stacklevel=2)
        return new
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------- views of the file


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """``[run]`` as the file wrote it (a view of :attr:`Scenario.config`; checked there)."""

    name: str
    steps: int | None = None
    """Inner steps per peer; ``None`` when the file gives ``tokens``."""
    tokens: int | None = None
    """Training tokens over all peers; ``None`` when the file gives ``steps``."""
    seed: int = 0
    model: str = "tiny"


@dataclass(frozen=True, kw_only=True)
class FaultEntry:
    """One ``[[fault]]`` entry: a fault spec peer ``peer`` fires on itself (see
    :mod:`isthmus.comm.faults`), e.g. ``spec = "slow:3@20-60"``."""

    peer: int
    spec: str


@dataclass(frozen=True, kw_only=True)
class CheckpointSpec:
    """``[checkpoint]`` as the file wrote it: every this many committed rounds, keep this many,
    in ``dir`` (relative: inside the run's directory)."""

    every: int
    keep: int = 3
    dir: str = "checkpoints"


# ---------------------------------------------------------------------------- the scenario


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """A whole lab scenario: the run and the lab's sections. Cross-checks run here: the run's
    peers are the network's, peers named by churn exist, churn sequences make sense per peer
    (kill a running peer, join a dead or absent one, cont a stopped one) and never leave the run
    without a running peer, and step-based events fall within the run's steps. Raises
    :class:`~isthmus.spec.SpecError` naming ``source`` and the key."""

    config: RunConfig
    """The run the file describes, with the config's defaults for what it does not say; the lab
    adds the command line's settings (:func:`isthmus.run.lab_run.lab_config`)."""
    network: NetworkSpec
    tokens: int | None = None
    """``[run] tokens``: the run's steps follow from it and the batch size (:meth:`steps_for`)."""
    churn: tuple[ChurnEvent, ...] = ()
    random_churn: RandomChurn | None = None
    description: str = ""
    source: str = "<scenario>"
    """Where it came from (a file path), for messages."""
    job: JobSpec | None = None
    """``[job]``: the user's peer script the peers run; None: the built-in job."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "churn", tuple(self.churn))
        if self.job is not None:
            check_script_scenario(
                peer_faults=self.config.faults.peer_faults,
                byzantine=self.config.faults.byzantine,
                checkpoint=self.config.checkpoint.checkpoint_dir is not None,
                source=self.source,
            )
        n = self.network.peers
        if self.config.peers != n:
            raise self._error(
                f"the run has {self.config.peers} peers but network.peers = {n}", "network.peers"
            )
        for i, ev in enumerate(self.churn):
            _peer_exists(ev.peer, n, f"churn[{i}].peer", self.source)
            if ev.at_step is not None and self.tokens is None and ev.at_step > self.config.steps:
                raise self._error(
                    f"step {ev.at_step} is after the run ends (run.steps = {self.config.steps})",
                    f"churn[{i}].at_step",
                )
        problem = check_sequences(self.churn, n)
        if problem is not None:
            raise self._error(problem[1], problem[0])
        if self.random_churn is not None and self.random_churn.min_peers > n:
            raise self._error(
                f"min_peers = {self.random_churn.min_peers} but network.peers = {n}",
                "random_churn.min_peers",
            )

    def _error(self, problem: str, key: str) -> SpecError:
        return SpecError(problem, key=key, source=self.source)

    @property
    def peers(self) -> int:
        """Shorthand for ``network.peers``."""
        return self.network.peers

    @property
    def run(self) -> RunSpec:
        """``[run]`` as written (name, steps or tokens, seed, model)."""
        c = self.config
        steps = None if self.tokens is not None else c.steps
        return RunSpec(
            name=c.name, steps=steps, tokens=self.tokens, seed=c.model.seed, model=c.model.preset
        )

    @property
    def strategy(self) -> StrategyConfig:
        """The run's strategy section (``config.strategy``)."""
        return self.config.strategy

    @property
    def byzantine(self) -> tuple[ByzantinePeer, ...]:
        """The ``[[byzantine]]`` entries in file order, each attack as one spec string."""
        return tuple(self.config.faults.byzantine)

    @property
    def faults(self) -> tuple[FaultEntry, ...]:
        """The ``[[fault]]`` entries, grouped by peer."""
        pf = self.config.faults.peer_faults
        return tuple(FaultEntry(peer=p, spec=s) for p, specs in pf.items() for s in specs)

    @property
    def checkpoint(self) -> CheckpointSpec | None:
        """``[checkpoint]``, or None when the file has none."""
        c = self.config.checkpoint
        if c.checkpoint_dir is None:
            return None
        return CheckpointSpec(
            every=c.checkpoint_every, keep=c.checkpoint_keep, dir=c.checkpoint_dir
        )

    def with_job(self, job: JobSpec | None) -> Scenario:
        """This scenario with its peers running ``job`` (None: the built-in job); raises
        :class:`~isthmus.spec.SpecError` naming what a script cannot take."""
        return replace(self, job=job)

    def starting_peers(self) -> list[int]:
        """The peers running at the start: all but those whose first churn event is a join."""
        return _starting(self.peers, self.churn)

    def steps_for(self, *, batch_size: int) -> int:
        """The run's steps: ``run.steps``, or ``run.tokens`` over the tokens one step of all
        starting peers consumes (peers at the start x ``batch_size`` x the model's block size)."""
        if self.tokens is None:
            return self.config.steps
        block = self.config.model.block_size()
        return _token_steps(self.tokens, len(self.starting_peers()), batch_size, block)

    def to_json(self) -> dict[str, Any]:
        """The scenario as plain data (a run directory's ``scenario.json``)."""
        checkpoint = self.checkpoint
        return {
            "run": asdict(self.run),
            "strategy": asdict(self.strategy),
            "network": asdict(self.network),
            "churn": [asdict(e) for e in self.churn],
            "random_churn": asdict(self.random_churn) if self.random_churn else None,
            "byzantine": [asdict(b) for b in self.byzantine],
            "faults": [asdict(f) for f in self.faults],
            "checkpoint": asdict(checkpoint) if checkpoint else None,
            "job": self.job.to_json() if self.job else None,
            "description": self.description,
            "source": self.source,
        }


def _peer_exists(peer: int, n: int, key: str, source: str = "") -> None:
    if peer >= n:
        raise SpecError(
            f"peer {peer} does not exist: network.peers = {n}, so peers are 0..{n - 1}",
            key=key,
            source=source,
        )


def _starting(peers: int, churn: tuple[ChurnEvent, ...]) -> list[int]:
    events = [Planned(action=e.action, slot=e.peer, clock=e.clock, when=e.when) for e in churn]  # type: ignore[arg-type]
    return starting_slots(peers, events)


def _token_steps(tokens: int, starting: int, batch_size: int, block_size: int) -> int:
    return max(1, math.ceil(tokens / (max(1, starting) * batch_size * block_size)))


# ---------------------------------------------------------------------------- the loader

_RUN_KEYS = ("name", "steps", "tokens", "seed", "model", "nproc_per_peer")
_STRATEGY_KEYS = (
    "name",
    "options",
    "compression",
    "aggregator",
    "connections",
    "probe_links",
    "mesh",
)
_RUN_SECTIONS = ("data", "optim", "eval", "timeouts", "output", "stragglers")
_TOP = (
    "description",
    "run",
    "strategy",
    "network",
    "churn",
    "random_churn",
    "byzantine",
    "fault",
    "checkpoint",
    "job",
    *_RUN_SECTIONS,
)
_FILE_KEYS = {
    # where the file writes what the RunConfig calls otherwise
    "checkpoint.checkpoint_every": "checkpoint.every",
    "checkpoint.checkpoint_keep": "checkpoint.keep",
    "checkpoint.checkpoint_dir": "checkpoint.dir",
    "faults.byzantine": "byzantine",
    "model.preset": "run.model",
    "model.seed": "run.seed",
    "run.peers": "network.peers",
    "steps": "run.steps",
    "name": "run.name",
}
_REQUIRED = ("run", "strategy", "network")
_ATTACK_RE = re.compile(r"^[a-z][a-z0-9_]*$")


def _file_key(key: str, faults: list[tuple[int, str]]) -> str:
    """The key a scenario file writes for RunConfig key ``key``."""
    m = re.fullmatch(r"faults\.byzantine\[(\d+)\]", key)
    if m:
        return f"byzantine[{m.group(1)}].attack"
    m = re.fullmatch(r"faults\.peer_faults\[(\d+)\]\[(\d+)\]", key)
    if m:
        peer, j = int(m.group(1)), int(m.group(2))
        i = [k for k, (p, _) in enumerate(faults) if p == peer][j]
        return f"fault[{i}].spec"
    for run_key, file_key in _FILE_KEYS.items():
        if key == run_key or key.startswith((run_key + ".", run_key + "[")):
            return file_key + key[len(run_key) :]
    return key


def _byzantine(raw: Any, peers: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    seen: set[int] = set()
    for i, item in enumerate(array_of_tables(raw, "byzantine")):
        key = f"byzantine[{i}]"
        b = check_keys(item, key, ("peer", "attack", "options", "from_step"), ("peer", "attack"))
        peer = check_int(b["peer"], f"{key}.peer", minimum=0)
        attack = check_str(b["attack"], f"{key}.attack")
        if not _ATTACK_RE.match(attack):
            raise SpecError(
                f"attack names are lowercase identifiers such as 'sign_flip', got {attack!r}",
                key=f"{key}.attack",
            )
        options = check_options(b.get("options", {}), f"{key}.options")
        for name, value in options.items():
            if isinstance(value, tuple):
                raise SpecError(
                    "attack options are single values, not lists", key=f"{key}.options.{name}"
                )
        from_step = check_int(b.get("from_step", 0), f"{key}.from_step", minimum=0)
        _peer_exists(peer, peers, f"{key}.peer")
        if peer in seen:
            raise SpecError(
                f"peer {peer} is listed twice; give one entry per byzantine peer", key=f"{key}.peer"
            )
        seen.add(peer)
        out.append({"peer": peer, "attack": format_spec(attack, options), "from_step": from_step})
    return out


def _faults(raw: Any, peers: int) -> list[tuple[int, str]]:
    out = []
    for i, item in enumerate(array_of_tables(raw, "fault")):
        key = f"fault[{i}]"
        f = check_keys(item, key, ("peer", "spec"), ("peer", "spec"))
        peer = check_int(f["peer"], f"{key}.peer", minimum=0)
        spec = check_str(f["spec"], f"{key}.spec")
        _peer_exists(peer, peers, f"{key}.peer")
        out.append((peer, spec))
    return out


def _run_table(
    t: Mapping[str, Any], network: NetworkSpec, churn: tuple[ChurnEvent, ...]
) -> tuple[dict[str, Any], int | None, list[tuple[int, str]]]:
    """The file's run part as a RunConfig table, its ``tokens``, and its ``[[fault]]`` entries."""
    run = check_keys(t["run"], "run", _RUN_KEYS, ["name"])
    steps, tokens = run.get("steps"), run.get("tokens")
    if (steps is None) == (tokens is None):
        raise SpecError(
            "give exactly one of run.steps (inner steps per peer) or run.tokens "
            f"(training tokens in total); got steps={steps!r}, tokens={tokens!r}",
            key="run.steps",
        )
    if tokens is not None:
        check_int(tokens, "run.tokens", minimum=1)
    # a script brings its own strategy: without [strategy] the config's default fills the run
    st = check_keys(
        t.get("strategy", {"name": StrategyConfig().name}), "strategy", _STRATEGY_KEYS, ["name"]
    )
    options = check_options(st.get("options", {}), "strategy.options")
    byzantine = _byzantine(t["byzantine"], network.peers) if "byzantine" in t else []
    faults = _faults(t["fault"], network.peers) if "fault" in t else []
    table: dict[str, Any] = {
        "name": run["name"],
        "peers": network.peers,
        "nproc_per_peer": run.get("nproc_per_peer", 1),  # the built-in job's islands
        "model": {"preset": run.get("model", "tiny"), "seed": run.get("seed", 0)},
        "strategy": {
            **st,
            "options": {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()},
            "byzantine_f": len(byzantine) if st.get("aggregator") else 0,
        },
        "faults": {"byzantine": byzantine, "peer_faults": {}},
        **{s: t[s] for s in _RUN_SECTIONS if s in t},
    }
    for peer, spec in faults:
        table["faults"]["peer_faults"].setdefault(peer, []).append(spec)
    if "checkpoint" in t:
        c = check_keys(t["checkpoint"], "checkpoint", ("every", "keep", "dir"), ["every"])
        table["checkpoint"] = {
            # at least 1: the section is there so that the run can restart mid-way
            "checkpoint_every": check_int(c["every"], "checkpoint.every", minimum=1),
            "checkpoint_keep": c.get("keep", 3),
            "checkpoint_dir": check_str(c.get("dir", "checkpoints"), "checkpoint.dir"),
        }
    if tokens is not None:
        steps = _token_steps(
            tokens, len(_starting(network.peers, churn)), _batch_size(t), _block_size(run)
        )
    table["steps"] = steps
    return table, tokens, faults


def _batch_size(t: Mapping[str, Any]) -> int:
    # a bad value is reported when the config is built
    b = t.get("data", {}).get("batch_size") if isinstance(t.get("data"), Mapping) else None
    ok = isinstance(b, int) and not isinstance(b, bool) and b >= 1
    return b if ok else DataConfig().batch_size  # type: ignore[return-value]


def _block_size(run: Mapping[str, Any]) -> int:
    preset = run.get("model", "tiny")
    return ModelConfig(preset=preset if preset in MODEL_PRESETS else "tiny").block_size()


def _churn(t: Mapping[str, Any]) -> tuple[ChurnEvent, ...]:
    out = []
    for i, item in enumerate(array_of_tables(t.get("churn", []), "churn")):
        key = f"churn[{i}]"
        c = check_keys(item, key, ("action", "peer", "at_step", "at_seconds"), ["action", "peer"])
        out.append(construct(ChurnEvent, key, **c))
    return tuple(out)


def _random_churn(t: Mapping[str, Any]) -> RandomChurn | None:
    if "random_churn" not in t:
        return None
    keys = ("failures_per_minute", "seed", "kind", "recover_after_seconds", "min_peers")
    r = check_keys(t["random_churn"], "random_churn", keys, ["failures_per_minute"])
    return construct(RandomChurn, "random_churn", **r)  # type: ignore[no-any-return]


def parse_scenario(
    data: str | Mapping[str, Any],
    *,
    source: str = "<scenario>",
    base_dir: str | Path | None = None,
) -> Scenario:
    """Build a :class:`Scenario` from TOML text or an already-parsed table; ``[job] script`` is
    read relative to ``base_dir`` (the working directory when None).

    Raises :class:`~isthmus.spec.SpecError` naming ``source``, the key and the problem: invalid
    TOML, unknown or missing keys (with a suggestion), values of the wrong type or out of bounds,
    bad rates, unknown strategy/model/action names and component specs, peers that do not exist,
    impossible churn sequences, steps and tokens both or neither given.
    """
    faults: list[tuple[int, str]] = []
    try:
        if isinstance(data, str):
            try:
                table: Mapping[str, Any] = tomllib.loads(data)
            except tomllib.TOMLDecodeError as e:
                raise SpecError(f"not valid TOML: {e}") from None
        else:
            table = data
        t = check_keys(table, "", _TOP, ["run", "network"] if "job" in table else _REQUIRED)
        description = t.get("description", "")
        if not isinstance(description, str):
            raise SpecError("must be a string", key="description")
        network = parse_network(t["network"])
        churn = _churn(t)
        random_churn = _random_churn(t)
        job = parse_job(t["job"], base_dir) if "job" in t else None
        run_table, tokens, faults = _run_table(t, network, churn)
        try:
            config = _run_from_dict(run_table, strict=True)
        except SpecError as e:
            raise SpecError(e.problem, key=_file_key(e.key, faults), spec=e.spec) from None
        return Scenario(
            config=config,
            network=network,
            tokens=tokens,
            churn=churn,
            random_churn=random_churn,
            description=description,
            source=source,
            job=job,
        )
    except SpecError as e:
        raise e.within("", source) from None


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file; raises :class:`~isthmus.spec.SpecError` (naming the
    file) for a malformed one and ``OSError`` if it cannot be read."""
    p = Path(path)
    return parse_scenario(p.read_text(encoding="utf-8"), source=str(p), base_dir=p.parent)
