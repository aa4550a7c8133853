"""One typed description of a run: :class:`RunConfig` and its sections, every default in one place.

The demo, the lab and the built-in peer job all read a :class:`RunConfig`. Its sections are
keyword-only dataclasses validated on construction; the whole config is validated without building
a model (strategy options through the strategy's own config dataclass, compressor, aggregator,
attack and fault specs through their registries), so a bad setting fails once, early, with the
dotted key that is wrong (``strategy.options.outer_lr: must be a number, got 'x'``).

Every leaf field also has a *flat name*, unique across the tree (its field name, or the
``flat`` in its metadata: ``model.preset`` is ``model``, ``data.seed`` is ``data_seed``). Flat
names are the command line's flags (``--batch-size``, generated in :mod:`isthmus.run.flags`),
the keys :func:`from_flat` takes, and what ``--set`` accepts besides dotted paths.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from isthmus.coordinator.stragglers import StragglerConfig
from isthmus.spec import SpecError, coerce, option_names, parse_assignment, suggest

__all__ = [
    "ByzantinePeer",
    "CheckpointConfig",
    "DataConfig",
    "EvalConfig",
    "FaultConfig",
    "ModelConfig",
    "OptimConfig",
    "OutputConfig",
    "RunConfig",
    "StrategyConfig",
    "TimeoutConfig",
    "apply_overrides",
    "from_dict",
    "from_flat",
    "leaves",
]

ModelPreset = Literal["default", "tiny"]
ShardMode = Literal["interleaved", "contiguous"]


# ---------------------------------------------------------------------------- text forms
# How the command line writes the values of the leaves that are not plain scalars. Each raises
# SpecError naming the flag and the form it wants.


def parse_kill(text: str) -> tuple[int, int]:
    """``PEER@STEP`` -> (peer, step)."""
    peer, sep, step = text.partition("@")
    if not sep or not peer.isdigit() or not step.isdigit():
        raise SpecError(f"--kill takes PEER@STEP (e.g. 1@20), got {text!r}")
    return int(peer), int(step)


def parse_peer_spec(text: str, flag: str, example: str) -> tuple[int, str]:
    """``PEER:SPEC`` -> (peer, spec)."""
    peer, sep, spec = text.partition(":")
    if not sep or not peer.isdigit() or not spec:
        raise SpecError(f"{flag} takes PEER:SPEC (e.g. {example}), got {text!r}")
    return int(peer), spec


def parse_fault(text: str) -> tuple[int, str]:
    """``PEER:SPEC`` with a fault spec, e.g. ``1:kill@collective:step=20``."""
    return parse_peer_spec(text, "--fault", "1:kill@collective:step=20")


def parse_byzantine(text: str) -> ByzantinePeer:
    """``PEER:ATTACK``, e.g. ``2:sign_flip`` or ``1:ipm:tau=2``."""
    peer, attack = parse_peer_spec(text, "--byzantine", "2:sign_flip or 1:ipm:tau=2")
    return ByzantinePeer(peer=peer, attack=attack)


def parse_option(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` (typed later by the strategy's config)."""
    return parse_assignment(text, flag="--option")


def _positive(section: str, **values: float) -> None:
    for name, v in values.items():
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise SpecError(f"must be a positive number, got {v!r}", key=f"{section}.{name}")


def _at_least(section: str, minimum: int, **values: int) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise SpecError(f"must be an integer >= {minimum}, got {v!r}", key=f"{section}.{name}")


@dataclass(kw_only=True)
class ModelConfig:
    """``[model]``: what is trained (the built-in job's tiny GPT)."""

    preset: ModelPreset = field(default="default", metadata={"flat": "model"})
    """``default`` (about 1.3M parameters) or ``tiny`` (tens of thousands, for tests)."""
    seed: int = 0
    """Seed of the model's initialization (every peer builds the same initial model)."""
    init_from: str | None = None
    """A file holding the model's ``state_dict`` (``torch.save(model.state_dict(), FILE)``) that
    every peer loads over its initialization: a pre-trained starting point for fine-tuning. The
    demo of ``zo`` makes one when none is given (see :mod:`isthmus.run.pretrain`)."""


