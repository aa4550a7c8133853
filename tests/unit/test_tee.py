"""The launcher's tee: each complete line of a peer's log, prefixed, in order, once; a line being
written is held until its newline (or the end); restarts and unreadable logs."""

from __future__ import annotations

from pathlib import Path

from isthmus.run.tee import LogTee


def test_lines_are_prefixed_in_order_and_partial_lines_wait(tmp_path: Path) -> None:
    out: list[str] = []
    tee = LogTee(out.append)
    a, b = tmp_path / "peer0.log", tmp_path / "peer1.log"
    a.write_bytes(b"step 1 loss 2.5\nstep 2 [bold]x[/]\npart")
    tee.follow("peer0", a)
    tee.follow("peer1", b)  # not created yet: skipped until it is
    assert tee.pump() == 2
    assert out == ["[peer0] step 1 loss 2.5", "[peer0] step 2 [bold]x[/]"]
    with a.open("ab") as f:
        f.write(b"ial line\r\n")
    b.write_bytes("héllo\n".encode())
    assert tee.pump() == 2
    assert out[2:] == ["[peer0] partial line", "[peer1] héllo"]
    assert tee.pump() == 0  # nothing new: nothing twice


def test_close_hands_over_an_unfinished_last_line_larger_than_a_read(tmp_path: Path) -> None:
    out: list[str] = []
    tee = LogTee(out.append, chunk=4)
    a = tmp_path / "peer0.log"
    a.write_bytes(b"one\ntwo three four")
    tee.follow("peer0", a)
    tee.close()
    assert out == ["[peer0] one", "[peer0] two three four"]


def test_a_restarted_peer_hands_over_its_old_log_first(tmp_path: Path) -> None:
    out: list[str] = []
    tee = LogTee(out.append)
    old, new = tmp_path / "peer1.log", tmp_path / "peer1.1.log"
    old.write_bytes(b"before the crash\nTraceback")
    tee.follow("peer1", old)
    new.write_bytes(b"rejoined\n")
    tee.follow("peer1", new)
    tee.pump()
    assert out == ["[peer1] before the crash", "[peer1] Traceback", "[peer1] rejoined"]
