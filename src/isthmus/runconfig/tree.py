"""Flat names and nested tables of :class:`~isthmus.runconfig.sections.RunConfig`: every leaf by its
flat name (:func:`leaves`), a config from a table (:func:`from_dict`), from flat names
(:func:`from_flat`) or with overrides applied (:func:`apply_overrides`)."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from isthmus.runconfig.sections import ByzantinePeer, RunConfig
from isthmus.settings import check_keys
from isthmus.spec import SpecError, coerce, suggest

__all__ = ["Leaf", "apply_overrides", "from_dict", "from_flat", "leaves"]


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


def from_dict(data: Mapping[str, Any], *, strict: bool = False) -> RunConfig:
    """Build a :class:`RunConfig` from a nested table: :func:`dataclasses.asdict` output (a job
    file, a run directory's ``config.json``) or the run part of a scenario file. Values are
    coerced through each field's type (``strict``: typed sources, no text parsed). Raises
    :class:`SpecError` naming the dotted key: an unknown key (with the closest known one), a
    value of the wrong type or out of bounds."""

    def build(cls: type, d: Mapping[str, Any], prefix: str) -> Any:
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        kw: dict[str, Any] = {}
        for k, v in check_keys(d, prefix, names).items():
            key = f"{prefix}.{k}" if prefix else k
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
                kw[k] = coerce(v, hint, key=key, strict=strict)
        try:
            return cls(**kw)
        except SpecError:
            raise
        except (ValueError, TypeError) as e:  # a section without declared bounds (stragglers)
            raise SpecError(str(e), key=prefix) from None

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
