"""run_until_exit: the host-side wait of a sandbox command run by runc exec (real processes, no containers)."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from belayer_plugin.sandbox.base import run_until_exit


@pytest.fixture(params=["pidfd", "thread"])
def wake(request, monkeypatch):
    """Both ways of learning the exit: a pidfd, and the waiter thread used where the kernel has none."""
    if request.param == "thread":
        def no_pidfd(pid: int) -> int:
            raise OSError(38, "Function not implemented")

        monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    return request.param


def test_returns_at_exit_while_a_background_child_still_holds_its_output(wake):
    t0 = time.monotonic()
    cp = run_until_exit(["sh", "-c", "sleep 30 & echo out; echo err >&2; exit 4"], 20.0)
    assert (cp.returncode, cp.stdout, cp.stderr) == (4, b"out\n", b"err\n")
    assert time.monotonic() - t0 < 10


def test_large_input_and_output_cross_without_deadlock(wake):
    blob = os.urandom(3 * 1024 * 1024)  # far beyond a pipe's buffer in both directions at once
    cp = run_until_exit(["cat"], 60.0, input=blob)
    assert cp.returncode == 0 and cp.stdout == blob


def test_no_input_reads_as_end_of_file(wake):
    assert run_until_exit(["sh", "-c", "cat; echo done"], 20.0).stdout == b"done\n"


def test_timeout_kills_the_process_group_and_keeps_what_was_written(wake):
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as e:
        run_until_exit(["sh", "-c", "echo partial; sleep 30"], 1.0)
    assert e.value.stdout == b"partial\n" and time.monotonic() - t0 < 10
