"""A run of the built-in job, end to end: ``isthmus demo``, and ``isthmus lab run`` in namespaces.

This is the launching side: the code inside each peer process is :mod:`isthmus.run.job`, and a
user's own script is launched by :mod:`isthmus.run.script_run` instead. :func:`run_builtin` puts
the :class:`~isthmus.run.programs.BuiltinJob` program of a :class:`~isthmus.run.config.RunConfig`
in every peer slot of the one :class:`~isthmus.run.launch.Launcher`, with its planned kills and
joins, and writes the run directory: per-peer files, ``metrics.jsonl``, ``events.jsonl``,
``churn.jsonl`` and ``config.json``; :func:`publish` adds ``summary.json``, plots and
``report.md``.

:func:`demo_config` is the demo's preset (short runs: 150 steps of DDP or 200 of the others,
``sync_every`` 20 for every strategy that has one, so that a 200-step run syncs often enough to
show kills and joins; the library defaults are 20, local SGD's 80 and SparseLoCo's 10).
"""

from __future__ import annotations

import dataclasses
import sys
import urllib.parse
from typing import Any, TextIO

from isthmus.run.churn_hook import ChurnHook, plan_from_config
from isthmus.run.config import RunConfig, apply_overrides
from isthmus.run.launch import BuiltinJob, Hook, Launcher, Outcome, Spawner
from isthmus.run.record import RunDir, Summary
from isthmus.run.summarize import collect_metrics, summarize
from isthmus.spec import option_names

__all__ = [
    "DEMO_SYNC_EVERY",
    "DashboardLink",
    "dashboard_url",
    "demo_config",
    "initial_eval",
    "publish",
    "run_builtin",
    "run_demo",
]

DEMO_SYNC_EVERY = 20
"""H of the demo's (and the lab's) short runs, for strategies that have a ``sync_every``."""


def dashboard_url(address: str, token: str, tls: bool = False) -> str:
    """The coordinator's dashboard with the token in the URL's fragment: browsers never send a
    fragment to the server, and the page removes it from the address bar once it logged in."""
    scheme = "https" if tls else "http"
    return f"{scheme}://{address}/#token={urllib.parse.quote(token, safe='')}"


class DashboardLink(Hook):
    """Prints the live dashboard's URL once the coordinator is up (``isthmus demo``)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream
        self.url: str | None = None

    def start(self, launcher: Launcher) -> None:
        self.url = dashboard_url(launcher.address, launcher.token, launcher.fingerprint is not None)
        print(f"dashboard: {self.url}", file=self.stream or sys.stderr, flush=True)


def demo_config(overrides: dict[str, Any] | None = None) -> RunConfig:
    """The demo's preset with ``overrides`` (flat names or dotted paths) applied: 150 steps for
    DDP and 200 for the others unless ``steps`` is given, ``sync_every`` 20 for strategies that
    have it unless the options name it."""
    overrides = dict(overrides or {})
    cfg = apply_overrides(RunConfig(), overrides)
    if cfg.strategy.name == "zo":
        from isthmus.run.pretrain import zo_demo

        cfg = zo_demo(cfg)  # fine-tuning from a pre-trained model (made once, cached)
    changes: dict[str, Any] = {}
    if "steps" not in overrides:
        changes["steps"] = 150 if cfg.strategy.name == "ddp" else 200
    with_h = with_short_h(cfg.strategy.name, cfg.strategy.options)
    if with_h != cfg.strategy.options:
        changes["option"] = with_h
    return apply_overrides(cfg, changes) if changes else cfg


def with_short_h(strategy: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with ``sync_every`` = :data:`DEMO_SYNC_EVERY` if the strategy has one and the
    options do not name it."""
    from isthmus.strategies import STRATEGIES

    cls = STRATEGIES.lookup(strategy).config_cls
    if cls is not None and "sync_every" in option_names(cls) and "sync_every" not in options:
        return {**options, "sync_every": DEMO_SYNC_EVERY}
    return dict(options)