@dataclass(kw_only=True)
class DataConfig:
    """``[data]``: what each peer trains on and how the data is split."""

    batch_size: int = 16
    """Sequences per peer per step."""
    corpus_bytes: int = 2_000_000
    """Bytes of the Python standard library's source used as the corpus."""
    shard: ShardMode = "interleaved"
    """How the corpus is split across peers: ``interleaved`` (IID) or ``contiguous`` (each
    peer a different part of the corpus: non-IID)."""
    seed: int = field(default=0, metadata={"flat": "data_seed"})
    """Seed of the data order."""
    global_batch: int = 0
    """DDP only: every committed step consumes exactly this many samples, split among the
    current peers (``batch_size`` is then the micro-batch); 0: ``batch_size`` per peer."""

    def __post_init__(self) -> None:
        _at_least("data", 1, batch_size=self.batch_size)
        _at_least("data", 0, global_batch=self.global_batch)
        _at_least("data", 10_000, corpus_bytes=self.corpus_bytes)


@dataclass(kw_only=True)
class OptimConfig:
    """``[optim]``: the (inner) optimizer every peer steps, AdamW."""

    lr: float = 1e-3
    """(Inner) learning rate of AdamW."""
    weight_decay: float = 0.1
    """AdamW's weight decay."""

    def __post_init__(self) -> None:
        _positive("optim", lr=self.lr)
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise SpecError(f"must be >= 0, got {self.weight_decay!r}", key="optim.weight_decay")


@dataclass(kw_only=True)
class StrategyConfig:
    """``[strategy]``: how peers synchronize, and with what compression and aggregation."""

    name: str = field(default="diloco", metadata={"flat": "strategy"})
    """The strategy (the command's description lists them)."""
    options: dict[str, Any] = field(
        default_factory=dict,
        metadata={"flat": "option", "metavar": "KEY=VALUE", "parse": parse_option},
    )
    """Strategy options (``--option KEY=VALUE``), checked by the strategy's config dataclass."""
    compression: str | None = None
    """Compressor spec for reductions: int8, uint8, fp8_e4m3, fp8_e5m2, int4, e3m0,
    topk:0.01+ef21, randk:0.01, powersgd:rank=2, sign, sketch:0.01, ..."""
    aggregator: str | None = None
    """Robust aggregator spec: median, trimmed_mean, krum, multi_krum, cc, gm, flag, nnm+krum, ..."""
    byzantine_f: int = 0
    """How many faulty peers the robust aggregator tolerates."""
    connections: int = 1
    """TCP connections per peer pair that each collective is striped over (every peer the same;
    more help on long fat links, see docs/LAB.md)."""
    probe_links: bool = False
    """Peers measure the round trip and rate between them when the membership changes (4 or
    more peers) and the coordinator orders the ring by them (docs/LAB.md, ring order)."""

    def __post_init__(self) -> None:
        _at_least("strategy", 0, byzantine_f=self.byzantine_f)
        _at_least("strategy", 1, connections=self.connections)
        if self.compression in ("", "none"):
            self.compression = None
        if self.aggregator in ("", "mean"):
            self.aggregator = None


@dataclass(kw_only=True)
class ByzantinePeer:
    """One byzantine peer: it sends forged updates from ``from_step`` on."""

    peer: int
    attack: str
    """Attack spec (``sign_flip``, ``ipm:tau=2``, ``alie``, ``gaussian``, ``nan``, ``label_flip``)."""
    from_step: int = 0


@dataclass(kw_only=True)
class FaultConfig:
    """``[faults]``: what goes wrong on purpose (kills, joins, any injected fault, attacks)."""

    kills: list[tuple[int, int]] = field(
        default_factory=list, metadata={"flat": "kill", "metavar": "PEER@STEP", "parse": parse_kill}
    )
    """(peer, step): that peer SIGKILLs itself when it reaches the step."""
    joins: list[int] = field(
        default_factory=list, metadata={"flat": "join", "metavar": "STEP", "parse": int}
    )
    """Steps at which a new peer process is launched."""
    peer_faults: dict[int, list[str]] = field(
        default_factory=dict,
        metadata={"flat": "fault", "metavar": "PEER:SPEC", "parse": parse_fault},
    )
    """More fault specs per peer index: kill|stop|fail|corrupt @ step|collective|commit
    :step=N or :round=N, e.g. 1:kill@collective:step=20; or a slow peer, slow:FACTOR or
    slow:FACTOR@START-END, e.g. 2:slow:3."""
    byzantine: list[ByzantinePeer] = field(
        default_factory=list,
        metadata={"flat": "byzantine", "metavar": "PEER:ATTACK", "parse": parse_byzantine},
    )
    """Byzantine peers and their attacks."""


