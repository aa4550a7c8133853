"""The sections of :class:`RunConfig` and the run itself, each field declared with its help text
and bounds (:func:`~isthmus.settings.setting`); the command line's text forms of the leaves that are
not plain scalars (``PEER@STEP``, ``PEER:SPEC``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from isthmus.coordinator.stragglers import StragglerConfig
from isthmus.settings import Checked, setting
from isthmus.spec import SpecError, option_names, parse_assignment

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
    "parse_byzantine",
    "parse_fault",
    "parse_kill",
    "parse_option",
    "parse_peer_spec",
    "strategy_options",
]

ModelPreset = Literal["default", "tiny", "medium"]
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


@dataclass(kw_only=True)
class ModelConfig(Checked):
    """``[model]``: what is trained (the built-in job's tiny GPT)."""

    SECTION = "model"

    preset: ModelPreset = setting(
        "default",
        flat="model",
        help="""default (4 layers, 1.3M parameters), tiny (2 layers, for tests) or medium
        (6 layers, 10.8M parameters, for thin-link benchmarks): the built-in GPT's size.""",
    )
    seed: int = setting(
        0, help="Seed of the model's initialization (every peer builds the same initial model)."
    )
    init_from: str | None = setting(
        None,
        help="""A file holding the model's state_dict (torch.save(model.state_dict(), FILE))
        that every peer loads over its initialization: a pre-trained starting point for
        fine-tuning. The demo of zo makes one when none is given.""",
    )

    def block_size(self) -> int:
        """Tokens per sequence of the preset's model."""
        from isthmus.models.gpt import GPTConfig

        return GPTConfig.preset(self.preset).block_size


@dataclass(kw_only=True)
class DataConfig(Checked):
    """``[data]``: what each peer trains on and how the data is split."""

    SECTION = "data"

    batch_size: int = setting(16, ge=1, help="Sequences per peer per step.")
    corpus_bytes: int = setting(
        2_000_000,
        ge=10_000,
        help="Bytes of the Python standard library's source used as the corpus.",
    )
    shard: ShardMode = setting(
        "interleaved",
        help="""How the corpus is split across peers: interleaved (IID) or contiguous (each peer
        a different part of the corpus: non-IID).""",
    )
    seed: int = setting(0, flat="data_seed", help="Seed of the data order.")
    global_batch: int = setting(
        0,
        ge=0,
        help="""DDP only: every committed step consumes exactly this many samples, split among
        the current peers (batch_size is then the micro-batch); 0: batch_size per peer.""",
    )


@dataclass(kw_only=True)
class OptimConfig(Checked):
    """``[optim]``: the (inner) optimizer every peer steps, AdamW."""

    SECTION = "optim"

    lr: float = setting(1e-3, gt=0, help="(Inner) learning rate of AdamW.")
    weight_decay: float = setting(0.1, ge=0, help="AdamW's weight decay.")


@dataclass(kw_only=True)
class StrategyConfig(Checked):
    """``[strategy]``: how peers synchronize, and with what compression and aggregation."""

    SECTION = "strategy"

    name: str = setting(
        "diloco", flat="strategy", help="The strategy (the command's description lists them)."
    )
    options: dict[str, Any] = setting(
        default_factory=dict,
        flat="option",
        metavar="KEY=VALUE",
        parse=parse_option,
        help="Strategy options (--option KEY=VALUE), checked by the strategy's config dataclass.",
    )
    compression: str | None = setting(
        None,
        help="""Compressor spec for reductions: int8, uint8, fp8_e4m3, fp8_e5m2, int4, e3m0,
        topk:0.01+ef21, randk:0.01, powersgd:rank=2, sign, sketch:0.01, ...""",
    )
    aggregator: str | None = setting(
        None,
        help="""Robust aggregator spec: median, trimmed_mean, krum, multi_krum, cc, gm, flag,
        nnm+krum, ...""",
    )
    byzantine_f: int = setting(
        0, ge=0, help="How many faulty peers the robust aggregator tolerates."
    )
    connections: int = setting(
        1,
        ge=1,
        help="""TCP connections per peer pair that each collective is striped over (every peer
        the same; more help on long fat links, see docs/LAB.md).""",
    )
    probe_links: bool = setting(
        False,
        help="""Peers measure the round trip and rate between them when the membership changes
        (4 or more peers) and the coordinator orders the ring by them (docs/LAB.md, ring
        order).""",
    )
    pipeline_commit: bool = setting(
        True,
        negate="no_pipeline_commit",
        switch=True,
        help="""Peers send a round's commit vote and the next begin in the background while the
        next step computes, applying the result tentatively with an undo copy (ddp, diloco,
        localsgd; docs/PROTOCOL.md). On by default.""",
    )
    mesh: bool = setting(
        False,
        help="""Peers carry their tensors inside a WireGuard mesh the run sets up (encrypted and
        authenticated; peers behind NAT need no open port). Needs root and WireGuard
        (wireguard-go); see docs/SECURITY.md.""",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
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

    kills: list[tuple[int, int]] = setting(
        default_factory=list,
        flat="kill",
        metavar="PEER@STEP",
        parse=parse_kill,
        help="(peer, step): that peer SIGKILLs itself when it reaches the step.",
    )
    joins: list[int] = setting(
        default_factory=list,
        flat="join",
        metavar="STEP",
        parse=int,
        help="Steps at which a new peer process is launched.",
    )
    peer_faults: dict[int, list[str]] = setting(
        default_factory=dict,
        flat="fault",
        metavar="PEER:SPEC",
        parse=parse_fault,
        help="""More fault specs per peer index: kill|stop|fail|corrupt @ step|collective|commit
        :step=N or :round=N, e.g. 1:kill@collective:step=20; or a slow peer, slow:FACTOR or
        slow:FACTOR@START-END, e.g. 2:slow:3.""",
    )
    byzantine: list[ByzantinePeer] = setting(
        default_factory=list,
        flat="byzantine",
        metavar="PEER:ATTACK",
        parse=parse_byzantine,
        help="Byzantine peers and their attacks.",
    )


@dataclass(kw_only=True)
class TimeoutConfig(Checked):
    """``[timeouts]``: the bounds of the run's waits (seconds). Transfers are bounded by their
    progress (``stall_s``, ``late_s``), not by their length; the whole run by ``run_timeout``
    when it is set."""

    SECTION = "timeouts"

    heartbeat_timeout: float = setting(
        3.0, gt=0, help="The coordinator evicts a peer whose heartbeat is older than this."
    )
    collective_timeout: float = setting(
        30.0,
        gt=0,
        help="""The connect bound: how long building an epoch's process group may take. A
        collective is not bounded by it: it runs while its bytes move (stall_s, late_s).""",
    )
    connect_timeout: float = setting(
        30.0, gt=0, help="How long a peer keeps retrying an unreachable coordinator."
    )
    round_timeout: float = setting(
        300.0, gt=0, help="How long a peer waits for a round to form before it gives up."
    )
    start_timeout: float = setting(
        120.0, gt=0, help="How long the first round waits for every starting peer."
    )
    run_timeout: float | None = setting(
        1800.0,
        gt=0,
        flat="timeout",
        help="""Bound on the whole run; peers still running after it are stopped (none: no
        bound). `isthmus run` has none unless --timeout is given.""",
    )
    stall_s: float = setting(
        10.0,
        gt=0,
        help="""A collective or state transfer whose connection holds data the remote has not
        acknowledged for this long is stuck (the path or the remote host is gone): the attempt
        fails naming that member. A slow transfer whose bytes move is never stuck.""",
    )
    late_s: float = setting(
        600.0,
        gt=0,
        help="""A collective or state transfer that moves no byte at all for this long is stuck
        (a member late to it, or one that takes no data); dead or stopped peers are evicted by
        heartbeat long before. At least stall_s.""",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.late_s < self.stall_s:
            raise SpecError(
                f"must be at least stall_s ({self.stall_s}), got {self.late_s}",
                key="timeouts.late_s",
            )


@dataclass(kw_only=True)
class EvalConfig(Checked):
    """``[eval]``: held-out loss during and after training."""

    SECTION = "eval"

    eval_every: int = setting(
        0, ge=0, help="Evaluate each peer's model every this many steps (0: only at the end)."
    )
    eval_batches: int = setting(8, ge=1, help="Batches per evaluation.")
    target_loss: float | None = setting(
        None,
        gt=0,
        help="Report the wall-clock at which the peers' mean eval loss first reached this.",
    )


@dataclass(kw_only=True)
class CheckpointConfig(Checked):
    """``[checkpoint]``: durable copies of the run (see :mod:`isthmus.checkpoint`)."""

    SECTION = "checkpoint"

    checkpoint_dir: str | None = setting(
        None, help="Where checkpoints go: a directory or an fsspec URL (none: no checkpoints)."
    )
    checkpoint_every: int = setting(
        0, ge=0, help="Write one every this many committed rounds (0: only at the end of the run)."
    )
    checkpoint_keep: int = setting(3, ge=1, help="How many complete checkpoints to keep.")
    resume: str | None = setting(
        None,
        help="""Continue from the latest complete checkpoint in this directory or URL, on however
        many peers start.""",
    )


@dataclass(kw_only=True)
class OutputConfig:
    """``[output]``: where results go and what is shown."""

    run_dir: str | None = setting(
        None, help="Results directory (default runs/<time>-<name>); must not hold a run already."
    )
    summary_json: str | None = setting(None, help="Also write the summary JSON here.")
    progress: bool = setting(True, negate="no_progress", help="Show a live progress bar.")
    tensorboard: str | None = setting(
        None,
        metavar="DIR",
        help="""Write TensorBoard event files here, one run per peer (DIR/<peer name>): loss,
        learning rate, eval loss, bytes sent and world size per step. Needs the tensorboard
        package (pip install 'isthmus[tensorboard]').""",
    )

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
class RunConfig(Checked):
    """A whole run. Validated on construction; raises :class:`~isthmus.spec.SpecError` (a
    ValueError) naming the dotted key that is wrong."""

    SECTION = "run"

    name: str = setting(
        "", help="Label of the run (its directory and reports); default: the strategy's name."
    )
    peers: int = setting(3, ge=1, help="Peer processes at the start.")
    steps: int = setting(
        200,
        ge=1,
        preset=True,
        help="""Training steps of the run (the run's step counter, shared by all peers); the
        demo's default is 150 for ddp and 200 for the others.""",
    )
    threads: int = setting(1, ge=1, help="torch threads per peer process.")
    nproc_per_peer: int = setting(
        1,
        ge=1,
        help="""Processes per peer: above 1 each peer is an island of that many ranks, the model
        sharded among them with FSDP2, one membership slot (diloco and ddp run on islands).""",
    )
    step_delay: float = setting(
        0.0,
        ge=0,
        help="Seconds each peer sleeps after each step (tests: keeps a tiny run alive for churn).",
    )
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
        super().__post_init__()
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
        for what, spec, factory in (
            ("compression", s.compression, make_compressor),
            ("aggregator", s.aggregator, make_aggregator),
        ):
            if spec is not None:
                try:
                    factory(spec)
                except (ValueError, TypeError) as e:
                    raise SpecError(
                        f"bad {what} spec {spec!r}: {e}", key=f"strategy.{what}"
                    ) from None
        for i, b in enumerate(self.faults.byzantine):
            try:
                make_attack(b.attack)
            except (ValueError, TypeError) as e:
                raise SpecError(
                    f"bad attack spec {b.attack!r}: {e}", key=f"faults.byzantine[{i}]"
                ) from None
        for peer, specs in self.faults.peer_faults.items():
            for j, spec in enumerate(specs):
                try:
                    Fault.parse(spec)
                except ValueError as e:
                    raise SpecError(str(e), key=f"faults.peer_faults[{peer}][{j}]") from None

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
