"""Suite-wide test settings and the fixtures tests/unit and tests/integration share.

Tests marked ``@pytest.mark.slow`` are skipped (with a visible reason in the summary) unless
``ISTHMUS_SLOW=1`` is set, which ``make test-slow`` does. ``make test`` stays under its
10-minute budget on 2 cores with several pytest-xdist workers (the Makefile's ``TEST_WORKERS``).

Shared helpers that are not fixtures live in the ``support`` package beside this file.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from isthmus.data import Corpus


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # tests/integration first, tests/unit last: under `make test`'s workers (pytest-xdist hands
    # tests out in this order) the thousand quick one-process tests then fill the gaps the long
    # multi-process runs leave at the end, instead of those runs finishing alone
    items.sort(key=lambda item: "tests/unit/" in item.nodeid)
    if os.environ.get("ISTHMUS_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow test: run `make test-slow` (ISTHMUS_SLOW=1) to include it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Torch on one thread for the module, the count before restored after it: tiny tensors gain
    nothing from threads on a loaded 2-core machine, and bit-for-bit comparisons need the same
    kernels (convolutions sum in another order on another number of threads). A module opts in
    with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    """The stdlib corpus cut to 100,000 bytes, built once per module."""
    return Corpus.from_stdlib(max_bytes=100_000)