@dataclass(kw_only=True)
class TimeoutConfig:
    """``[timeouts]``: every wait of the run is bounded by one of these (seconds)."""

    heartbeat_timeout: float = 3.0
    """The coordinator evicts a peer whose heartbeat is older than this."""
    collective_timeout: float = 30.0
    """Bound on building a process group and on every collective."""
    connect_timeout: float = 30.0
    """How long a peer keeps retrying an unreachable coordinator."""
    round_timeout: float = 300.0
    """How long a peer waits for a round to form before it gives up."""
    start_timeout: float = 120.0
    """How long the first round waits for every starting peer."""
    run_timeout: float = field(default=1800.0, metadata={"flat": "timeout"})
    """Bound on the whole run; peers still running after it are stopped."""

    def __post_init__(self) -> None:
        _positive("timeouts", **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})


@dataclass(kw_only=True)
class EvalConfig:
    """``[eval]``: held-out loss during and after training."""

    eval_every: int = 0
    """Evaluate each peer's model every this many steps (0: only at the end)."""
    eval_batches: int = 8
    """Batches per evaluation."""
    target_loss: float | None = None
    """Report the wall-clock at which the peers' mean eval loss first reached this."""

    def __post_init__(self) -> None:
        _at_least("eval", 0, eval_every=self.eval_every)
        _at_least("eval", 1, eval_batches=self.eval_batches)
        if self.target_loss is not None:
            _positive("eval", target_loss=self.target_loss)


@dataclass(kw_only=True)
class CheckpointConfig:
    """``[checkpoint]``: durable copies of the run (see :mod:`isthmus.checkpoint`)."""

    checkpoint_dir: str | None = None
    """Where checkpoints go: a directory or an fsspec URL (none: no checkpoints)."""
    checkpoint_every: int = 0
    """Write one every this many committed rounds (0: only at the end of the run)."""
    checkpoint_keep: int = 3
    """How many complete checkpoints to keep."""
    resume: str | None = None
    """Continue from the latest complete checkpoint in this directory or URL, on however many
    peers start."""

    def __post_init__(self) -> None:
        _at_least("checkpoint", 0, checkpoint_every=self.checkpoint_every)
        _at_least("checkpoint", 1, checkpoint_keep=self.checkpoint_keep)


@dataclass(kw_only=True)
class OutputConfig:
    """``[output]``: where results go and what is shown."""

    run_dir: str | None = None
    """Results directory (default runs/<time>-<name>); must not hold a run already."""
    summary_json: str | None = None
    """Also write the summary JSON here."""
    progress: bool = field(default=True, metadata={"negate": "no_progress"})
    """Show a live progress bar."""
    tensorboard: str | None = field(default=None, metadata={"metavar": "DIR"})
    """Write TensorBoard event files here, one run per peer (DIR/<peer name>): loss, learning
    rate, eval loss, bytes sent and world size per step. Needs the tensorboard package
    (pip install 'isthmus[tensorboard]')."""

    def __post_init__(self) -> None:
        if self.tensorboard is not None:
            import importlib.util

            # fail before any peer starts rather than in every peer at its first step
            if importlib.util.find_spec("tensorboard") is None:
                raise SpecError(
                    "needs the tensorboard package: pip install 'isthmus[tensorboard]'",
                    key="output.tensorboard",
                )


