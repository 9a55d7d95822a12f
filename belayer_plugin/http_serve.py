"""Serving an aiohttp application on one host and port (Belayer's front and fleet control server).

Owns: starting an aiohttp app and reporting its URL. Must not: define routes.
"""

from __future__ import annotations

from aiohttp import web


async def start_app(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, str]:
    """Starts `app` on host:port (0 picks a free port); returns its runner (for cleanup) and its URL."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner, f"http://{host}:{runner.addresses[0][1]}"  # the port bound when 0 was asked
