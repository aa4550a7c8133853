"""The ``isthmus`` command run inside the test's own process.

``run_cli("run", ...)`` parses and runs its arguments exactly as the console script does
(``isthmus.cli.main``), so the launcher, its embedded coordinator and its peers are the real
ones; what is saved is the fresh interpreter a subprocess would start for the launcher (torch
imported again), and, since the fork server belongs to the process that first starts a peer,
the server's own start on every run after the first one in a test worker. Tests that signal the
launcher itself, or that need two launchers standing for two machines, start it as a process.
"""

from __future__ import annotations

import contextlib
import io


def run_cli(*argv: str) -> tuple[int, str]:
    """Run ``isthmus ARGV...`` here; returns its exit status and everything it printed (stdout
    and stderr together). An argument error ends argparse with ``SystemExit``; its status is
    returned like any other."""
    from isthmus.cli import main

    said = io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        try:
            code = main(list(argv))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    return code, said.getvalue()