@dataclass(kw_only=True)
class RunConfig:
    """A whole run. Validated on construction; raises :class:`~isthmus.spec.SpecError` (a
    ValueError) naming the dotted key that is wrong."""

    name: str = ""
    """Label of the run (its directory and reports); default: the strategy's name."""
    peers: int = 3
    """Peer processes at the start."""
    steps: int = field(default=200, metadata={"preset": True})
    """Training steps of the run (the run's step counter, shared by all peers); the demo's
    default is 150 for ddp and 200 for the others."""
    threads: int = 1
    """torch threads per peer process."""
    step_delay: float = 0.0
    """Seconds each peer sleeps after each step (tests: keeps a tiny run alive for churn)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)

    def __post_init__(self) -> None:
        _at_least("run", 1, peers=self.peers, steps=self.steps, threads=self.threads)
        if not (math.isfinite(self.step_delay) and self.step_delay >= 0):
            raise SpecError(f"must be >= 0 seconds, got {self.step_delay!r}", key="step_delay")
        if not self.name:
            self.name = self.strategy.name
        if self.data.global_batch and self.strategy.name != "ddp":
            raise SpecError(
                f"a fixed global batch is DDP's; strategy {self.strategy.name!r} cannot take it",
                key="data.global_batch",
            )
        self._check_components()
        self._check_peers()

    @property
    def everyone(self) -> int:
        """Peer slots over the whole run: those at the start and one per join."""
        return self.peers + len(self.faults.joins)

    def _check_components(self) -> None:
        """Check the strategy, its options and every component spec with their registries
        (no model, no tensors); typed option values replace the raw ones."""
        from isthmus.comm.faults import Fault
        from isthmus.reduce.aggregate import make_aggregator
        from isthmus.reduce.aggregate.attacks import make_attack
        from isthmus.reduce.compress import make_compressor
        from isthmus.strategies import STRATEGIES

        s = self.strategy
        try:
            entry = STRATEGIES.lookup(s.name)
        except SpecError as e:
            raise SpecError(e.problem, key="strategy.name") from None
        options = strategy_options(s.name, s.options, self.steps)
        try:
            typed = entry.config(options)
        except SpecError as e:
            raise e.within("strategy.options") from None
        s.options = {k: getattr(typed, k) for k in s.options}
        for key, spec, factory in (
            ("strategy.compression", s.compression, make_compressor),
            ("strategy.aggregator", s.aggregator, make_aggregator),
        ):
            if spec is not None:
                try:
                    factory(spec)
                except (ValueError, TypeError) as e:
                    raise SpecError(f"bad spec {spec!r}: {e}", key=key) from None
        for i, b in enumerate(self.faults.byzantine):
            try:
                make_attack(b.attack)
            except (ValueError, TypeError) as e:
                raise SpecError(
                    f"bad attack {b.attack!r}: {e}", key=f"faults.byzantine[{i}]"
                ) from None
        for peer, specs in self.faults.peer_faults.items():
            for spec in specs:
                try:
                    Fault.parse(spec)
                except ValueError as e:
                    raise SpecError(str(e), key=f"faults.peer_faults[{peer}]") from None

    def _check_peers(self) -> None:
        n = self.everyone
        named = [("faults.kill", p) for p, _ in self.faults.kills]
        named += [("faults.fault", p) for p in self.faults.peer_faults]
        named += [("faults.byzantine", b.peer) for b in self.faults.byzantine]
        for key, peer in named:
            if not 0 <= peer < n:
                raise SpecError(
                    f"names peer {peer}, but there are peers 0..{n - 1} ({self.peers} start and "
                    f"{len(self.faults.joins)} join)",
                    key=key,
                )
        if self.faults.byzantine and len({b.peer for b in self.faults.byzantine}) >= n:
            raise SpecError(
                f"all {n} peers are byzantine; at least one must be honest", key="faults.byzantine"
            )


def strategy_options(name: str, options: Mapping[str, Any], steps: int) -> dict[str, Any]:
    """``options`` plus the run's length for a strategy whose schedule depends on it (one whose
    config has ``total_steps``, i.e. gossip), unless the options already name it."""
    from isthmus.strategies import STRATEGIES

    out = dict(options)
    cls = STRATEGIES.lookup(name).config_cls
    if cls is not None and "total_steps" in option_names(cls):
        out.setdefault("total_steps", steps)
    return out


# ---------------------------------------------------------------------------- flat names


@dataclass(frozen=True)
class Leaf:
    """One settable field of the tree: its flat name, its dotted path and its type hint."""

    flat: str
    path: tuple[str, ...]
    hint: Any
    field: dataclasses.Field[Any]
    owner: type

    @property
    def dotted(self) -> str:
        return ".".join(self.path)


def _walk(cls: type, prefix: tuple[str, ...]) -> Iterator[Leaf]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint) and isinstance(hint, type) and hint is not ByzantinePeer:
            yield from _walk(hint, (*prefix, f.name))
        else:
            yield Leaf(f.metadata.get("flat", f.name), (*prefix, f.name), hint, f, cls)


def leaves() -> dict[str, Leaf]:
    """Every leaf of :class:`RunConfig` by flat name. Raises RuntimeError if two share one."""
    out: dict[str, Leaf] = {}
    for leaf in _walk(RunConfig, ()):
        if leaf.flat in out:
            raise RuntimeError(
                f"flat name {leaf.flat!r} is used by {out[leaf.flat].dotted} and {leaf.dotted}"
            )
        out[leaf.flat] = leaf
    return out


def _find(key: str, table: dict[str, Leaf]) -> Leaf:
    if key in table:
        return table[key]
    for leaf in table.values():
        if leaf.dotted == key:
            return leaf
    names = [*table, *(leaf.dotted for leaf in table.values())]
    raise SpecError(f"unknown setting{suggest(key, names)}", key=key)


def _as_dict(cfg: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def _set_path(d: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for p in path[:-1]:
        d = d.setdefault(p, {})
    d[path[-1]] = value


def from_dict(data: Mapping[str, Any]) -> RunConfig:
    """Rebuild a :class:`RunConfig` from :func:`dataclasses.asdict` output (a job file, a run
    directory's ``config.json``). Unknown keys raise :class:`SpecError` naming them."""

    def build(cls: type, d: Mapping[str, Any], prefix: str) -> Any:
        if not isinstance(d, Mapping):
            raise SpecError(f"must be a table, got {d!r}", key=prefix or "run")
        hints = typing.get_type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {}
        for k, v in d.items():
            key = f"{prefix}.{k}" if prefix else k
            if k not in names:
                raise SpecError(f"unknown key{suggest(k, names)}", key=key)
            hint = hints[k]
            if dataclasses.is_dataclass(hint) and isinstance(hint, type):
                kw[k] = build(hint, v, key)
            elif k == "byzantine":
                kw[k] = [ByzantinePeer(**b) if isinstance(b, Mapping) else b for b in v]
            elif k == "peer_faults":
                kw[k] = {int(p): list(s) for p, s in v.items()}
            elif k == "kills":
                kw[k] = [tuple(x) for x in v]
            else:
                kw[k] = coerce(v, hint, key=key)
        return cls(**kw)

    return build(RunConfig, data, "")


_OPTION_PREFIXES = ("strategy.options.", "option.")


def apply_overrides(cfg: RunConfig, overrides: Mapping[str, Any]) -> RunConfig:
    """A new config with ``overrides`` applied and validated again. Keys are flat names
    (``batch_size``), dotted paths (``data.batch_size``) or one strategy option
    (``strategy.options.sync_every`` or ``option.sync_every``); string values are coerced through
    the field's type. Raises :class:`SpecError` naming a bad key or value."""
    table = leaves()
    data = _as_dict(cfg)
    if "name" not in overrides and data.get("name") == cfg.strategy.name:
        data["name"] = ""  # a derived name follows a changed strategy
    for key, value in overrides.items():
        option = next((key[len(p) :] for p in _OPTION_PREFIXES if key.startswith(p)), None)
        if option:
            data["strategy"]["options"][option] = value
            continue
        leaf = _find(key, table)
        if typing.get_origin(leaf.hint) not in (list, dict):
            value = coerce(value, leaf.hint, key=leaf.dotted)
        _set_path(data, leaf.path, value)
    return from_dict(data)


def from_flat(**values: Any) -> RunConfig:
    """A :class:`RunConfig` from flat names (``steps=30, model="tiny", batch_size=8,
    strategy="diloco", option={"sync_every": 5}``) or dotted paths given as ``**{"a.b": v}``."""
    return apply_overrides(RunConfig(), values)
