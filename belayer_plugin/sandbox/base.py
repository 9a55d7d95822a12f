"""The Sandbox: one container with limits, exec, file access and close, over a pluggable backend.

Owns: the Sandbox and its backend protocol, exec with limits and the sandbox's events. Must not: know about
LLM contexts or checkpoint policy.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Protocol, Sequence

log = logging.getLogger(__name__)

EventSink = Callable[[dict], None]

# The PATH that imported images get: a rootfs tarball carries no image config.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
EXEC_MARK = "belayer-exec"
EXEC_TAG_VAR = "BELAYER_EXEC_ID"


class SandboxError(Exception):
    """Base class of every sandbox failure."""


class SandboxDead(SandboxError):
    """The container is gone or not running: an environment failure (the effect of the action is uncertain)."""


class ExecTimeout(SandboxError):
    """A command ran past its timeout and could not be cleaned up inside the container."""


class ImageMissing(SandboxError):
    """The base image is not present locally (there is no registry to pull from)."""


class CheckpointError(SandboxError):
    """A checkpoint could not be taken; nothing was published."""


class CheckpointTimeout(CheckpointError):
    """A checkpoint ran past its timeout; nothing was published."""


class CheckpointCorrupt(CheckpointError):
    """A published checkpoint failed verification (checksum, size or manifest); it must not be used."""


class CheckpointIncompatible(CheckpointError):
    """A checkpoint taken on a host this one cannot restore it on (another CRIU, kernel, architecture, cgroup
    layout or image; see sandbox/host.py): refused, never restored, and left in the store for a host that can."""

    def __init__(self, message: str, mismatches: Sequence[str] = ()):
        super().__init__(message)
        self.mismatches = list(mismatches)  # one line per difference, naming the recorded and the local value


class CheckpointFenced(CheckpointError):
    """The trajectory was taken over (resumed elsewhere, a newer generation in the store's lease): a checkpoint
    of the older generation past the take-over boundary is refused, and never restored."""


class RestoreError(SandboxError):
    """A restore failed; whatever it had started was killed and removed."""

    def __init__(self, message: str, container_id: Optional[str] = None):
        super().__init__(message)
        self.container_id = container_id  # the half-restored container, if one was created


class CriuUnavailable(SandboxError):
    """CRIU is missing or too old: only file-system checkpoints are possible."""


@dataclass
class ExecResult:
    """What one command produced."""

    stdout: str
    stderr: str
    exit_code: int
    duration_s: float
    timed_out: bool = False

    @property
    def output(self) -> str:
        """stdout followed by stderr, as an agent sees a terminal."""
        return self.stdout + self.stderr


@dataclass
class SandboxSpec:
    """How to create a container: image, entry command and limits (no network unless asked)."""

    image: str
    command: list[str] = field(default_factory=lambda: ["sh", "-c", "trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done"])
    cpus: float = 1.0
    memory_mb: int = 512
    pids_limit: int = 256
    network: str = "none"
    workdir: str = "/root"
    env: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    # The program that wraps commands with a time limit inside the container (busybox and coreutils both
    # have it); "" runs commands unwrapped and relies on killing the exec client.
    timeout_program: str = "timeout"

    def problems(self) -> list[str]:
        out = []
        if not self.image:
            out.append("image: empty")
        if not self.command:
            out.append("command: empty")
        if self.cpus <= 0:
            out.append("cpus: must be > 0")
        if self.memory_mb < 16:
            out.append("memory_mb: must be >= 16")
        if self.pids_limit < 8:
            out.append("pids_limit: must be >= 8")
        return out


class Backend(Protocol):
    """A container engine. Handles are container ids (full, so cgroup paths can be matched)."""

    name: str

    def image_exists(self, ref: str) -> bool: ...
    def image_id(self, ref: str) -> Optional[str]: ...
    def import_image(self, tar_path: Path, ref: str) -> None: ...
    def remove_image(self, ref: str) -> None: ...
    def run(self, spec: SandboxSpec, name: str) -> str: ...
    def create(self, spec: SandboxSpec, name: str) -> str: ...
    def start(self, cid: str) -> None: ...
    def exec(self, cid: str, argv: list[str], timeout_s: float, workdir: Optional[str], env: dict[str, str],
             stdin: Optional[bytes]) -> ExecResult: ...
    def put_file(self, cid: str, path: str, data: bytes, mode: int) -> None: ...
    def get_file(self, cid: str, path: str) -> bytes: ...
    def is_running(self, cid: str) -> bool: ...
    def kill(self, cid_or_name: str) -> None: ...
    def remove(self, cid_or_name: str) -> None: ...
    def pause(self, cid: str) -> None: ...
    def unpause(self, cid: str) -> None: ...
    def upper_dir(self, cid: str) -> Path: ...
    def container_id(self, name: str) -> Optional[str]: ...
    def criu_checkpoint(self, cid: str, spec: SandboxSpec, staging: Path, timeout_s: float,
                        new_name: str) -> tuple[list[str], Optional[str]]: ...
    def criu_restore(self, ckdir: Path, spec: SandboxSpec, name: str, timeout_s: float) -> str: ...
    def criu_problem(self) -> Optional[str]: ...


def new_name(prefix: str = "belayer") -> str:
    """A fresh, unique container name."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def run_cmd(argv: Sequence[str], timeout_s: float, input: Optional[bytes] = None,
            env: Optional[dict[str, str]] = None, check: bool = True) -> subprocess.CompletedProcess:
    """Runs a host command with a bounded wait; on timeout kills its whole process group."""
    p = subprocess.Popen(list(argv), stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
    try:
        out, err = p.communicate(input=input, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = p.communicate()
        raise subprocess.TimeoutExpired(list(argv), timeout_s, out, err) from None
    cp = subprocess.CompletedProcess(list(argv), p.returncode, out, err)
    if check and p.returncode != 0:
        raise subprocess.CalledProcessError(p.returncode, list(argv), out, err)
    return cp


def _wait_and_wake(p: subprocess.Popen, wake_w: int) -> None:
    p.wait()
    try:
        os.write(wake_w, b"x")
    except OSError:
        pass


def run_until_exit(argv: Sequence[str], timeout_s: float, input: Optional[bytes] = None,
                   env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess:
    """Runs a host command until it exits (bounded; on timeout kills its process group); never raises on rc.

    Its stdio are pipes, read until the process exits rather than until EOF: a command that hands its stdio
    to programs it starts (`runc exec --detach` does) returns when it exits, even where a background child it
    left still holds them. Pipes, not files: a file of the host held by a process in a container would make
    its CRIU dump fail; a pipe whose reader has gone is dumped like the ones `podman exec` leaves.
    """
    import selectors

    p = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=env, start_new_session=True)
    out_fd, err_fd = p.stdout.fileno(), p.stderr.fileno()
    bufs: dict[int, list[bytes]] = {out_fd: [], err_fd: []}
    data = memoryview(input or b"")
    sel = selectors.DefaultSelector()
    pidfd = -1  # readable once the process has exited
    waiter: Optional[threading.Thread] = None
    wake_w = -1
    try:
        for f in (p.stdin, p.stdout, p.stderr):
            os.set_blocking(f.fileno(), False)
        for fd in bufs:
            sel.register(fd, selectors.EVENT_READ)
        if data:
            sel.register(p.stdin.fileno(), selectors.EVENT_WRITE)
        else:
            p.stdin.close()
        try:
            pidfd = os.pidfd_open(p.pid)  # no polling of waitpid
        except (AttributeError, OSError):  # Linux < 5.3: a thread waits and wakes the selector through a pipe
            pidfd, wake_w = os.pipe()
            waiter = threading.Thread(target=_wait_and_wake, args=(p, wake_w), daemon=True)
            waiter.start()
        sel.register(pidfd, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        exited = False
        while not exited:
            left = deadline - time.monotonic()
            if left <= 0:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
                raise subprocess.TimeoutExpired(list(argv), timeout_s, b"".join(bufs[out_fd]), b"".join(bufs[err_fd]))
            for key, _ in sel.select(left):
                fd = key.fd
                if fd == pidfd:
                    exited = True
                elif fd in bufs:
                    try:
                        chunk = os.read(fd, 65536)
                    except BlockingIOError:
                        continue
                    if chunk:
                        bufs[fd].append(chunk)
                    else:
                        sel.unregister(fd)
                else:  # stdin
                    try:
                        data = data[os.write(fd, data[:65536]):]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:
                        data = data[:0]
                    if not data:
                        sel.unregister(fd)
                        p.stdin.close()
        for fd, buf in bufs.items():  # what the command wrote before it exited is in the pipes now
            while True:
                try:
                    chunk = os.read(fd, 65536)
                except (BlockingIOError, OSError):
                    break
                if not chunk:
                    break
                buf.append(chunk)
        p.wait()
    finally:
        sel.close()
        if waiter is not None:
            waiter.join(timeout=5.0)  # p has been waited for: the thread has written or is about to
        for fd in (pidfd, wake_w):
            if fd >= 0:
                os.close(fd)
        for f in (p.stdin, p.stdout, p.stderr):
            try:
                f.close()
            except OSError:
                pass
    return subprocess.CompletedProcess(list(argv), p.returncode, b"".join(bufs[out_fd]), b"".join(bufs[err_fd]))


def cgroup_pids(container_id: str) -> list[int]:
    """Host pids whose cgroup path names this container id (cgroup v1 and v2, podman and docker)."""
    pids = []
    if len(container_id) < 12:
        return pids
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cgroup") as f:
                if container_id in f.read():
                    pids.append(int(d))
        except OSError:
            continue
    return pids


def kill_tagged(container_id: str, tag: str) -> int:
    """SIGKILLs the container's processes whose environment carries EXEC_TAG_VAR=tag; returns how many."""
    want = f"{EXEC_TAG_VAR}={tag}".encode()
    n = 0
    for pid in cgroup_pids(container_id):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if want in f.read().split(b"\0"):
                    os.kill(pid, signal.SIGKILL)
                    n += 1
        except (OSError, ProcessLookupError):
            continue
    return n


def kill_cgroup_leftovers(container_id: str, timeout_s: float = 5.0) -> int:
    """SIGKILLs every process still in the container's cgroup; returns how many were found.

    A restore that fails half-way can leave a process running outside the runtime's view (PID 1 of its own
    pid namespace, still in the container's cgroup): nothing of a half-restored sandbox may keep running.
    """
    found = 0
    deadline = time.monotonic() + timeout_s
    while True:
        pids = cgroup_pids(container_id)
        if not pids:
            return found
        found = max(found, len(pids))
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise RestoreError(f"processes {pids} of {container_id[:12]} survive SIGKILL")
        time.sleep(0.02)  # killed processes leave /proc asynchronously; poll, bounded by the deadline


def kill_stuck_dumps(container_id: str) -> int:
    """SIGKILLs the CRIU processes of a runtime checkpoint (`runc ... checkpoint ... <container_id>`) still
    running; returns how many. A dump of a container whose processes were killed mid-dump can wait forever,
    and the container runtime holds the container's lock until it returns: every later call (unpause, kill,
    remove) would wait too. A killed CRIU makes runc fail the checkpoint and the runtime let go."""
    import psutil

    killed = 0
    for p in psutil.process_iter(["cmdline"]):
        cl = p.info.get("cmdline") or []
        if not cl or os.path.basename(cl[0]) != "runc" or "checkpoint" not in cl or container_id not in cl:
            continue
        try:
            for c in p.children(recursive=True):
                c.kill()
                killed += 1
        except psutil.Error:
            pass
    return killed


def stuck_checkpoint_timeout(runtime: str, container_id: str, timeout_s: float) -> "CheckpointTimeout":
    """The error for a checkpoint past its time, after ending the runtime's stuck dump (kill_stuck_dumps)."""
    n = kill_stuck_dumps(container_id)
    return CheckpointTimeout(f"{runtime} checkpoint ran past {timeout_s:.1f}s"
                             + (f" ({n} stuck CRIU process(es) killed)" if n else ""))


class Sandbox:
    """One live container. Thread-safe: exec and checkpoint serialise on `lock`."""

    def __init__(self, backend: Backend, spec: SandboxSpec, container_id: str, name: str,
                 sandbox_id: Optional[str] = None, exec_timeout_s: float = 60.0,
                 on_event: Optional[EventSink] = None):
        self.backend = backend
        self.spec = spec
        self.container_id = container_id
        self.name = name
        self.sandbox_id = sandbox_id or name
        self.exec_timeout_s = exec_timeout_s
        self.on_event = on_event
        self.lock = threading.RLock()
        self.closed = False
        # Set when the process state was lost (fs-only restore): callers may want to re-run set-up.
        self.processes_fresh = False

    @classmethod
    def create(cls, backend: Backend, spec: SandboxSpec, sandbox_id: Optional[str] = None,
               exec_timeout_s: float = 60.0, on_event: Optional[EventSink] = None) -> "Sandbox":
        """Starts a fresh container from `spec.image`."""
        bad = spec.problems()
        if bad:
            raise ValueError("invalid SandboxSpec: " + "; ".join(bad))
        name = new_name()
        t0 = time.monotonic()
        cid = backend.run(spec, name)
        sb = cls(backend, spec, cid, name, sandbox_id, exec_timeout_s, on_event)
        sb.emit("create", "fresh container from image", image=spec.image, duration_s=time.monotonic() - t0)
        return sb

    def emit(self, kind: str, reason: str, **figures: Any) -> None:
        """Sends one structured event record and logs it."""
        rec = {"t": time.time(), "component": "sandbox", "subject": self.sandbox_id, "kind": kind,
               "reason": reason, **figures}
        log.info("sandbox %s %s: %s %s", self.sandbox_id, kind, reason, figures)
        if self.on_event is not None:
            try:
                self.on_event(rec)
            except Exception:  # a broken sink must not break the sandbox
                log.exception("on_event callback failed")

    def exec(self, command: str | Sequence[str], timeout: Optional[float] = None, cwd: Optional[str] = None,
             env: Optional[dict[str, str]] = None, stdin: Optional[bytes] = None) -> ExecResult:
        """Runs `command` (a shell string, or an argv list) and returns stdout, stderr and the exit code.

        Raises SandboxDead when the container is not running (then the command's effect is uncertain).
        """
        if self.closed:
            raise SandboxError(f"sandbox {self.sandbox_id} is closed")
        t = float(timeout if timeout is not None else self.exec_timeout_s)
        if t <= 0:
            raise ValueError(f"timeout must be > 0, got {t}")
        # $0 = EXEC_MARK tags our exec helpers so leftovers can be found (see reap_exec_helpers).
        if isinstance(command, str):
            argv = ["sh", "-c", command, EXEC_MARK]
        else:
            argv = ["sh", "-c", 'exec "$@"', EXEC_MARK, *command]
        if self.spec.timeout_program:
            # Kill the command inside the container: killing the exec client would leave it running there.
            argv = [self.spec.timeout_program, "-s", "KILL", str(max(1, int(round(t)))), *argv]
        # Every process of this command inherits the tag, so a timeout can kill all of them (busybox's
        # timeout kills only the direct child; a background grandchild would keep running).
        tag = uuid.uuid4().hex[:16]
        with self.lock:
            res = self.backend.exec(self.container_id, argv, t + 10.0, cwd, {**(env or {}), EXEC_TAG_VAR: tag}, stdin)
            hit_limit = res.timed_out or (res.exit_code in (124, 137) and res.duration_s >= t - 0.5)
            if hit_limit:
                kill_tagged(self.container_id, tag)
        if res.exit_code in (124, 125, 126, 127, 137, 255, -1) and not self.backend.is_running(self.container_id):
            raise SandboxDead(f"sandbox {self.sandbox_id}: container {self.name} is not running "
                              f"(exec exit {res.exit_code}: {res.stderr.strip()[:200]})")
        if self.spec.timeout_program and res.exit_code in (124, 137) and res.duration_s >= t - 0.5:
            res.timed_out = True
        return res

    def reap_exec_helpers(self) -> int:
        """Kills leftover `timeout` watchers of finished execs; returns how many. Call with `lock` held.

        busybox's timeout forks a watcher that outlives the command by up to a second, reparented to the
        container's PID 1; a CRIU dump that catches one in a restored container cannot be restored
        ("Can't restore sub-task in NS"). With the lock held no exec is in flight, so every watcher
        tagged with EXEC_MARK is a leftover.
        """
        n = 0
        for pid in cgroup_pids(self.container_id):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if len(argv) > 7 and argv[0].endswith(b"timeout") and argv[7] == EXEC_MARK.encode():
                try:
                    os.kill(pid, signal.SIGKILL)
                    n += 1
                except ProcessLookupError:
                    pass
        return n

    def read_file(self, path: str) -> bytes:
        """The content of a file in the container."""
        with self.lock:
            self._check_alive()
            return self.backend.get_file(self.container_id, path)

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        """Creates or replaces a file in the container (parent directories are created)."""
        if isinstance(data, str):
            data = data.encode()
        with self.lock:
            self._check_alive()
            self.backend.put_file(self.container_id, path, data, mode)

    def alive(self) -> bool:
        """Whether the container is running."""
        return not self.closed and self.backend.is_running(self.container_id)

    def _check_alive(self) -> None:
        if self.closed:
            raise SandboxError(f"sandbox {self.sandbox_id} is closed")
        if not self.backend.is_running(self.container_id):
            raise SandboxDead(f"sandbox {self.sandbox_id}: container {self.name} is not running")

    def kill(self) -> None:
        """SIGKILLs the container's processes (fault injection, hard stop); the container stays for inspection."""
        self.backend.kill(self.container_id)

    def close(self) -> None:
        """Removes the container and kills anything left in its cgroup. Idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            self.backend.remove(self.container_id)
        finally:
            kill_cgroup_leftovers(self.container_id)
        self.emit("close", "sandbox removed")

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def shell_quote(args: Sequence[str]) -> str:
    """argv -> one shell command line."""
    return " ".join(shlex.quote(a) for a in args)
