"""Suite-wide test settings.

Tests marked ``@pytest.mark.slow`` are skipped (with a visible reason in the summary) unless
``ISTHMUS_SLOW=1`` is set, which ``make test-slow`` does. ``make test`` stays well under its
10-minute budget on 2 cores.
"""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("ISTHMUS_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow test: run `make test-slow` (ISTHMUS_SLOW=1) to include it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
