"""The embedded coordinator's TLS when the launcher's peers stand for other machines."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from isthmus.coordinator.tls import TLSFiles, self_signed

__all__ = ["embedded_tls"]


class _Hosts(Protocol):
    coordinator_host: str
    separate_hosts: bool


def embedded_tls(spawner: _Hosts, run_dir: Path) -> TLSFiles | None:
    """A self-signed certificate in ``run_dir/tls`` when ``spawner``'s peers stand for other
    machines (the lab's namespaces), so that the embedded coordinator serves TLS and each slot
    joins with a join token of its own, as across real machines (docs/SECURITY.md); None
    otherwise (one machine: plain HTTP and one token). Raises OSError when the directory
    cannot be written."""
    if not spawner.separate_hosts:
        return None
    return self_signed(str(run_dir / "tls"), hosts=[spawner.coordinator_host, "127.0.0.1"])
