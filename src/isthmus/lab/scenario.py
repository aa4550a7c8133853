"""Lab scenarios: one TOML file describes a run, its strategy, the emulated network and the faults.

A scenario is parsed into frozen, keyword-only dataclasses (:class:`Scenario` and its parts), each
validated on construction. Every error is a :class:`ScenarioError` whose message names the file,
the key (``network.rate[2]``, ``churn[1].peer``) and what to write instead; unknown keys are
rejected with the closest known key as a suggestion, because a misspelt option that is silently
ignored turns a week of lab runs into noise. The file format (every key) is documented in
docs/LAB.md; the examples live in ``scenarios/``.

Compression, aggregator and attack specs are checked with the factories that will build them
(``make_compressor``, ``make_aggregator``, ``make_attack``), so a typo fails when the file is
loaded. Strategy options are only checked for shape here (scalars or lists of scalars, finite
numbers); the strategy factory validates their meaning when the run is built.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from isthmus.lab.checks import (
    OptionValue,
    ScenarioError,
    check_float,
    check_int,
    check_options,
    check_spec,
    check_str,
    construct,
    one_of,
    table_keys,
)
from isthmus.lab.churn_plan import check_sequences, random_schedule
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
    "ByzantineSpec",
    "CheckpointSpec",
    "ChurnEvent",
    "FaultEntry",
    "Impairment",
    "NetworkSpec",
    "RandomChurn",
    "RunSpec",
    "Scenario",
    "ScenarioError",
    "Site",
    "SiteLink",
    "Sites",
    "StrategySpec",
    "format_rate",
    "load_scenario",
    "parse_rate",
    "parse_scenario",
]

STRATEGIES = tuple(_strategy_registry.names())  # the strategies are named once, in their registry
MODEL_PRESETS = ("tiny", "default")
CHURN_ACTIONS = ("kill", "join", "stop", "cont")


# ---------------------------------------------------------------------------- the parts


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """``[run]``: what to train and for how long."""

    name: str
    """Label used for the run's directory and reports."""
    steps: int | None = None
    """Inner optimizer steps per peer. Exactly one of ``steps`` and ``tokens``."""
    tokens: int | None = None
    """Training tokens over all peers. Exactly one of ``steps`` and ``tokens``."""
    seed: int = 0
    """Seed for model init, data order and injected faults."""
    model: str = "tiny"
    """Model preset: ``tiny`` (tests, seconds per step on a laptop) or ``default``."""

    def __post_init__(self) -> None:
        check_str(self.name, "name")
        if (self.steps is None) == (self.tokens is None):
            raise ScenarioError(
                "give exactly one of run.steps (inner steps per peer) or run.tokens "
                f"(training tokens in total); got steps={self.steps!r}, tokens={self.tokens!r}",
                key="steps",
            )
        if self.steps is not None:
            check_int(self.steps, "steps", minimum=1)
        if self.tokens is not None:
            check_int(self.tokens, "tokens", minimum=1)
        check_int(self.seed, "seed", minimum=0)
        one_of(self.model, MODEL_PRESETS, "model preset", "model")


@dataclass(frozen=True, kw_only=True)
class StrategySpec:
    """``[strategy]``: how peers synchronize, and with what compression and aggregation."""

    name: str
    """One of :data:`STRATEGIES`."""
    options: Mapping[str, OptionValue] = field(default_factory=dict)
    """Strategy options (``[strategy.options]``), checked by the strategy factory."""
    compression: str | None = None
    """Compressor spec, e.g. ``"int8"`` or ``"topk:0.01+ef21"``; ``None``: uncompressed."""
    aggregator: str | None = None
    """Aggregator spec, e.g. ``"krum"`` or ``"nnm+multi_krum:m=3"``; ``None``: plain mean."""
    connections: int = 1
    """TCP connections per peer pair each collective is striped over (``SessionConfig``)."""
    probe_links: bool = False
    """Peers measure their links when the membership changes (``SessionConfig``)."""

    def __post_init__(self) -> None:
        check_str(self.name, "name")
        check_int(self.connections, "connections", minimum=1)
        if not isinstance(self.probe_links, bool):
            raise ScenarioError(
                f"must be true or false, got {self.probe_links!r}", key="probe_links"
            )
        if self.name not in _strategy_registry:  # a deprecated name is accepted (and warned of)
            one_of(self.name, STRATEGIES, "strategy", "name")
        object.__setattr__(self, "options", check_options(self.options, "options"))
        if self.compression is not None:
            check_spec(self.compression, "compression", "compression")
        if self.aggregator is not None:
            check_spec(self.aggregator, "aggregator", "aggregator")


