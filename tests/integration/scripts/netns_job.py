"""``netns_job.py NETNS JOB.json``: the built-in peer job inside network namespace ``NETNS``, for
a peer forked from the warm server (``isthmus.run.forkserver``), which has torch and the job
imported already: the forked process joins the namespace's network (``setns``), then does what
``ip netns exec NETNS python -m isthmus.run.job JOB.json`` does, without a fresh interpreter's
seconds of imports. A namespace that cannot be joined ends the process with an ``OSError``
(exit status 1, the reason in its log) before any socket is opened.
"""

from __future__ import annotations

import ctypes
import os
import sys

CLONE_NEWNET = 0x40000000


def join_netns(netns: str) -> None:
    """Move this (single-threaded, freshly forked) process into ``netns``'s network: every
    socket it opens from now on lives there."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {netns}")
    finally:
        os.close(fd)


if __name__ == "__main__":
    join_netns(sys.argv[1])
    from isthmus.run.job import entry

    entry(sys.argv[2:])
