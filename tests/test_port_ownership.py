"""A server Belayer starts is used only once the listener on its port is known to be its own.

A port from free_port() is free when picked, not when the server binds it; another process (another job's
router, another test) that takes it first would answer readiness probes in the server's place. These tests
hand the router and the engine actor a port that another process listens on, and check that they end up
with a server of their own (or fail naming the clash where the port is fixed), and that the ownership
helper in belayer_plugin.ports tells our listeners from others'.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import socket
import sys
from typing import AsyncIterator, Callable, Iterator

import httpx
import pytest
from aiohttp import web

from belayer_plugin.engines.launch import free_port
from belayer_plugin.fleet.router import Router, RouterError
from belayer_plugin.http_serve import start_app
from belayer_plugin.ports import (Ownership, PortClashError, listener_holders, listener_ownership,
                                  log_says_address_in_use, log_size)
from tests.conftest import belayer_cfg

pytestmark = pytest.mark.timeout(120)

HOST = "127.0.0.1"

# A stand-in server in a child process: binds port 0 (so it cannot clash itself) and prints its port.
SERVER = ("import http.server, sys; s = http.server.HTTPServer((sys.argv[1], 0), http.server.BaseHTTPRequestHandler);"
          " print(s.server_port, flush=True); s.serve_forever()")
# A launcher that runs the server as its child, as a Python launcher may run the real server.
LAUNCHER = "import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', sys.argv[1], sys.argv[2]]))"


@dataclasses.dataclass
class Foreign:
    """An HTTP server in the test's process, which is no router's or engine's: it answers 200 to anything."""

    port: int
    hits: list[str]