@dataclass(frozen=True, kw_only=True)
class ChurnEvent:
    """One ``[[churn]]`` entry: something happens to one peer at a step or a time.

    ``kill`` ends the peer's process (SIGKILL), ``join`` starts it (a peer whose first event is a
    join is absent at the start), ``stop`` freezes it (SIGSTOP: a silent peer), ``cont`` resumes it.
    """

    action: str
    """One of :data:`CHURN_ACTIONS`."""
    peer: int
    """Peer index, 0-based."""
    at_step: int | None = None
    """When peer ``peer`` reaches this inner step. Exactly one of ``at_step``/``at_seconds``."""
    at_seconds: float | None = None
    """Seconds after the run starts. Exactly one of ``at_step``/``at_seconds``."""

    def __post_init__(self) -> None:
        check_str(self.action, "action")
        one_of(self.action, CHURN_ACTIONS, "churn action", "action")
        check_int(self.peer, "peer", minimum=0)
        if (self.at_step is None) == (self.at_seconds is None):
            raise ScenarioError(
                "give exactly one of at_step (a step number) or at_seconds (time since start)",
                key="at_step",
            )
        if self.at_step is not None:
            check_int(self.at_step, "at_step", minimum=0)
        if self.at_seconds is not None:
            object.__setattr__(
                self, "at_seconds", check_float(self.at_seconds, "at_seconds", minimum=0.0)
            )

    @property
    def clock(self) -> str:
        """``"step"`` or ``"seconds"``: which clock the event is on."""
        return "step" if self.at_step is not None else "seconds"

    @property
    def when(self) -> float:
        """The event's time on its own clock."""
        return float(self.at_step if self.at_step is not None else self.at_seconds)  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True)
class RandomChurn:
    """``[random_churn]``: failures arriving at random (a Poisson process), reproducible by seed."""

    failures_per_minute: float
    """Mean failures per minute over the whole run (not per peer)."""
    seed: int = 0
    """Seed of the schedule; the same seed gives the same events."""
    kind: str = "kill"
    """``kill`` (the peer rejoins with ``join``) or ``stop`` (it resumes with ``cont``)."""
    recover_after_seconds: float | None = None
    """Delay before the failed peer rejoins or resumes; ``None``: it never comes back."""
    min_peers: int = 1
    """Never fail a peer if fewer than this many would be left running."""

    def __post_init__(self) -> None:
        check_float(self.failures_per_minute, "failures_per_minute", positive=True)
        check_int(self.seed, "seed", minimum=0)
        check_str(self.kind, "kind")
        one_of(self.kind, ("kill", "stop"), "failure kind", "kind")
        if self.recover_after_seconds is not None:
            check_float(self.recover_after_seconds, "recover_after_seconds", positive=True)
        check_int(self.min_peers, "min_peers", minimum=1)

    def schedule(self, *, peers: int, duration_s: float) -> list[ChurnEvent]:
        """The concrete events for a run of ``duration_s`` seconds with ``peers`` peers.

        Failures arrive with exponential gaps; each picks a uniformly random running peer, unless
        that would leave fewer than ``min_peers`` running (then the failure is skipped). Recoveries
        that would fall after ``duration_s`` are dropped. Deterministic for a given seed.
        """
        check_int(peers, "peers", minimum=1)
        check_float(duration_s, "duration_s", minimum=0.0)
        return [
            ChurnEvent(action=action, peer=peer, at_seconds=t)
            for action, peer, t in random_schedule(
                failures_per_minute=self.failures_per_minute,
                seed=self.seed,
                kind=self.kind,
                recover_after_seconds=self.recover_after_seconds,
                min_peers=self.min_peers,
                peers=peers,
                duration_s=duration_s,
            )
        ]


@dataclass(frozen=True, kw_only=True)
class FaultEntry:
    """One ``[[fault]]`` entry: a fault spec peer ``peer`` fires on itself (see
    :mod:`isthmus.comm.faults`), e.g. ``spec = "slow:3@20-60"`` (steps 20 to 59 take three times
    as long) or ``spec = "fail@collective:round=12"``."""

    peer: int
    """Peer index, 0-based."""
    spec: str
    """The fault spec, checked with :meth:`isthmus.comm.faults.Fault.parse`."""

    def __post_init__(self) -> None:
        check_int(self.peer, "peer", minimum=0)
        check_str(self.spec, "spec")
        from isthmus.comm.faults import Fault  # lazily, as check_spec does: it needs torch

        try:
            Fault.parse(self.spec)
        except ValueError as e:
            raise ScenarioError(str(e), key="spec") from None


