"""``netns_exec.py NETNS -m isthmus.run.job JOB.json`` or ``netns_exec.py NETNS SCRIPT ARGS...``:
a peer inside network namespace ``NETNS``, forked from the warm server
(``isthmus.run.forkserver``), which has torch and the built-in job imported already. The forked
process enters the namespace's network (``isthmus.lab.netns.inside_namespace``), then does what
``ip netns exec NETNS python -m isthmus.run.job JOB.json`` (or ``python SCRIPT ARGS...``) does,
without a fresh interpreter's seconds of imports: every socket it opens and every process it
starts live in ``NETNS``. A namespace that cannot be entered ends the process with a
``LabError`` (exit status 1, the reason in its log) before it opens any socket.
"""

from __future__ import annotations

import os
import runpy
import sys

from isthmus.lab.netns import inside_namespace


def main(argv: list[str]) -> None:
    with inside_namespace(argv[0]):
        if argv[1:3] == ["-m", "isthmus.run.job"]:
            from isthmus.run.job import entry

            entry(argv[3:])  # ends the process
        script = argv[1]
        sys.argv = [script, *argv[2:]]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
