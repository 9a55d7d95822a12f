"""The real sglang-router: its process on loopback, and membership through its /workers API.

The router never evicts a dead worker by itself (0.3.2 only marks it unhealthy after threshold x
interval, and cache affinity keeps choosing it), so Belayer deregisters before it kills and confirms
every membership change by reading the table back.

Owns: the sglang-router process and confirmed add/remove of workers. Must not: decide which engines are
routable (fleet/membership.py does).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx

from belayer_plugin.config import RouterConfig
from belayer_plugin.engines.launch import free_port
from belayer_plugin.ports import (PORT_ATTEMPTS, Ownership, PortClashError, describe_holders, listener_ownership,
                                  log_says_address_in_use, log_size)


class RouterError(RuntimeError):
    """The router did not start, or a membership change did not take effect in time."""


def router_host(configured: str) -> str:
    """The address the router (and NeMo-RL's refit gateway beside it) binds and names in its URL: `router.host`
    when set, else the driver node's own address as Ray registered it (engines.launch.engine_host: 127.0.0.1
    on Belayer's loopback local cluster, the node's address on a cluster of several nodes, so that trainers
    and clients on other nodes reach it). Never a wildcard (RouterConfig.problems refuses one)."""
    from belayer_plugin.engines.launch import engine_host

    return engine_host(configured)


class Router:
    """One sglang-router process and a client for its /workers table."""

    def __init__(self, cfg: RouterConfig, log_dir: Path):
        self.cfg = cfg
        self.host = router_host(cfg.host)
        self.log_dir = Path(log_dir)
        self.proc: Optional[subprocess.Popen] = None
        self.url = ""
        self.prometheus_port = 0  # where its Prometheus exporter listens, once started
        self._client = httpx.AsyncClient()

    async def start(self) -> str:
        """Starts the router (both its HTTP and Prometheus servers on `self.host`) and returns its URL once the
        process listening there is known to be the one started here.

        A port from free_port() can be taken by another process (another job's router, another test) before
        the router binds it; the router then dies with "Address already in use" while the other process
        answers GET /workers in its place. So readiness needs both listeners held by our process
        (ports.listener_ownership) before it probes, and a clash starts again on fresh ports
        (ports.PORT_ATTEMPTS in all); a port fixed in the config that another process holds is a
        RouterError naming it. All attempts together are bounded by startup_timeout_s."""
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        clashes: list[str] = []
        for _ in range(PORT_ATTEMPTS):
            port, prom = self._pick_ports()
            try:
                return await self._start_once(port, prom, deadline)
            except PortClashError as e:
                self.stop()
                clashes.append(str(e))
        raise RouterError(f"sglang-router lost its port to another process {PORT_ATTEMPTS} times: "
                          + "; ".join(clashes))

    def _pick_ports(self) -> tuple[int, int]:
        """The HTTP and Prometheus ports for one start: the configured ones, else fresh free ports (distinct:
        the first is not held while the second is picked, so the OS may offer it twice)."""
        host = self.host
        port = self.cfg.port or free_port(host)
        prom = self.cfg.prometheus_port
        if not prom:
            for _ in range(100):  # a repeat is rare; bounded all the same
                prom = free_port(host)
                if prom != port:
                    break
        return port, prom

    async def _start_once(self, port: int, prom: int, deadline: float) -> str:
        """One start on (port, prom); PortClashError if another process holds or took either port."""
        host = self.host
        argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port),
                "--prometheus-host", host, "--prometheus-port", str(prom), "--policy", self.cfg.policy,
                "--request-timeout-secs", str(self.cfg.request_timeout_s),
                "--health-check-interval-secs", str(self.cfg.health_check_interval_s),
                "--health-check-endpoint", self.cfg.health_check_endpoint]
        if self.cfg.disable_retries:
            argv.append("--disable-retries")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / "router.log"
        since = log_size(log_path)  # the log is appended to: only this start's lines count
        with open(log_path, "ab") as logf:
            self.proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        self.url, self.prometheus_port = f"http://{host}:{port}", prom
        fixed = {p for p in (self.cfg.port, self.cfg.prometheus_port) if p}
        while True:
            own = {p: await asyncio.to_thread(listener_ownership, self.proc.pid, host, p) for p in (port, prom)}
            foreign = [p for p, o in own.items() if o is Ownership.FOREIGN]
            for p in foreign:
                if p in fixed:  # no fresh port to move to: say who holds it
                    self.stop()
                    raise RouterError(f"sglang-router cannot listen on its configured port {p}: {host}:{p} is "
                                      f"held by another process ({describe_holders(host, p)})")
            if foreign:  # the router cannot bind it (or would share it): whatever answers there is not ours
                raise PortClashError(host, foreign[0])
            if self.proc.poll() is not None:
                if log_says_address_in_use(log_path, since):  # lost a clash to a process that has gone since
                    raise PortClashError(host, port, "sglang-router exited: its log reports a failed bind")
                raise RouterError(f"sglang-router exited with {self.proc.returncode}; see {log_path}")
            if all(o is Ownership.OURS for o in own.values()):
                # Our process holds the listener before and after this request (it cannot pass to another
                # process and back meanwhile), so our router answered it and nobody else.
                try:
                    r = await self._client.get(f"{self.url}/workers", timeout=2.0)
                    if r.status_code == 200 and await asyncio.to_thread(
                            listener_ownership, self.proc.pid, host, port) is Ownership.OURS:
                        return self.url
                except httpx.HTTPError:
                    pass
            if time.monotonic() > deadline:
                self.stop()
                raise RouterError(f"sglang-router not ready after {self.cfg.startup_timeout_s} s")
            await asyncio.sleep(0.05)  # the router has no readiness event to await; bounded by the deadline

    async def workers(self) -> list[dict]:
        """The router's worker table."""
        r = await self._client.get(f"{self.url}/workers", timeout=5.0)
        r.raise_for_status()
        return r.json().get("workers", [])

    async def worker_urls(self) -> set[str]:
        return {w["url"] for w in await self.workers()}

    async def add(self, url: str) -> None:
        """Registers a worker and waits until the table shows it healthy."""
        r = await self._client.post(f"{self.url}/workers", json={"url": url}, timeout=5.0)
        if r.status_code not in (200, 201, 202):
            raise RouterError(f"POST /workers {url}: HTTP {r.status_code} {r.text[:200]}")
        await self._wait(lambda ws: any(w["url"] == url and w.get("is_healthy", True) for w in ws),
                         f"{url} to join the router")

    async def remove(self, url: str) -> None:
        """Deregisters a worker (every entry with that URL) and waits until the table no longer has it."""
        for w in await self.workers():
            if w["url"] == url:
                r = await self._client.delete(f"{self.url}/workers/{w['id']}", timeout=5.0)
                if r.status_code not in (200, 202, 204, 404):
                    raise RouterError(f"DELETE /workers/{w['id']} ({url}): HTTP {r.status_code} {r.text[:200]}")
        await self._wait(lambda ws: all(w["url"] != url for w in ws), f"{url} to leave the router")

    async def _wait(self, done, what: str) -> None:
        deadline = time.monotonic() + self.cfg.membership_timeout_s
        while True:
            if done(await self.workers()):
                return
            if time.monotonic() > deadline:
                raise RouterError(f"timed out after {self.cfg.membership_timeout_s} s waiting for {what}")
            await asyncio.sleep(0.01)  # the router applies changes in the background; poll its table

    def stop(self) -> None:
        """Stops the router process."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)

    async def aclose(self) -> None:
        self.stop()
        await self._client.aclose()