def initial_eval(run: RunConfig) -> tuple[float, int]:
    """Eval loss of the initial model (every peer's, before training) and its parameter count."""
    import torch

    from isthmus.data import evaluate
    from isthmus.run.job import build_corpus, build_model

    torch.set_num_threads(1)
    model = build_model(run)
    loss = evaluate(
        model, build_corpus(run), batch_size=run.data.batch_size, n_batches=run.eval.eval_batches
    )
    return loss, model.num_parameters()


def run_builtin(
    run: RunConfig,
    *,
    spawner: Spawner | None = None,
    hooks: list[Hook] | None = None,
    churn: ChurnHook | None = None,
    run_dir: RunDir | None = None,
    max_restarts: int = 0,
    slots: int | None = None,
) -> tuple[Summary, Outcome, RunDir]:
    """Launch ``run`` end to end and return its summary, the launch's outcome and the run
    directory (holding every peer's files, ``metrics.jsonl``, ``events.jsonl``, ``churn.jsonl``
    and ``config.json``; :func:`publish` adds the summary and the report). ``churn`` replaces
    the churn planned by ``run.faults`` (the lab passes its scenario's); ``slots`` the number of
    peer positions (default: ``run.everyone``).

    Raises FileExistsError if the run directory already holds a run; re-raises
    KeyboardInterrupt after tearing everything down.
    """
    run_dir = run_dir or RunDir.create(run.output.run_dir, run.name)
    if churn is None:
        events, n = plan_from_config(run)
        churn = ChurnHook(
            events, static_faults=run.faults.peer_faults, log_path=run_dir.path / "churn.jsonl"
        )
        slots = slots or n
    slots = slots or run.everyone
    run_dir.write_json("config.json", dataclasses.asdict(run))
    starting = churn.starting(slots)
    launcher = Launcher(
        BuiltinJob(run),
        run_dir=run_dir,
        slots=slots,
        starting=starting,
        timeouts=run.timeouts,
        spawner=spawner,
        max_restarts=max_restarts,
        hooks=[churn, *(hooks or [])],
        total_steps=run.steps,
        label=run.name,
        progress=run.output.progress,
        checkpoint_dir=run.checkpoint.checkpoint_dir,
        stragglers=run.stragglers,
    )
    outcome = launcher.run()
    initial_loss, n_params = initial_eval(run)
    s = run.strategy
    summary = summarize(
        outcome,
        run_dir,
        strategy=s.name,
        strategy_options=s.options,
        compression=s.compression,
        aggregator=s.aggregator,
        steps=run.steps,
        n_params=n_params,
        initial_loss=initial_loss,
        byzantine={f"peer{b.peer}": b.attack for b in run.faults.byzantine},
        starting=len(starting),
    )
    collect_metrics(outcome, run_dir)
    return summary, outcome, run_dir


def publish(summary: Summary, run_dir: RunDir, *, also: str | None = None) -> None:
    """Write ``summary.json`` (and a copy at ``also``), the plots and ``report.md``. A failure to
    plot never loses the run's results; without matplotlib (the ``lab`` extra) a line on stderr
    says that the plots and the report were skipped and how to install them."""
    run_dir.write_summary(summary, also=also)
    from isthmus.extras import MissingExtra

    try:
        from isthmus.run.report import plot_run

        plot_run(run_dir.path)
    except MissingExtra as e:
        print(f"plots and report skipped: {e}", file=sys.stderr)
    except Exception:  # a broken plot must not lose the summary already written
        pass


def run_demo(overrides: dict[str, Any] | None = None, *, max_restarts: int = 0) -> Summary:
    """The demo end to end from Python (benchmarks use it): :func:`demo_config` with
    ``overrides``, launched, its summary and report written; returns the summary."""
    cfg = demo_config(overrides)
    summary, _, run_dir = run_builtin(cfg, max_restarts=max_restarts)
    publish(summary, run_dir, also=cfg.output.summary_json)
    return summary
