"""The engine Ray actor: owns one inference server process (CPU engine or SGLang).

Liveness comes from Ray in every phase (serving, paused, memory released, mid-refit): a caller keeps a
`wait_exit()` call pending on the actor; it returns when the server process exits and raises
RayActorError when the actor itself dies. Neither needs the server to answer HTTP.

Owns: one server process per actor (start, stop, signals, liveness, port ownership checks). Must not: decide
health, restarts or routing (the fleet does), or import the fleet.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import httpx

from belayer_plugin.config import EnginesConfig
from belayer_plugin.engines.launch import engine_host, free_port, server_command
from belayer_plugin.ports import (PORT_ATTEMPTS, Ownership, PortClashError, listener_ownership, log_says_address_in_use,
                                  log_size)


class EngineStartError(RuntimeError):
    """The server process exited or did not become healthy within its start-up timeout."""


@dataclass
class EngineInfo:
    engine_id: str
    kind: str
    url: str
    pid: int  # the server process
    actor_pid: int
    node_id: str  # Ray node the actor runs on
    weight_version: str
    started_s: float  # process start to healthy


def can_restore_priority() -> bool:
    """Whether this process may lower a nice value it raised (root with CAP_SYS_NICE, or RLIMIT_NICE allows
    it): tried on a throwaway thread, since nice is per thread on Linux."""
    ok: list[bool] = []

    def probe() -> None:
        tid = threading.get_native_id()
        try:
            base = os.getpriority(os.PRIO_PROCESS, tid)
            if base >= 19:
                return
            os.setpriority(os.PRIO_PROCESS, tid, base + 1)
            os.setpriority(os.PRIO_PROCESS, tid, base)
            ok.append(True)
        except OSError:
            pass

    t = threading.Thread(target=probe, name="belayer-nice-probe", daemon=True)
    t.start()
    t.join(5.0)
    return bool(ok)


def renice_tree(pid: int, nice: int) -> None:
    """Sets the nice value of every thread of process `pid` and of its descendants (SGLang's scheduler and
    detokenizer are child processes; torch's worker threads each carry their own nice)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return
    for p in procs:
        try:
            tids = os.listdir(f"/proc/{p.pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
            except OSError:  # the thread ended meanwhile
                pass


def _die_with_parent() -> None:
    # The server must not outlive its actor: a SIGKILLed actor cannot clean up, so the kernel does it.
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class EngineActor:
    """Starts, watches and stops one engine server; methods are async so liveness calls never queue."""

    def __init__(self, engine_id: str, cfg: EnginesConfig, model_path: str, log_dir: str,
                 weight_version: str = "default"):
        self.engine_id = engine_id
        self.cfg = cfg
        self.model_path = model_path
        self.log_dir = Path(log_dir)
        self.initial_version = weight_version
        self.proc: Optional[asyncio.subprocess.Process] = None
        self.url = ""
        self.started_s = 0.0
        self.exit_code: Optional[int] = None
        self._exited = asyncio.Event()
        self._nice = 0  # set_background's offset in effect
        self._base_nice: Optional[int] = None  # the server's own priority when first moved
        self._http: Optional[httpx.AsyncClient] = None

    def _client(self) -> httpx.AsyncClient:
        # One client for the actor's life: a new httpx client builds an SSL context (~40 ms of CPU), which a
        # client per admin call paid several times a step on every engine. No keep-alive: a pooled
        # connection the server closed while idle would fail the next call (refit, memory) for nothing.
        if self._http is None:
            self._http = httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0), trust_env=False)
        return self._http

    async def start(self) -> EngineInfo:
        """Starts the server and returns once it answers /health; raises EngineStartError otherwise.

        /health counts only once the listener on the server's port is held by the server's own process tree
        (ports.listener_ownership): a port from free_port() can be taken by another process before the
        server binds it, and that process would answer in its place. On such a clash the server starts
        again on a fresh port (ports.PORT_ATTEMPTS in all), all attempts within startup_timeout_s.

        The server binds, and its URL names, this node's address unless engines.host says otherwise
        (launch.engine_host): the router and the driver may be on another node."""
        host = engine_host(self.cfg.host)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{self.engine_id}.log"
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        clashes: list[str] = []
        for _ in range(PORT_ATTEMPTS):
            t0 = time.monotonic()
            since = log_size(log_path)  # the log is appended to: only this attempt's lines count
            port = free_port(host)
            await self._launch(host, port, log_path)
            try:
                await self._await_healthy(host, port, log_path, since, deadline)
            except PortClashError as e:
                clashes.append(str(e))
                await self._discard()
                continue
            self.started_s = time.monotonic() - t0
            return await self.info()
        raise EngineStartError(f"{self.engine_id}: another process took the server's port {PORT_ATTEMPTS} times: "
                               + "; ".join(clashes))

    async def _launch(self, host: str, port: int, log_path: Path) -> None:
        argv, extra_env = server_command(self.cfg, self.model_path, host, port, self.initial_version)
        logf = open(log_path, "ab")
        self.proc = await asyncio.create_subprocess_exec(
            *argv, stdout=logf, stderr=asyncio.subprocess.STDOUT, env={**os.environ, **extra_env},
            start_new_session=True, preexec_fn=_die_with_parent)
        logf.close()
        self.url = f"http://{host}:{port}"
        asyncio.get_running_loop().create_task(self._reap())

    async def _await_healthy(self, host: str, port: int, log_path: Path, since: int, deadline: float) -> None:
        """Returns once the server answers /health from a listener of its own; PortClashError when another
        process holds its port (or took it, and the server's bind failed)."""
        assert self.proc is not None
        client = self._client()
        while True:
            own = await asyncio.to_thread(listener_ownership, self.proc.pid, host, port)
            if own is Ownership.FOREIGN:  # the server cannot bind it (or would share it): not ours to probe
                raise PortClashError(host, port)
            if self._exited.is_set():
                if log_says_address_in_use(log_path, since):  # lost a clash to a process that has gone since
                    raise PortClashError(host, port, "the server's log reports a failed bind")
                raise EngineStartError(f"{self.engine_id}: server exited with {self.exit_code} during start-up; "
                                       f"log tail:\n{_tail(log_path)}")
            if own is Ownership.OURS:
                # The server's tree holds the listener before and after the probe (it cannot pass to another
                # process and back meanwhile), so the server answered it and nobody else.
                try:
                    r = await client.get(f"{self.url}/health", timeout=5.0)
                    if r.status_code == 200 and await asyncio.to_thread(
                            listener_ownership, self.proc.pid, host, port) is Ownership.OURS:
                        return
                except httpx.HTTPError:
                    pass
            if time.monotonic() > deadline:
                await self.kill()
                raise EngineStartError(f"{self.engine_id}: not healthy after {self.cfg.startup_timeout_s} s; "
                                       f"log tail:\n{_tail(log_path)}")
            # A server coming up has no event to await from outside; wait on its exit or 100 ms.
            try:
                await asyncio.wait_for(self._exited.wait(), 0.1)
            except asyncio.TimeoutError:
                pass

    async def _discard(self) -> None:
        """Kills a server that lost its port and waits (bounded) for its exit, then forgets it: its exit is
        not the engine's, and the next attempt gets a fresh exit event."""
        assert self.proc is not None
        try:  # the whole group, even if the leader has exited already (SGLang's children may not have)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            await asyncio.wait_for(self._exited.wait(), self.cfg.shutdown_timeout_s)
        except asyncio.TimeoutError:
            pass  # SIGKILLed: it cannot hold the port for long, and _die_with_parent ends it with the actor
        self.proc, self.exit_code, self._exited = None, None, asyncio.Event()

    async def _reap(self) -> None:
        proc, exited = self.proc, self._exited
        assert proc is not None
        code = await proc.wait()
        if self.proc is proc:  # not a server discarded after a port clash
            self.exit_code = code
        exited.set()

    async def info(self) -> EngineInfo:
        """Where the engine serves and which weights it holds."""
        import ray

        return EngineInfo(engine_id=self.engine_id, kind=self.cfg.kind, url=self.url,
                          pid=self.proc.pid if self.proc else -1, actor_pid=os.getpid(),
                          node_id=ray.get_runtime_context().get_node_id(), weight_version=await self.weight_version(),
                          started_s=self.started_s)

    async def ping(self) -> str:
        """Answers at once from the actor's event loop (no server I/O)."""
        return self.engine_id

    async def wait_exit(self) -> int:
        """Returns the server's exit code when it exits (pending until then)."""
        await self._exited.wait()
        assert self.exit_code is not None
        return self.exit_code

    def server_alive(self) -> bool:
        return self.proc is not None and not self._exited.is_set()

    async def weight_version(self) -> str:
        """The version the server reports (SGLang 0.5.23 puts it in /get_model_info)."""
        r = await self._client().get(f"{self.url}/get_model_info", timeout=self.cfg.shutdown_timeout_s)
        r.raise_for_status()
        return str(r.json().get("weight_version", "default"))

    async def call(self, method: str, path: str, body: Optional[dict] = None, timeout: float = 60.0) -> Any:
        """Forwards one HTTP call to the server (admin routes: refit, pause, memory)."""
        r = await self._client().request(method, f"{self.url}{path}", json=body, timeout=timeout)
        try:
            data = r.json()
        except ValueError:
            data = r.text
        return {"status": r.status_code, "body": data}

    async def set_background(self, nice: int) -> int:
        """Runs the server, and this actor's own process with it, `nice` steps below the server's start-up CPU
        priority (0: back to it); returns the offset now in effect. A standby parks in the background so that
        its refits yield the CPU to serving engines: the actor too, since it is woken for each refit and its
        Ray threads catch up then, beside the rollout's first turns. It is put there only where it can be
        brought back (`can_restore_priority`): a promoted standby must never serve at reduced priority.
        Returns 0 without a change where it could not come back."""
        if self.proc is None or self._exited.is_set():
            return self._nice
        if self._base_nice is None:
            try:
                self._base_nice = os.getpriority(os.PRIO_PROCESS, self.proc.pid)
            except OSError:
                return self._nice
        if nice > 0 and not await asyncio.to_thread(can_restore_priority):
            return self._nice
        # the tree from this actor's process: its threads and the server's (a child of it)
        await asyncio.to_thread(renice_tree, os.getpid(), min(19, self._base_nice + max(0, nice)))
        self._nice = max(0, nice)
        return self._nice

    async def kill(self, sig: int = signal.SIGKILL) -> None:
        """Sends `sig` to the server's process group."""
        if self.proc is not None and not self._exited.is_set():
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    async def stop(self) -> Optional[int]:
        """Terminates the server (SIGTERM, then SIGKILL after shutdown_timeout_s) and returns its exit code."""
        if self.proc is None:
            return None
        await self.kill(signal.SIGTERM)
        try:
            await asyncio.wait_for(self._exited.wait(), self.cfg.shutdown_timeout_s)
        except asyncio.TimeoutError:
            await self.kill(signal.SIGKILL)
            await asyncio.wait_for(self._exited.wait(), self.cfg.shutdown_timeout_s)
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        return self.exit_code


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return "(no log)"


def remote_engine_actor(cfg: EnginesConfig, name: Optional[str] = None, **options: Any) -> Any:
    """The Ray actor class with resources from `cfg`; Ray never restarts it (Belayer's policy does)."""
    import ray

    opts: dict[str, Any] = {"num_cpus": cfg.num_cpus_per_engine, "num_gpus": cfg.num_gpus_per_engine,
                            "max_restarts": 0, "max_task_retries": 0, "max_concurrency": 64}
    if name:
        opts["name"] = name
    opts.update(options)
    return ray.remote(EngineActor).options(**opts)
