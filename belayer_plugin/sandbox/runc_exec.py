"""Runs one command in a runc container and exits with its status: `python runc_exec.py RUNC_ARGV...`.

RUNC_ARGV is a whole `runc ... exec --detach --pid-file F ... CONTAINER CMD...` command line. runc's attached
mode copies the command's output through its own pipes until every holder closes them, so a background job
the command leaves (`server &`) would hold the call open. Detached, the command inherits this process's stdio
(the caller's pipes, read until this process exits: base.run_until_exit) and runc exits at once; this process is a child subreaper, so the command is
reparented here when runc exits and its exit status is collected like conmon does for podman's exec.
Background jobs stay in the container: orphans inside it go to its PID 1, never to a subreaper outside.

Started with `python -S -I` per command (about 13 ms here): standard library only, no belayer imports.

Owns: one runc exec as a process. Must not: import any Belayer module (it runs as a script).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_CHILD_SUBREAPER = 36


def _code(status: int) -> int:
    """A wait status as a shell reports it: the exit code, or 128 + the signal's number."""
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def main(argv: list[str]) -> int:
    pid_file = argv[argv.index("--pid-file") + 1]
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        return 255
    runc = os.posix_spawnp(argv[0], argv, dict(os.environ))
    target = None
    reaped: dict[int, int] = {}  # the command, once runc is gone, may be reaped before runc's own exit is
    while target is None or target not in reaped:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:  # nothing left to wait for: the command never became ours
            return 255
        except InterruptedError:
            continue
        reaped[pid] = status
        if pid == runc:
            if _code(status) != 0:
                return _code(status)  # runc refused (no pid file): the container is gone, stopped or paused
            try:
                with open(pid_file) as f:
                    target = int(f.read().strip())
            except (OSError, ValueError):
                return 255
    return _code(reaped[target])


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main(sys.argv[1:]))