@contextlib.asynccontextmanager
async def foreign_server() -> AsyncIterator[Foreign]:
    hits: list[str] = []

    async def anything(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.json_response({"workers": [], "status": "foreign"})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    runner, url = await start_app(app, HOST, 0)
    try:
        yield Foreign(int(url.rsplit(":", 1)[1]), hits)
    finally:
        await runner.cleanup()


def ports_then_free(*first: int) -> Callable[[str], int]:
    """A free_port stand-in: returns `first` in order, then really free ports."""
    queue = list(first)

    def pick(host: str = HOST) -> int:
        return queue.pop(0) if queue else free_port(host)

    return pick


def router_cfg(**fields):
    return dataclasses.replace(belayer_cfg().router, **fields)


async def _owned(pid: int, port: int) -> Ownership:
    return await asyncio.to_thread(listener_ownership, pid, HOST, port)


@contextlib.asynccontextmanager
async def child_server(code: str, *args: str) -> AsyncIterator[tuple[asyncio.subprocess.Process, int]]:
    """A child process running `code` (SERVER or LAUNCHER), and the port its server printed."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, *args, stdout=asyncio.subprocess.PIPE,
                                                start_new_session=True)
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        yield proc, int(line)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await asyncio.wait_for(proc.wait(), 10)


@contextlib.contextmanager
def sleeper() -> Iterator[int]:
    """A process that holds no socket: a server that has not bound its port yet."""
    import subprocess

    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        yield p.pid
    finally:
        p.kill()
        p.wait(10)


# --- the ownership helper --------------------------------------------------------------------------------


def test_a_listener_this_process_holds_is_ours_and_an_unbound_port_has_no_listener():
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]
        assert listener_ownership(os.getpid(), HOST, port) is Ownership.NONE  # bound, not listening
        s.listen()
        assert listener_ownership(os.getpid(), HOST, port) is Ownership.OURS
        assert os.getpid() in listener_holders(HOST, port)
    assert listener_ownership(os.getpid(), HOST, port) is Ownership.NONE


@pytest.mark.parametrize("bind", ["127.0.0.1", "0.0.0.0"])
async def test_another_process_listener_is_foreign_and_ours_only_from_its_own_tree(bind):
    with sleeper() as other:
        async with child_server(SERVER, bind) as (server, port):
            # the would-be server that has not bound yet: the listener there belongs to someone else
            assert await _owned(other, port) is Ownership.FOREIGN
            assert await _owned(server.pid, port) is Ownership.OURS
            assert server.pid in listener_holders(HOST, port)
            with pytest.raises(PortClashError, match=f"port {port} .*pid {server.pid}"):
                raise PortClashError(HOST, port)


async def test_a_listener_held_by_a_child_of_the_started_process_is_ours():
    with sleeper() as other:
        async with child_server(LAUNCHER, SERVER, HOST) as (launcher, port):
            assert await _owned(launcher.pid, port) is Ownership.OURS
            assert await _owned(other, port) is Ownership.FOREIGN
            assert launcher.pid not in listener_holders(HOST, port)  # the grandchild holds it


def test_a_failed_bind_counts_only_when_logged_after_the_start(tmp_path):
    log = tmp_path / "server.log"
    assert log_size(log) == 0 and not log_says_address_in_use(log)
    log.write_text("RuntimeError: Address already in use (os error 98)\n")
    since = log_size(log)
    assert log_says_address_in_use(log) and not log_says_address_in_use(log, since)
    with open(log, "a") as f:
        f.write("ERROR: [Errno 98] error while attempting to bind on address: address already in use\n")
    assert log_says_address_in_use(log, since)


# --- the router ------------------------------------------------------------------------------------------


async def test_router_given_a_port_another_process_answers_workers_on_starts_its_own_elsewhere(
        tmp_path, monkeypatch):
    async with foreign_server() as foreign:
        monkeypatch.setattr("belayer_plugin.fleet.router.free_port", ports_then_free(foreign.port))
        router = Router(router_cfg(port=0, prometheus_port=0), tmp_path)
        try:
            url = await router.start()
            port = int(url.rsplit(":", 1)[1])
            assert port != foreign.port
            assert await _owned(router.proc.pid, port) is Ownership.OURS
            assert await _owned(router.proc.pid, router.prometheus_port) is Ownership.OURS
            assert await router.workers() == []
            assert foreign.hits == []  # readiness never asked the other process
        finally:
            await router.aclose()


async def test_router_with_its_configured_port_held_by_another_process_fails_naming_the_clash(tmp_path):
    async with foreign_server() as foreign:
        router = Router(router_cfg(port=foreign.port, prometheus_port=0), tmp_path)
        try:
            clash = f"configured port {foreign.port}.*another process.*pid {os.getpid()}"
            with pytest.raises(RouterError, match=clash):
                await router.start()
            assert foreign.hits == []
            assert router.proc.poll() is not None  # the router it started is not left behind
        finally:
            await router.aclose()


async def test_router_given_a_prometheus_port_another_process_holds_starts_its_own_elsewhere(
        tmp_path, monkeypatch):
    async with foreign_server() as foreign:
        monkeypatch.setattr("belayer_plugin.fleet.router.free_port", ports_then_free(free_port(), foreign.port))
        router = Router(router_cfg(port=0, prometheus_port=0), tmp_path)
        try:
            await router.start()
            assert router.prometheus_port != foreign.port
            assert await _owned(router.proc.pid, router.prometheus_port) is Ownership.OURS
            async with httpx.AsyncClient() as c:
                assert (await c.get(f"http://{HOST}:{router.prometheus_port}/metrics", timeout=5)).status_code == 200
            assert await router.workers() == []
            assert router.proc.poll() is None
            assert foreign.hits == []
        finally:
            await router.aclose()


async def test_two_routers_given_the_same_free_port_both_start_on_distinct_ports_of_their_own(
        tmp_path, monkeypatch):
    shared = free_port()
    # Router A picks (shared, free), then router B picks (shared, free): both start at once on one port.
    monkeypatch.setattr("belayer_plugin.fleet.router.free_port", ports_then_free(shared, free_port(), shared))
    routers = [Router(router_cfg(port=0, prometheus_port=0), tmp_path / name) for name in ("a", "b")]
    try:
        urls = await asyncio.gather(*(r.start() for r in routers))
        ports = [int(u.rsplit(":", 1)[1]) for u in urls]
        assert ports[0] != ports[1] and shared in ports  # the one that bound it first kept it
        for r, port, other in zip(routers, ports, reversed(routers)):
            assert r.proc.poll() is None
            assert await _owned(r.proc.pid, port) is Ownership.OURS
            assert await _owned(r.proc.pid, r.prometheus_port) is Ownership.OURS
            assert await _owned(other.proc.pid, port) is Ownership.FOREIGN
            assert await r.workers() == []
    finally:
        for r in routers:
            await r.aclose()


# --- the engine actor ------------------------------------------------------------------------------------


async def test_engine_given_a_port_another_process_answers_health_on_starts_its_own_elsewhere(
        ray_cluster, tiny_model, tmp_path, monkeypatch):
    from belayer_plugin.engines.actor import EngineActor

    async with foreign_server() as foreign:
        monkeypatch.setattr("belayer_plugin.engines.actor.free_port", ports_then_free(foreign.port))
        actor = EngineActor("engine-x", belayer_cfg().engines, tiny_model, str(tmp_path))
        try:
            info = await actor.start()
            port = int(info.url.rsplit(":", 1)[1])
            assert port != foreign.port
            assert await _owned(info.pid, port) is Ownership.OURS
            assert actor.server_alive() and info.weight_version == "default"
            assert foreign.hits == []
        finally:
            await actor.stop()


# --- a real SGLang server (outside Ray) ------------------------------------------------------------------


def _sglang_cfg():
    return belayer_cfg("belayer.engines.kind=sglang").engines


def _no_sglang_venv() -> bool:
    from belayer_plugin.engines.sglang import resolve_python

    return not resolve_python(_sglang_cfg().sglang.python).is_file()


@pytest.mark.sglang
@pytest.mark.timeout(300)
@pytest.mark.skipif(_no_sglang_venv(), reason="no SGLang venv (bash .ci/setup_sglang.sh)")
async def test_sglang_server_given_a_port_another_process_holds_serves_its_first_token_elsewhere(
        tiny_model, tmp_path, monkeypatch):
    from belayer_plugin.engines.sglang import start_sglang_server, stop_sglang_server

    cfg = _sglang_cfg()
    async with foreign_server() as foreign:
        monkeypatch.setattr("belayer_plugin.engines.address.free_port", ports_then_free(foreign.port))
        proc, url, _ = await asyncio.to_thread(start_sglang_server, cfg, tiny_model, tmp_path / "server.log")
        try:
            port = int(url.rsplit(":", 1)[1])
            assert port != foreign.port
            assert await _owned(proc.pid, port) is Ownership.OURS
            assert foreign.hits == []
        finally:
            await asyncio.to_thread(stop_sglang_server, proc, 3)
