"""The checkpoint writer thread: jobs in order on one thread, failures contained, idle exit."""

from __future__ import annotations

import logging
import threading

import pytest

from isthmus.checkpoint.writer import BackgroundWriter


def test_jobs_run_in_order_on_one_kept_thread() -> None:
    w = BackgroundWriter(idle_s=30)
    gate = threading.Event()
    seen: list[tuple[int, str]] = []

    def job(i: int) -> None:
        if i == 0:
            gate.wait(10)  # the later jobs queue behind this one
        seen.append((i, threading.current_thread().name))

    jobs = [w.submit(job, i) for i in range(3)]
    assert not jobs[0].done and not jobs[2].wait(0.05)  # held behind the first
    gate.set()
    assert all(j.wait(10) for j in jobs)
    assert [i for i, _ in seen] == [0, 1, 2]
    assert {n for _, n in seen} == {"isthmus-checkpoint"}
    assert len({t for t in threading.enumerate() if t.name == "isthmus-checkpoint"}) >= 1


def test_a_failing_job_is_logged_and_the_next_runs(caplog: pytest.LogCaptureFixture) -> None:
    w = BackgroundWriter(idle_s=30)
    out: list[int] = []

    def bad() -> None:
        raise OSError("disk full")

    with caplog.at_level(logging.ERROR, logger="isthmus.checkpoint"):
        first = w.submit(bad)
        second = w.submit(out.append, 7)
        assert first.wait(10) and second.wait(10)
    assert out == [7]
    assert "a checkpoint write failed" in caplog.text and "disk full" in caplog.text


def test_an_idle_thread_ends_and_the_next_job_starts_another() -> None:
    w = BackgroundWriter(name="isthmus-idle-test", idle_s=0.05)
    first: list[threading.Thread] = []
    assert w.submit(lambda: first.append(threading.current_thread())).wait(10)
    first[0].join(10)  # ended after idle_s without a job
    assert not first[0].is_alive()
    second: list[threading.Thread] = []
    assert w.submit(lambda: second.append(threading.current_thread())).wait(10)
    assert second[0] is not first[0]


def test_idle_s_must_be_positive() -> None:
    with pytest.raises(ValueError, match="idle_s"):
        BackgroundWriter(idle_s=0)


def test_start_runs_the_thread_before_any_job_and_jobs_use_it() -> None:
    w = BackgroundWriter(name="isthmus-start-test", idle_s=30)
    assert not w.running
    w.start()
    w.start()  # a second start while one runs starts nothing
    assert w.running
    started = [t for t in threading.enumerate() if t.name == "isthmus-start-test"]
    assert len(started) == 1
    ran: list[threading.Thread] = []
    assert w.submit(lambda: ran.append(threading.current_thread())).wait(10)
    assert ran == started
