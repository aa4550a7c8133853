"""One typed description of a run: :class:`RunConfig` and its sections, every default in one place.

The demo, the lab and the built-in peer job all read a :class:`RunConfig`; a lab scenario file is
a RunConfig plus the lab's own sections (:mod:`isthmus.lab.scenario` reads both with one loader).
Its sections are keyword-only dataclasses checked on construction: each field is declared with
:func:`~isthmus.settings.setting`, which holds its help text (the command line's flag help) and its
bounds, and one function (:func:`~isthmus.settings.check_settings`) enforces them. The whole config is
validated without building a model (strategy options through the strategy's own config dataclass,
compressor, aggregator, attack and fault specs through their registries), so a bad setting fails
once, early, with the dotted key that is wrong (``strategy.options.outer_lr: must be a number,
got 'x'``).

Every leaf field also has a *flat name*, unique across the tree (its field name, or the
``flat`` in its metadata: ``model.preset`` is ``model``, ``data.seed`` is ``data_seed``). Flat
names are the command line's flags (``--batch-size``, generated in :mod:`isthmus.run.flags`),
the keys :func:`from_flat` takes, and what ``--set`` accepts besides dotted paths.

The package sits below the lab and the runner, which both import it; :mod:`isthmus.run.config`
is the same API under the runner's name. It reads the registries of strategies, compressors,
aggregators, attacks and faults to check a config. Never imports lab, integrations, run or cli.
"""

from isthmus.runconfig import sections, tree
from isthmus.runconfig.sections import *  # noqa: F403
from isthmus.runconfig.tree import *  # noqa: F403

__all__ = sorted([*sections.__all__, *tree.__all__])
