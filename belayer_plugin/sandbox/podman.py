"""Podman backend (daemonless, runc, CLI through subprocess): one export file per checkpoint.

Owns: the Podman backend (containers, exec by runc, checkpoint export/import). Must not: decide policy or know
about LLM contexts.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Optional

from belayer_plugin.sandbox import criu as criu_mod
from belayer_plugin.sandbox.base import (
    DEFAULT_PATH,
    CheckpointError,
    ExecResult,
    ImageMissing,
    RestoreError,
    SandboxError,
    SandboxSpec,
    kill_cgroup_leftovers,
    stuck_checkpoint_timeout,
    run_cmd,
    run_until_exit,
)

log = logging.getLogger(__name__)

# Uncompressed: every restore (a fork restores one export n times) then skips a zstd pass. Measured with
# bench/fork.py (python env, 8 forks, 4 at a time): ready 1.29 s vs 1.80 s with zstd; the export is larger.
EXPORT_FILE = "podman-checkpoint.tar"
_OLD_EXPORT_FILE = "podman-checkpoint.tar.zst"  # checkpoints taken before the change still restore


# How commands run in a container podman started. "runc": `runc exec` on the container's runc state, the
# call podman's own exec makes after its bookkeeping (its database, locks, conmon). bench/sandbox_exec.py,
# two processes of four threads creating, exec'ing and removing sandboxes (two concurrent rollouts): a
# command p50 0.10 s vs 0.31 s through podman exec, max 0.36 s vs 5.2 s (podman exec now and then returns
# ~5 s after its command ended, exit 0). Same process spec either way (the container's env, user,
# capabilities, seccomp and cgroup; --env and --cwd on top). "podman": `podman exec`.
EXEC_VIA = ("runc", "podman")
_RUNC_EXEC = str(Path(__file__).with_name("runc_exec.py"))  # waits for the command runc started (see there)


class PodmanBackend:
    """Drives `podman --runtime runc` with a private containers.conf (the VM needs the ulimit workaround)."""

    name = "podman"

    def __init__(self, state_dir: Optional[str | Path] = None, root: Optional[str] = None,
                 runroot: Optional[str] = None, criu_path: str = "", podman: str = "podman",
                 exec_via: str = "runc"):
        if exec_via not in EXEC_VIA:
            raise ValueError(f"exec_via must be one of {list(EXEC_VIA)}, got {exec_via!r}")
        self.state_dir = Path(state_dir or os.path.expanduser("~/.cache/belayer/podman"))
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.criu_path = criu_path
        # runc's state directory for podman's containers: /run/runc as root, $XDG_RUNTIME_DIR/runc rootless.
        # Checked against the first container exec'd (see _runc_exec); None: not decided yet.
        self._runc: Optional[list[str]] = None
        self._runc_ok: Optional[bool] = None if exec_via == "runc" else False
        self.base = [podman, "--runtime", "runc", "--cgroup-manager", "cgroupfs", "--events-backend", "file"]
        if root:
            self.base += ["--root", str(root)]
        if runroot:
            self.base += ["--runroot", str(runroot)]
        conf = self.state_dir / "containers.conf"
        # The VM lacks CAP_SYS_RESOURCE: podman's default rlimits make runc fail ("error setting rlimit
        # type 7"); pin nofile to the current hard limit.
        import resource

        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        text = (f'[containers]\ndefault_ulimits = ["nofile={hard}:{hard}", "nproc=32768:32768"]\n'
                f'[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\n')
        if not conf.exists() or conf.read_text() != text:
            tmp = conf.with_suffix(".tmp")
            tmp.write_text(text)
            os.replace(tmp, conf)
        self.env = criu_mod.runtime_env(criu_path, {"CONTAINERS_CONF": str(conf)})

    # -- plumbing -------------------------------------------------------------------------------------
    def _run(self, args: list[str], timeout_s: float = 60.0, input: Optional[bytes] = None,
             check: bool = True) -> subprocess.CompletedProcess:
        return run_cmd(self.base + args, timeout_s, input=input, env=self.env, check=check)

    def _err(self, e: subprocess.CalledProcessError) -> str:
        return (e.stderr or b"").decode(errors="replace").strip()[-500:]

    # -- images ---------------------------------------------------------------------------------------
    def image_exists(self, ref: str) -> bool:
        return self._run(["image", "exists", ref], check=False).returncode == 0

    def image_id(self, ref: str) -> Optional[str]:
        """The image's content id (None when it is absent)."""
        cp = self._run(["image", "inspect", "--format", "{{.Id}}", ref], check=False)
        if cp.returncode != 0:
            return None
        return cp.stdout.decode().strip() or None

    def import_image(self, tar_path: Path, ref: str) -> None:
        self._run(["import", "--change", f"ENV PATH={DEFAULT_PATH}", "--change", "WORKDIR /root",
                   str(tar_path), ref], timeout_s=600)

    def remove_image(self, ref: str) -> None:
        self._run(["rmi", "-f", ref], check=False)

    # -- containers -----------------------------------------------------------------------------------
    def _create_args(self, spec: SandboxSpec, name: str) -> list[str]:
        args = ["--name", name, "--network", spec.network, "--cpus", str(spec.cpus),
                "--memory", f"{spec.memory_mb}m", "--pids-limit", str(spec.pids_limit),
                "--workdir", spec.workdir, "--label", "belayer.sandbox=1"]
        for k, v in spec.env.items():
            args += ["--env", f"{k}={v}"]
        for k, v in spec.labels.items():
            args += ["--label", f"{k}={v}"]
        return args + [spec.image, *spec.command]

    def _check_image(self, ref: str) -> None:
        if not self.image_exists(ref):
            raise ImageMissing(f"image {ref!r} not found in podman storage (build it: belayer envs build)")

    def run(self, spec: SandboxSpec, name: str) -> str:
        self._check_image(spec.image)
        try:
            cp = self._run(["run", "-d", *self._create_args(spec, name)], timeout_s=120)
        except subprocess.CalledProcessError as e:
            self.remove(name)
            raise SandboxError(f"podman run failed: {self._err(e)}") from None
        return cp.stdout.decode().strip().splitlines()[-1]

    def create(self, spec: SandboxSpec, name: str) -> str:
        self._check_image(spec.image)
        try:
            cp = self._run(["create", *self._create_args(spec, name)], timeout_s=120)
        except subprocess.CalledProcessError as e:
            self.remove(name)
            raise SandboxError(f"podman create failed: {self._err(e)}") from None
        return cp.stdout.decode().strip().splitlines()[-1]

    def start(self, cid: str) -> None:
        try:
            self._run(["start", cid], timeout_s=120)
        except subprocess.CalledProcessError as e:
            raise SandboxError(f"podman start failed: {self._err(e)}") from None

    def exec(self, cid: str, argv: list[str], timeout_s: float, workdir: Optional[str], env: dict[str, str],
             stdin: Optional[bytes]) -> ExecResult:
        t0 = time.monotonic()
        try:
            cp = self._exec_raw(cid, argv, timeout_s, workdir, env, stdin)
        except subprocess.TimeoutExpired as e:
            return ExecResult((e.stdout or b"").decode(errors="replace"), (e.stderr or b"").decode(errors="replace"),
                              -1, time.monotonic() - t0, timed_out=True)
        return ExecResult(cp.stdout.decode(errors="replace"), cp.stderr.decode(errors="replace"), cp.returncode,
                          time.monotonic() - t0)

    def _exec_raw(self, cid: str, argv: list[str], timeout_s: float = 60.0, workdir: Optional[str] = None,
                  env: Optional[dict[str, str]] = None, stdin: Optional[bytes] = None) -> subprocess.CompletedProcess:
        """Runs argv in the container (runc exec, else podman exec); raw output. Raises TimeoutExpired."""
        env = env or {}
        if self._runc_ok is not False:
            cp = self._runc_exec(cid, argv, timeout_s, workdir, env, stdin)
            if cp is not None:
                return cp
        args = ["exec"]
        if stdin is not None:
            args.append("-i")
        if workdir:
            args += ["--workdir", workdir]
        for k, v in env.items():
            args += ["--env", f"{k}={v}"]
        return self._run(args + [cid, *argv], timeout_s=timeout_s, input=stdin, check=False)

    def _runc_exec(self, cid: str, argv: list[str], timeout_s: float, workdir: Optional[str],
                   env: dict[str, str], stdin: Optional[bytes]) -> Optional[subprocess.CompletedProcess]:
        """`runc exec` in the container; None when runc does not know it (podman exec runs it then)."""
        if self._runc is None:
            runc = shutil.which("runc")
            uid = os.geteuid()
            run_dir = os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{uid}"
            root = "/run/runc" if uid == 0 else os.path.join(run_dir, "runc")
            if not runc or not os.path.isdir(root):
                self._runc_ok = False
                log.info("podman backend: no runc state at %s; commands go through podman exec", root)
                return None
            self._runc = [runc, "--root", root]
        # The pid file tells a command that ran (its own exit status, 255 included) from one runc refused
        # to start (runc's 255: the container is gone, stopped or paused, or not under this runc root).
        pid_file = self.state_dir / f"exec-{uuid.uuid4().hex}.pid"
        args = [sys.executable, "-S", "-I", _RUNC_EXEC, *self._runc, "exec", "--detach", "--pid-file", str(pid_file)]
        if workdir:
            args += ["--cwd", workdir]
        for k, v in env.items():
            args += ["--env", f"{k}={v}"]
        try:
            cp = run_until_exit(args + [cid, *argv], timeout_s, input=stdin, env=self.env)
            started = pid_file.exists()
        finally:
            pid_file.unlink(missing_ok=True)
        if started:
            self._runc_ok = True
            return cp
        if not self._runc_ok:
            # runc has run nothing yet on this backend: does it see podman's containers at this root at all?
            known = run_cmd([*self._runc, "state", cid], 30.0, env=self.env, check=False).returncode == 0
            if not known and self.is_running(cid):
                log.warning("podman backend: runc at %s does not see container %s (%s); commands go through "
                            "podman exec", self._runc[2], cid[:12], cp.stderr.decode(errors="replace").strip()[-200:])
                self._runc_ok = False
                return None
            if not known:
                return cp  # the container is gone: runc's 255, as podman exec gives (the caller checks liveness)
            self._runc_ok = True
        if cp.returncode == 255 and b"unable to start container process" in cp.stderr:
            # the program could not be started: the exit codes podman exec gives (and a shell would)
            err = cp.stderr.lower()
            code = 126 if b"permission denied" in err or b"operation not permitted" in err else \
                127 if b"no such file or directory" in err or b"executable file not found" in err else 255
            cp = subprocess.CompletedProcess(cp.args, code, cp.stdout, cp.stderr)
        return cp

    def put_file(self, cid: str, path: str, data: bytes, mode: int) -> None:
        script = 'mkdir -p "$(dirname "$1")" && cat > "$1.belayer-tmp" && chmod "$2" "$1.belayer-tmp" && mv -f "$1.belayer-tmp" "$1"'
        cp = self._exec_raw(cid, ["sh", "-c", script, "_", path, format(mode, "o")], stdin=data)
        if cp.returncode != 0:
            raise SandboxError(f"write {path}: {cp.stderr.decode(errors='replace').strip()}")

    def get_file(self, cid: str, path: str) -> bytes:
        cp = self._exec_raw(cid, ["cat", path])
        if cp.returncode != 0:
            raise FileNotFoundError(f"{path}: {cp.stderr.decode(errors='replace').strip()}")
        return cp.stdout

    def _inspect(self, ref: str) -> Optional[dict]:
        cp = self._run(["container", "inspect", ref], check=False)
        if cp.returncode != 0:
            return None
        data = json.loads(cp.stdout or b"[]")
        return data[0] if data else None

    def is_running(self, cid: str) -> bool:
        info = self._inspect(cid)
        return bool(info and info["State"].get("Running") and not info["State"].get("Paused"))

    def container_id(self, name: str) -> Optional[str]:
        info = self._inspect(name)
        return info["Id"] if info else None

    def kill(self, cid_or_name: str) -> None:
        self._run(["kill", "-s", "KILL", cid_or_name], check=False)

    def remove(self, cid_or_name: str) -> None:
        self._run(["rm", "-f", "-t", "0", cid_or_name], timeout_s=60, check=False)

    def pause(self, cid: str) -> None:
        try:
            self._run(["pause", cid])
        except subprocess.CalledProcessError as e:
            raise SandboxError(f"podman pause failed: {self._err(e)}") from None

    def unpause(self, cid: str) -> None:
        try:
            self._run(["unpause", cid])
        except subprocess.CalledProcessError as e:
            raise SandboxError(f"podman unpause failed: {self._err(e)}") from None

    def upper_dir(self, cid: str) -> Path:
        info = self._inspect(cid)
        if not info:
            raise SandboxError(f"no container {cid}")
        return Path(info["GraphDriver"]["Data"]["UpperDir"])

    # -- CRIU -----------------------------------------------------------------------------------------
    def criu_problem(self) -> Optional[str]:
        return criu_mod.criu_problem(self.criu_path)

    def criu_checkpoint(self, cid: str, spec: SandboxSpec, staging: Path, timeout_s: float,
                        new_name: str) -> tuple[list[str], Optional[str]]:
        """Dumps processes + rootfs diff into one export file, then continues in a fresh container.

        Podman refuses to checkpoint a paused container and, with --leave-running, takes the rootfs diff
        after the processes resumed (skew). Stopping at the dump and restoring from the export gives a
        consistent pair and proves the export restorable before it is published.
        """
        out = staging / EXPORT_FILE
        t0 = time.monotonic()
        try:
            self._run(["container", "checkpoint", "--compress=none", f"--export={out}", cid], timeout_s=timeout_s)
        except subprocess.TimeoutExpired:
            # runc/CRIU outlive the killed CLI and keep the container locked
            raise stuck_checkpoint_timeout("podman", cid, timeout_s) from None
        except subprocess.CalledProcessError as e:
            raise CheckpointError(f"podman checkpoint failed: {self._err(e)}") from None
        left = max(1.0, timeout_s - (time.monotonic() - t0))
        try:
            new_cid = self.criu_restore(staging, spec, new_name, left)
        except RestoreError as e:
            raise CheckpointError(f"continuing from the fresh export failed: {e}") from None
        self.remove(cid)
        return [EXPORT_FILE], new_cid

    def criu_restore(self, ckdir: Path, spec: SandboxSpec, name: str, timeout_s: float) -> str:
        self._check_image(spec.image)
        try:
            export = ckdir / EXPORT_FILE
            if not export.exists() and (ckdir / _OLD_EXPORT_FILE).exists():
                export = ckdir / _OLD_EXPORT_FILE
            cp = self._run(["container", "restore", f"--import={export}", "--name", name],
                           timeout_s=timeout_s)
            return cp.stdout.decode().strip().splitlines()[-1]
        except subprocess.TimeoutExpired:
            err = f"podman restore ran past {timeout_s:.1f}s"
        except subprocess.CalledProcessError as e:
            err = f"podman restore failed: {self._err(e)}"
        cid = self.container_id(name)
        self.discard(name)
        raise RestoreError(err, cid)

    def discard(self, name: str) -> None:
        """Kills whatever a failed create/restore left (cgroup leftovers included) and removes it."""
        cid = self.container_id(name)
        self.kill(name)
        self.remove(name)
        if cid:
            kill_cgroup_leftovers(cid)
