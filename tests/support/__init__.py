"""Helpers shared by tests/unit and tests/integration: fake sessions, hand-written references,
model builders and constants, one module per topic (``from support.zo import ...``).

pytest puts ``tests/`` on ``sys.path`` (the directory of ``tests/conftest.py``, which has no
``__init__.py``), so this package imports the same way from either side and when a single test
file is run. Unit tests import from it: nothing here opens a socket or starts a process at
import; the helpers that build in-process Gloo groups do so only when called.
"""
