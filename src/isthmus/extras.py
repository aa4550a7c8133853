"""Optional extras: the parts of isthmus whose dependency not every user needs.

``pip install isthmus`` brings what training, ``isthmus run``, ``isthmus demo``, the coordinator
(its dashboard and ``/metrics`` included) and the lab's runs need. Each extra below serves one
part, and ``pyproject.toml``'s ``[project.optional-dependencies]`` lists the same packages under
the same name (``tests/unit/test_extras.py`` checks that the two agree, and that ``dev`` has
them all):

* ``lab``: matplotlib, for the PNG plots of a run (``isthmus lab report``, ``isthmus lab
  compare``, the plots and ``report.md`` a demo or lab run writes at its end, a soak's plots);
* ``tensorboard``: TensorBoard event files (``--tensorboard DIR``);
* ``hf``: the Hugging Face integration (:mod:`isthmus.integrations.hf`).

Code that needs an extra imports it with :func:`require`, which raises :class:`MissingExtra` (an
ImportError) naming the extra to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["EXTRAS", "MissingExtra", "install_hint", "require"]

EXTRAS: dict[str, tuple[str, ...]] = {
    "lab": ("matplotlib",),
    "tensorboard": ("tensorboard",),
    "hf": ("transformers", "datasets", "accelerate"),
}
"""Each extra and the distributions it installs (their import names are the same)."""


class MissingExtra(ImportError):
    """A part of isthmus was used without the optional dependency it needs."""


def install_hint(extra: str) -> str:
    """The command that installs ``extra``: ``pip install 'isthmus[lab]'``. Raises KeyError for
    an extra that does not exist."""
    if extra not in EXTRAS:
        raise KeyError(f"no extra {extra!r}; extras: {', '.join(EXTRAS)}")
    return f"pip install 'isthmus[{extra}]'"


def require(module: str, *, extra: str, what: str) -> ModuleType:
    """Import ``module`` (e.g. ``matplotlib``) for ``what`` (e.g. "plotting a run"). Raises
    :class:`MissingExtra` saying what needs it and how to install ``extra`` when it cannot be
    imported; the original ImportError is its cause."""
    hint = install_hint(extra)
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtra(f"{what} needs {module.split('.')[0]}: {hint}") from e
