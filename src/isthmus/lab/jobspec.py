"""What runs in a scenario's peers: the built-in job, or the user's own script (``[job]``).

A scenario file may name a script::

    [job]
    script = "train.py"              # relative to the scenario file
    args = ["--steps", "30"]         # its arguments (optional)
    nproc_per_peer = 2               # optional: each peer an island of 2 ranks ([2, 1]: per peer)

and ``isthmus lab run scenario.toml --script train.py -- ARGS`` names one on the command line
(which wins over the file's). The script is an ordinary peer script, the kind ``isthmus run``
starts: it finds the run with :meth:`isthmus.SessionConfig.from_env` and brings its own model,
data and strategy, so the scenario's ``[strategy]`` is optional for it.

``[[fault]]`` entries reach a script's session (``ISTHMUS_FAULTS``, read by
:meth:`isthmus.SessionConfig.from_env`), which fires them at its own points (a step, a round's
collective, its commit, a checkpoint). What a script cannot take is refused before anything
starts (:func:`check_script_scenario`): a ``slow`` fault paces the built-in job's training loop,
which a script does not run; ``[[byzantine]]`` attacks act on the built-in job's update path;
and ``[checkpoint]`` configures the built-in job's saves (a script passes ``checkpoint_dir`` to
its own ``SessionConfig``).
With ``nproc_per_peer`` each peer is an *island* (what ``isthmus run --nproc-per-peer`` starts:
torchrun's environment for each rank, FSDP2 inside): all its ranks run in the peer's own
network namespace, behind its one link, so the WAN shapes only what crosses islands.
Churn (``[[churn]]``, ``[random_churn]``) works on a script: the launcher applies it from
outside, a kill or stop at a step once a peer reported that step (``session.report(step=...)``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from isthmus.lab.checks import check_str
from isthmus.settings import check_keys
from isthmus.spec import SpecError

__all__ = ["JobSpec", "check_script_scenario", "parse_job", "script_spec"]

_JOB_KEYS = ("script", "args", "nproc_per_peer")


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """``[job]``: the peers run ``python script args...`` (``script`` an absolute path)."""

    script: str
    args: tuple[str, ...] = ()
    nproc_per_peer: tuple[int, ...] = (1,)
    """Ranks per peer (peer ``i`` has ``nproc_per_peer[i % len]``); above 1 a peer is an
    island of that many processes in its namespace."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "args", tuple(self.args))
        object.__setattr__(self, "nproc_per_peer", tuple(self.nproc_per_peer))

    def to_json(self) -> dict[str, Any]:
        """As ``[job]`` is written (``nproc_per_peer`` only when a peer has several ranks)."""
        out: dict[str, Any] = {"script": self.script, "args": list(self.args)}
        if self.nproc_per_peer != (1,):
            out["nproc_per_peer"] = list(self.nproc_per_peer)
        return out


def script_spec(
    script: str | Path, args: Sequence[str] = (), *, key: str = "job.script"
) -> JobSpec:
    """A :class:`JobSpec` for ``script`` (resolved against the working directory). Raises
    :class:`~isthmus.spec.SpecError` under ``key`` naming the path when it is not a file."""
    p = Path(script).expanduser().resolve()
    if not p.is_file():
        raise SpecError(f"no such script: {p}", key=key)
    return JobSpec(script=str(p), args=tuple(str(a) for a in args))


def parse_job(raw: Any, base_dir: str | Path | None) -> JobSpec:
    """``[job]`` as written: ``script`` (a path relative to ``base_dir``, the scenario file's
    folder; the working directory when None), ``args`` (a list of strings) and
    ``nproc_per_peer`` (an int or a list of ints >= 1). Raises :class:`~isthmus.spec.SpecError`
    naming ``job.script`` when the file does not exist (with the path it looked at),
    ``job.args[i]`` for an argument that is not a string, and ``job.nproc_per_peer`` for a
    count that is not an int >= 1."""
    t = check_keys(raw, "job", _JOB_KEYS, ["script"])
    script = check_str(t["script"], "job.script")
    args = t.get("args", [])
    if not isinstance(args, list):
        raise SpecError(f"must be a list of strings, got {args!r}", key="job.args")
    for i, a in enumerate(args):
        if not isinstance(a, str):
            raise SpecError(f"must be a string, got {a!r}", key=f"job.args[{i}]")
    nproc = t.get("nproc_per_peer", 1)
    counts = nproc if isinstance(nproc, list) else [nproc]
    if not counts or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in counts):
        raise SpecError(
            f"must be an int >= 1 or a list of them (ranks per peer), got {nproc!r}",
            key="job.nproc_per_peer",
        )
    path = Path(script).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    if not path.is_file():
        raise SpecError(
            f"no such script: {path.resolve()} (a relative path is read from the scenario "
            "file's folder)",
            key="job.script",
        )
    return JobSpec(script=str(path.resolve()), args=tuple(args), nproc_per_peer=tuple(counts))


def check_script_scenario(
    *,
    peer_faults: Mapping[int, Sequence[str]],
    byzantine: Sequence[Any],
    checkpoint: bool,
    source: str = "",
) -> None:
    """Refuse what a user script cannot take (see the module docstring). ``peer_faults`` are the
    ``[[fault]]`` specs by peer in file order, ``byzantine`` the ``[[byzantine]]`` entries
    (with ``attack``), ``checkpoint`` whether the file has ``[checkpoint]``. Raises
    :class:`~isthmus.spec.SpecError` naming the key and, for a fault, its kind."""
    from isthmus.comm.faults import Fault

    for peer, specs in peer_faults.items():
        for spec in specs:
            if Fault.parse(spec).action == "slow":
                raise SpecError(
                    f"a user script cannot take 'slow' faults (peer {peer}: {spec}): they pace "
                    "the built-in job's training loop; kill, stop, fail and corrupt faults reach "
                    "a script's session",
                    key="fault",
                    source=source,
                )
    for j, b in enumerate(byzantine):
        raise SpecError(
            f"a user script cannot take byzantine attacks ({b.attack!r}): the built-in job "
            "applies them to its own updates",
            key=f"byzantine[{j}]",
            source=source,
        )
    if checkpoint:
        raise SpecError(
            "[checkpoint] configures the built-in job's saves; a user script saves its own "
            "(SessionConfig(checkpoint_dir=...)): remove the section",
            key="checkpoint",
            source=source,
        )
