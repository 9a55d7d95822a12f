"""Did anything worth saving change in a sandbox since its last checkpoint?

Most agent turns (ls, cat, grep, a test run that writes nothing) change neither the file system nor the
state of the long-lived processes; such a boundary needs no new checkpoint: the last one already is its
state. A fingerprint of the sandbox decides it, read from the host without touching the container:

- file system: every entry of the container's writable (upper) layer with its type, mode, size, mtime and
  ctime. Any write, create, delete (whiteout), chmod or rename in the container changes one of them; ctime
  cannot be set from inside, so even a write that restores the mtime shows.
- processes: the set of tasks in the container's cgroup (pid, start time) and each task's voluntary +
  involuntary context switches. A task that ran at all since the checkpoint was switched in and out at
  least once, so its counters moved; a task that never ran cannot have changed its own memory. Left out:
  exited tasks, the `timeout` watchers of finished commands, and the run counters of PID 1 when it is
  Belayer's idle loop (it wakes to reap every finished command and holds nothing).

What it cannot see (documented, deliberately conservative elsewhere): kernel-side state changed without
any task of the container running, e.g. bytes queued into a pipe or socket the container's processes have
not read yet (a writer outside the container). The exec'd command of an action is itself a task of the
cgroup only while it runs; it is gone when the action committed. Anything unreadable gives None: unknown,
so a checkpoint is taken.

Owns: detecting file-system and process changes since the last checkpoint. Must not: take checkpoints.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Optional

from belayer_plugin.sandbox.base import EXEC_MARK, Sandbox, SandboxError, cgroup_pids


def fs_fingerprint(upper: Path) -> str:
    """A digest of every entry under a writable layer (type, mode, size, mtime, ctime)."""
    h = hashlib.sha256()
    stack = [upper]
    while stack:
        d = stack.pop()
        with os.scandir(d) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            st = e.stat(follow_symlinks=False)
            rel = os.path.relpath(e.path, upper)
            h.update(f"{rel}\0{st.st_mode}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0{st.st_rdev}\n".encode())
            if e.is_dir(follow_symlinks=False):
                stack.append(Path(e.path))
    return h.hexdigest()


def _task_line(pid: int, tid: str, count_runs: bool) -> Optional[str]:
    """`tid:start:voluntary:involuntary` of one task; None for a task that is exiting (zombie)."""
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        after_comm = f.read().rsplit(")", 1)[1].split()
    if after_comm[0] in ("Z", "X"):  # exited, waiting to be reaped: no state left
        return None
    start = after_comm[19]  # field 22 (starttime), counted after the comm
    vol = invol = "-"
    if count_runs:
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches:"):
                    vol = line.split()[1]
                elif line.startswith("nonvoluntary_ctxt_switches:"):
                    invol = line.split()[1]
    return f"{tid}:{start}:{vol}:{invol}"


def _is_exec_watcher(pid: int) -> bool:
    """busybox `timeout` watchers of finished execs (Sandbox.exec's helpers, see reap_exec_helpers)."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    return len(argv) > 7 and argv[0].endswith(b"timeout") and argv[7] == EXEC_MARK.encode()


def _is_init(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return line.split()[-1] == "1"
    return False


def process_fingerprint(container_id: str, idle_init: bool = False) -> str:
    """A digest of the container's tasks and how often each has run (context switches).

    `idle_init`: the container's PID 1 is Belayer's idle loop (envs' IDLE_COMMAND), which holds no state
    but wakes to reap every finished command; its run counters are left out (its presence is not).
    """
    lines = []
    for pid in sorted(cgroup_pids(container_id)):
        if _is_exec_watcher(pid):
            continue
        count = not (idle_init and _is_init(pid))
        for tid in sorted(os.listdir(f"/proc/{pid}/task")):
            line = _task_line(pid, tid, count)
            if line is not None:
                lines.append(line)
    if not lines:
        raise ProcessLookupError(f"no task in the cgroup of {container_id[:12]}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def state_fingerprint(sandbox: Sandbox, with_processes: bool = True) -> Optional[str]:
    """The sandbox's file-system (+ process) fingerprint, or None when it cannot be read (then: unknown).

    Call with `sandbox.lock` held (no command in flight).
    """
    from belayer_plugin.envs.definitions import IDLE_COMMAND

    try:
        fs = fs_fingerprint(sandbox.backend.upper_dir(sandbox.container_id))
        procs = "-"
        if with_processes:
            procs = process_fingerprint(sandbox.container_id, idle_init=list(sandbox.spec.command) == IDLE_COMMAND)
    except (OSError, SandboxError, IndexError, ValueError):
        return None
    return f"{fs}:{procs}"
