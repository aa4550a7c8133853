"""The peers' output on the launcher's terminal, each line prefixed with its peer.

Every peer process writes its stdout and stderr to its log in the run directory
(``runs/<run>/peerN.log``); :class:`LogTee` follows those files and hands each complete new line
to a callback as ``[peerN] line``, so ``isthmus run`` shows what a script prints as torchrun does
with ``--tee``, while the files stay the record. Lines are read as the peers flush them (peers run
with ``PYTHONUNBUFFERED=1``); a line still being written is held until its newline, or until
:meth:`LogTee.close` hands over what is left.

Reading is bounded: one :meth:`LogTee.pump` reads at most ``chunk`` bytes of each file, so a peer
that prints without pause cannot hold up the launcher's loop. A log that cannot be read (not yet
created, or removed) is skipped until it can.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LogTee"]


@dataclass
class _Followed:
    path: Path
    offset: int = 0
    partial: bytes = b""
    caught_up: bool = False
    """Whether the last read reached the end of what the file held then."""


class LogTee:
    """Follows peers' log files; ``emit`` receives each of their lines, prefixed."""

    def __init__(self, emit: Callable[[str], None], *, chunk: int = 1 << 20) -> None:
        self.emit = emit
        self.chunk = chunk
        self._files: dict[str, _Followed] = {}

    def follow(self, name: str, path: Path) -> None:
        """Show ``path``'s lines from now on (from its start), prefixed ``[name]``. Following a
        name again (a restarted peer writes a new log) first hands over the old one's rest."""
        if name in self._files:
            self._drain(name, self._files[name], final=True)
        self._files[name] = _Followed(Path(path))

    def pump(self) -> int:
        """Hand over every complete line written since the last call; returns how many."""
        return sum(self._drain(name, f, final=False) for name, f in list(self._files.items()))

    def close(self) -> None:
        """Hand over everything left, unfinished last lines included, and stop following."""
        for name, f in self._files.items():
            self._drain(name, f, final=False)
            while not f.caught_up:
                self._drain(name, f, final=False)
            self._drain(name, f, final=True)
        self._files.clear()

    def _drain(self, name: str, f: _Followed, *, final: bool) -> int:
        try:
            with f.path.open("rb") as fh:
                fh.seek(f.offset)
                data = fh.read(self.chunk)
        except OSError:
            data = b""
        f.offset += len(data)
        f.caught_up = len(data) < self.chunk
        *lines, f.partial = (f.partial + data).split(b"\n")
        if final and f.partial:
            lines.append(f.partial)
            f.partial = b""
        for line in lines:
            self.emit(f"[{name}] {line.decode('utf-8', 'replace').rstrip(chr(13))}")
        return len(lines)
