"""Command-line flags generated from :class:`~isthmus.run.config.RunConfig`, not copied by hand.

Every leaf of the config becomes ``--<flat-name>`` (``data.batch_size`` is ``--batch-size``), with
the help text its field declares (:func:`~isthmus.settings.setting`: it is in the field's metadata, so
an installed package has it too) and its default shown; a bool that defaults to true gets its
``negate`` name (``--no-progress``; with ``switch`` in its metadata also its plain name, hidden
from the help, for commands written before it was on), one that defaults to false is a switch
(``--probe-links``);
list and dict leaves repeat (``--kill 1@20 --kill 2@30``) through the parser in their metadata. Every flag's value is a string that
:func:`~isthmus.run.config.apply_overrides` coerces through the field's type, so a flag, a
``--set data.batch_size=8`` and a scenario key are checked by the same code. Only flags the user
gave become overrides: a command's own preset (the demo's, a scenario's) stays in force otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable, Iterable
from typing import Any, Literal

from isthmus.run.config import Leaf, leaves
from isthmus.spec import SpecError, parse_assignment

__all__ = ["SHORTCUTS", "add_config_flags", "field_docs", "overrides_from"]

_PREFIX = "cfg:"

SHORTCUTS: dict[str, tuple[Callable[[str], Any], str]] = {
    "sync_every": (
        int,
        "H of diloco, localsgd, streaming, eager, sparseloco; tau of co2 (the demo: 20)",
    ),
    "topology": (str, "gossip topology: ring, torus, exponential, ..."),
    "schedule": (str, "gossip schedule: constant, late-heavy, single-merge"),
}
"""Strategy options with flags of their own (``--sync-every 10`` is ``--option sync_every=10``)."""


def field_docs(cls: type) -> dict[str, str]:
    """The help text of each field of config dataclass ``cls``, from the ``help`` in its metadata
    (see :func:`~isthmus.settings.setting`): present in an installed package, no source needed."""
    return {f.name: f.metadata["help"] for f in dataclasses.fields(cls) if f.metadata.get("help")}


def _metavar(leaf: Leaf) -> str | None:
    if "metavar" in leaf.field.metadata:
        return str(leaf.field.metadata["metavar"])
    hint = leaf.hint
    for t, name in ((int, "N"), (float, "X"), (str, "TEXT")):
        if hint is t or hint == t | None:
            return name
    return None


def _default_text(leaf: Leaf) -> str:
    f = leaf.field
    if f.metadata.get("preset"):
        return ""  # the command's preset decides (the demo's steps depend on the strategy)
    if f.default is not dataclasses.MISSING and f.default not in (None, "", ()):
        return f" (default {f.default})"
    return ""


def add_config_flags(
    parser: argparse.ArgumentParser,
    *,
    include: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
    shortcuts: bool = False,
) -> None:
    """Add a flag for every leaf (or the flat names in ``include``, minus ``exclude``), plus the
    strategy option shortcuts and ``--set KEY=VALUE`` (a dotted path or a flat name)."""
    table = leaves()
    names = list(include) if include is not None else list(table)
    skip = set(exclude)
    group = parser.add_argument_group("run settings")
    for flat in names:
        if flat in skip:
            continue
        leaf = table[flat]
        doc = leaf.field.metadata.get("help", "")
        dest = _PREFIX + flat
        meta = leaf.field.metadata
        if leaf.hint is bool and "negate" in meta:
            if meta.get("switch"):  # on by default, its switch kept: commands that name it parse
                _const_flag(group, flat, dest, "true", argparse.SUPPRESS)
            negated = f"do not: {doc[0].lower() + doc[1:]}" if doc else None
            _const_flag(group, meta["negate"], dest, "false", negated)
            continue
        if leaf.hint is bool and leaf.field.default is False:  # a switch: --probe-links
            _const_flag(group, flat, dest, "true", doc or None)
            continue
        repeat = "parse" in meta
        choices = None
        if typing.get_origin(leaf.hint) is Literal:
            choices = list(typing.get_args(leaf.hint))
        group.add_argument(
            "--" + flat.replace("_", "-"),
            dest=dest,
            action="append" if repeat else "store",
            default=argparse.SUPPRESS,
            metavar=_metavar(leaf) if choices is None else None,
            choices=choices,
            help=(doc + (" (repeatable)" if repeat else _default_text(leaf))) or None,
        )
    if shortcuts:
        for key, (_, help_text) in SHORTCUTS.items():
            group.add_argument(
                "--" + key.replace("_", "-"),
                dest=f"short:{key}",
                default=argparse.SUPPRESS,
                metavar=key.upper(),
                help=help_text,
            )
    group.add_argument(
        "--set",
        dest="cfg_set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any run setting by dotted path or flat name, e.g. --set data.batch_size=8 (repeatable)",
    )


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the user gave on the command line, as overrides for
    :func:`~isthmus.run.config.apply_overrides`. Raises :class:`SpecError` naming a bad value."""
    table = leaves()
    out: dict[str, Any] = {}
    for dest, value in vars(args).items():
        if not dest.startswith(_PREFIX):
            continue
        flat = dest[len(_PREFIX) :]
        leaf = table[flat]
        parse = leaf.field.metadata.get("parse")
        if parse is None:
            out[flat] = value
            continue
        try:
            items = [parse(v) for v in value]
        except ValueError as e:
            raise SpecError(str(e)) from None
        if typing.get_origin(leaf.hint) is dict:
            grouped: dict[Any, Any] = {}
            if flat == "option":
                grouped = dict(items)
            else:
                for k, v in items:
                    grouped.setdefault(k, []).append(v)
            out[flat] = grouped
        else:
            out[flat] = items
    shortcut = {k.split(":", 1)[1]: v for k, v in vars(args).items() if k.startswith("short:")}
    if shortcut:
        out["option"] = {**out.get("option", {}), **shortcut}
    for text in getattr(args, "cfg_set", []) or []:
        key, value = parse_assignment(text, flag="--set")
        out[key] = value
    return out


def _const_flag(group: Any, name: str, dest: str, const: str, help: str | None) -> None:
    """``--name`` sets ``dest`` to ``const`` (a boolean setting's text); absent, it sets nothing."""
    group.add_argument(
        "--" + name.replace("_", "-"),
        dest=dest,
        action="store_const",
        const=const,
        default=argparse.SUPPRESS,
        help=help,
    )
