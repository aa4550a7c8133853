"""The names a launcher gives its peers: ``peer0``, ``peer1``... on one machine, and names no
other machine's launcher gives when several launchers join one coordinator.

A slot's first process is named ``<prefix>-peer<i>`` (``peer<i>`` with no prefix) and its
restarts ``<prefix>-peer<i>.1``, ``.2``...: everything before the first dot is the slot
(:func:`isthmus.checkpoint.slot_of`), which names the slot's local state in checkpoints, so a
prefix never holds a dot. The prefix is

* none for a launcher with its own coordinator (every peer of the run is its own);
* the one given (``isthmus run --name-prefix``), checked by :func:`check_prefix`;
* otherwise, joining a coordinator elsewhere, this machine's: its short host name and four hex
  digits of its identity (``/etc/machine-id``, else its network address), so that two machines
  with the same host name still differ, and the same machine gets the same names at every
  launch, which lets a resumed peer find its own local state in a checkpoint
  (:func:`machine_prefix`). A second launcher on the same machine for the same coordinator
  gets ``-2`` after it, a third ``-3``: each claims its prefix with a lock held while it runs
  (:class:`PrefixClaim`), so launchers started together never share one.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import socket
import tempfile
import uuid
from pathlib import Path

import xxhash

__all__ = ["PrefixClaim", "check_prefix", "machine_prefix", "peer_name"]

log = logging.getLogger("isthmus.launch")

_PREFIX = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,39}$")
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


def check_prefix(prefix: str) -> str:
    """``prefix`` if it can start peer names: 1-40 letters, digits, ``_`` and ``-``, starting
    with a letter or digit (no dot: a dot separates a slot from its restarts). Raises
    ValueError naming the rule otherwise."""
    if not _PREFIX.match(prefix):
        raise ValueError(
            f"name prefix {prefix!r}: use 1-40 letters, digits, '_' or '-', starting with a "
            "letter or digit (no '.': it separates a peer from its restarts)"
        )
    return prefix


def peer_name(prefix: str, slot: int, incarnation: int = 0) -> str:
    """The name of ``slot``'s process number ``incarnation`` (0: the first) under ``prefix``
    (``""``: none)."""
    base = f"{prefix}-peer{slot}" if prefix else f"peer{slot}"
    return base if incarnation == 0 else f"{base}.{incarnation}"


def _identity() -> str:
    """What tells this machine from others with the same host name: its machine id, else the
    address of a network interface; ``""`` when neither is known (uuid makes up a random
    address, with the multicast bit set, when it finds none)."""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        with contextlib.suppress(OSError):
            text = Path(path).read_text().strip()
            if text:
                return text
    node = uuid.getnode()
    return "" if node >> 40 & 1 else f"{node:012x}"


def machine_prefix() -> str:
    """This machine's prefix: its host name up to the first dot, with anything but letters,
    digits, ``_`` and ``-`` replaced by ``-`` (at most 24 characters; ``host`` when nothing
    is left), then ``-`` and four hex digits of its identity when one is known. The same on
    every call on one machine."""
    host = _UNSAFE.sub("-", socket.gethostname().split(".", 1)[0]).strip("-_")[:24] or "host"
    ident = _identity()
    return check_prefix(f"{host}-{xxhash.xxh32_hexdigest(ident.encode())[:4]}" if ident else host)


class PrefixClaim:
    """The first of ``base``, ``base-2``, ``base-3``... that no other launcher on this machine
    holds for the coordinator at ``coordinator``, held until :meth:`release` (or until this
    process ends): an exclusive lock on a file per name in a folder of the user's under the
    temporary directory. The lowest free one is taken, so a launcher started again after the
    others ended gets its old prefix back. Where no lock file can be made (a read-only
    temporary directory) it takes ``base`` unclaimed and logs a warning. Raises RuntimeError
    when 100 launchers hold the names already."""

    def __init__(self, base: str, coordinator: str) -> None:
        self.prefix = check_prefix(base)
        self._fd: int | None = None
        folder = Path(tempfile.gettempdir()) / f"isthmus-names-{os.getuid()}"
        where = _UNSAFE.sub("-", coordinator)
        for k in range(1, 101):
            prefix = check_prefix(base if k == 1 else f"{base}-{k}")
            try:
                folder.mkdir(mode=0o700, exist_ok=True)
                fd = os.open(folder / f"{where}--{prefix}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            except OSError as e:
                log.warning("peer names %s-peer<i> not claimed (%s): give --name-prefix", base, e)
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.prefix, self._fd = prefix, fd
            return
        raise RuntimeError(f"100 launchers on this machine hold peer names {base}-... already")

    def release(self) -> None:
        """Let another launcher take the prefix (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)  # closing the file drops its lock
            self._fd = None