@dataclass(frozen=True, kw_only=True)
class CheckpointSpec:
    """``[checkpoint]``: durable copies of the run while it goes. With them a run outlives every
    peer: when churn leaves no peer with the state, the coordinator restarts the run from the
    latest complete checkpoint instead of ending it (docs/ELASTIC.md)."""

    every: int
    """Write one every this many committed rounds."""
    keep: int = 3
    """How many complete checkpoints to keep."""
    dir: str = "checkpoints"
    """Where they go: a path relative to the run's directory, an absolute path or an fsspec URL."""

    def __post_init__(self) -> None:
        check_int(self.every, "every", minimum=1)
        check_int(self.keep, "keep", minimum=1)
        check_str(self.dir, "dir")


_ATTACK_RE = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True, kw_only=True)
class ByzantineSpec:
    """One ``[[byzantine]]`` entry: a peer that sends corrupted updates."""

    peer: int
    """Peer index, 0-based."""
    attack: str
    """Attack name (e.g. ``sign_flip``, ``ipm``, ``alie``, ``gaussian``), checked with
    ``isthmus.reduce.aggregate.attacks.make_attack``."""
    options: Mapping[str, OptionValue] = field(default_factory=dict)
    """Attack options (``[byzantine.options]`` under the entry)."""
    from_step: int = 0
    """First step at which the peer misbehaves."""

    def __post_init__(self) -> None:
        check_int(self.peer, "peer", minimum=0)
        check_str(self.attack, "attack")
        if not _ATTACK_RE.match(self.attack):
            raise ScenarioError(
                f"attack names are lowercase identifiers such as 'sign_flip', got {self.attack!r}",
                key="attack",
            )
        options = check_options(self.options, "options")
        for name, value in options.items():
            if isinstance(value, tuple):
                raise ScenarioError(
                    "attack options are single values, not lists", key=f"options.{name}"
                )
        object.__setattr__(self, "options", options)
        check_int(self.from_step, "from_step", minimum=0)
        check_spec(self.spec, "attack", "attack")

    @property
    def spec(self) -> str:
        """The attack as a spec string for ``make_attack``, e.g. ``"alie:tau=1.5"``."""
        if not self.options:
            return self.attack
        parts = ",".join(
            f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.options.items()
        )
        return f"{self.attack}:{parts}"


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """A whole lab scenario. Cross-checks run here: peers named by churn and byzantine entries
    exist, at least one peer is honest, churn sequences make sense per peer (kill a running peer,
    join a dead or absent one, cont a stopped one) and never leave the run without a running peer,
    and step-based events fall within ``run.steps``."""

    run: RunSpec
    strategy: StrategySpec
    network: NetworkSpec
    churn: tuple[ChurnEvent, ...] = ()
    random_churn: RandomChurn | None = None
    byzantine: tuple[ByzantineSpec, ...] = ()
    faults: tuple[FaultEntry, ...] = ()
    checkpoint: CheckpointSpec | None = None
    description: str = ""
    source: str = "<scenario>"
    """Where it came from (a file path), for messages."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "churn", tuple(self.churn))
        object.__setattr__(self, "byzantine", tuple(self.byzantine))
        object.__setattr__(self, "faults", tuple(self.faults))
        n = self.network.peers
        for i, f in enumerate(self.faults):
            if f.peer >= n:
                raise ScenarioError(
                    f"peer {f.peer} does not exist: network.peers = {n}, so peers are 0..{n - 1}",
                    key=f"fault[{i}].peer",
                    source=self.source,
                )
        for i, ev in enumerate(self.churn):
            if ev.peer >= n:
                raise ScenarioError(
                    f"peer {ev.peer} does not exist: network.peers = {n}, so peers are 0..{n - 1}",
                    key=f"churn[{i}].peer",
                    source=self.source,
                )
            if (
                ev.at_step is not None
                and self.run.steps is not None
                and ev.at_step > self.run.steps
            ):
                raise ScenarioError(
                    f"step {ev.at_step} is after the run ends (run.steps = {self.run.steps})",
                    key=f"churn[{i}].at_step",
                    source=self.source,
                )
        self._check_churn_sequences()
        seen: set[int] = set()
        for i, b in enumerate(self.byzantine):
            if b.peer >= n:
                raise ScenarioError(
                    f"peer {b.peer} does not exist: network.peers = {n}, so peers are 0..{n - 1}",
                    key=f"byzantine[{i}].peer",
                    source=self.source,
                )
            if b.peer in seen:
                raise ScenarioError(
                    f"peer {b.peer} is listed twice; give one entry per byzantine peer",
                    key=f"byzantine[{i}].peer",
                    source=self.source,
                )
            seen.add(b.peer)
        if seen and len(seen) >= n:
            raise ScenarioError(
                f"all {n} peers are byzantine; at least one must be honest",
                key="byzantine",
                source=self.source,
            )
        if self.random_churn is not None and self.random_churn.min_peers > n:
            raise ScenarioError(
                f"min_peers = {self.random_churn.min_peers} but network.peers = {n}",
                key="random_churn.min_peers",
                source=self.source,
            )

    def _check_churn_sequences(self) -> None:
        problem = check_sequences(self.churn, self.network.peers)
        if problem is not None:
            key, text = problem
            raise ScenarioError(text, key=key, source=self.source)

    @property
    def peers(self) -> int:
        """Shorthand for ``network.peers``."""
        return self.network.peers


# ---------------------------------------------------------------------------- parsing


def _section_run(raw: Any) -> RunSpec:
    t = table_keys(raw, "run", [f.name for f in fields(RunSpec)], ["name"])
    return construct(RunSpec, "run", **t)


def _section_strategy(raw: Any) -> StrategySpec:
    t = table_keys(raw, "strategy", [f.name for f in fields(StrategySpec)], ["name"])
    return construct(StrategySpec, "strategy", **t)


def _array_of_tables(raw: Any, key: str) -> list[Any]:
    if not isinstance(raw, list):
        raise ScenarioError(f"write each entry as a [[{key}]] table", key=key)
    return raw


def _section_churn(raw: Any) -> list[ChurnEvent]:
    out = []
    for i, item in enumerate(_array_of_tables(raw, "churn")):
        t = table_keys(
            item, f"churn[{i}]", [f.name for f in fields(ChurnEvent)], ["action", "peer"]
        )
        out.append(construct(ChurnEvent, f"churn[{i}]", **t))
    return out


def _section_random_churn(raw: Any) -> RandomChurn:
    t = table_keys(
        raw, "random_churn", [f.name for f in fields(RandomChurn)], ["failures_per_minute"]
    )
    return construct(RandomChurn, "random_churn", **t)


def _section_byzantine(raw: Any) -> list[ByzantineSpec]:
    out = []
    for i, item in enumerate(_array_of_tables(raw, "byzantine")):
        t = table_keys(
            item, f"byzantine[{i}]", [f.name for f in fields(ByzantineSpec)], ["peer", "attack"]
        )
        out.append(construct(ByzantineSpec, f"byzantine[{i}]", **t))
    return out


def _section_faults(raw: Any) -> list[FaultEntry]:
    out = []
    for i, item in enumerate(_array_of_tables(raw, "fault")):
        t = table_keys(item, f"fault[{i}]", ["peer", "spec"], ["peer", "spec"])
        out.append(construct(FaultEntry, f"fault[{i}]", **t))
    return out


def _section_checkpoint(raw: Any) -> CheckpointSpec:
    t = table_keys(raw, "checkpoint", [f.name for f in fields(CheckpointSpec)], ["every"])
    return construct(CheckpointSpec, "checkpoint", **t)


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
)


def parse_scenario(data: str | Mapping[str, Any], *, source: str = "<scenario>") -> Scenario:
    """Build a :class:`Scenario` from TOML text or an already-parsed table.

    Raises :class:`ScenarioError` naming ``source``, the key and the problem: invalid TOML,
    unknown or missing keys, wrong types, bad rates, unknown strategy/model/action names, peers
    that do not exist, impossible churn sequences, steps and tokens both or neither given.
    """
    try:
        if isinstance(data, str):
            try:
                table: Mapping[str, Any] = tomllib.loads(data)
            except tomllib.TOMLDecodeError as e:
                raise ScenarioError(f"not valid TOML: {e}") from None
        else:
            table = data
        t = table_keys(table, "", _TOP, ["run", "strategy", "network"])
        description = t.get("description", "")
        if not isinstance(description, str):
            raise ScenarioError("must be a string", key="description")
        return Scenario(
            run=_section_run(t["run"]),
            strategy=_section_strategy(t["strategy"]),
            network=parse_network(t["network"]),
            churn=tuple(_section_churn(t["churn"])) if "churn" in t else (),
            random_churn=_section_random_churn(t["random_churn"]) if "random_churn" in t else None,
            byzantine=tuple(_section_byzantine(t["byzantine"])) if "byzantine" in t else (),
            faults=tuple(_section_faults(t["fault"])) if "fault" in t else (),
            checkpoint=_section_checkpoint(t["checkpoint"]) if "checkpoint" in t else None,
            description=description,
            source=source,
        )
    except ScenarioError as e:
        raise e.within("", source) from None


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file; raises :class:`ScenarioError` (naming the file) for a
    malformed one and ``OSError`` if it cannot be read."""
    p = Path(path)
    return parse_scenario(p.read_text(encoding="utf-8"), source=str(p))
