"""A relay between a trainer that streams weights into the engines itself and the fleet's engines.

NeMo-RL's SGLang refit has every policy worker POST its weight buckets to the engine URLs the generation
backend hands out (`get_rollout_engine_urls()`), with `requests.post` and no timeout, then retry
`/flush_cache`. An engine that dies during the stream makes that POST raise and the refit end the run; one
that hangs (SIGSTOP, a wedged scheduler) holds the trainer forever. Belayer hands out one gateway URL per
slot instead (`open()`), and relays each request to the engine incarnation the slot had when the refit began:

- relayed as is when the engine answers (an HTTP error from a live engine is the engine's answer, passed on);
- absorbed when the slot has no live engine of that incarnation (dead, restarted meanwhile, retired), when the
  connection fails, or when no answer comes within `timeout_s` (the engine is then fenced: reported KILLED, so
  the fleet kills and restarts it). Absorbed requests answer 200 with `success: true` and a message that names
  the slot and why, so the trainer's refit completes on the other engines.
A slot that missed one request of a refit misses the rest of it (a later bucket must never reach a restarted
engine that lacks the earlier ones). Such an engine never reports the streamed version, so the fleet keeps it
STALE (not routed) until a later refit streams all of it there (FleetManager.adopt_version checks each
engine's own report). `missed` says which slots missed the current refit and why.

Owns: the per-slot relay URLs of a streamed refit and which slots missed it. Must not: load weights itself or
fence by any other path than a KILLED report to the fleet.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Iterable, Optional

import aiohttp
from aiohttp import web

from belayer_plugin.fleet.health import Signal
from belayer_plugin.http_serve import start_app

if TYPE_CHECKING:
    from belayer_plugin.fleet.manager import FleetManager

__all__ = ["RefitGateway"]

MAX_BODY = 1 << 31  # a weight bucket (CPU test bodies carry the tensors themselves; GPU ones CUDA IPC handles)


class RefitGateway:
    """Per-slot relay for the trainer's weight stream (see the module doc)."""

    def __init__(self, fleet: "FleetManager", host: str, timeout_s: float):
        self.fleet, self.host, self.timeout_s = fleet, host, timeout_s
        self.url = ""
        self.missed: dict[str, str] = {}  # slot -> why it missed the current refit
        self.relayed: dict[str, int] = {}  # slot -> requests relayed in the current refit
        self._pins: dict[str, Optional[str]] = {}  # slot -> engine URL of the incarnation the refit streams to
        self._runner: Optional[web.AppRunner] = None
        self._session: Optional[aiohttp.ClientSession] = None

    async def start(self) -> str:
        """Serves the gateway on `host` (port chosen while binding); returns its base URL."""
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_route("*", "/slot/{sid}/{tail:.*}", self._handle)
        self._runner, self.url = await start_app(app, self.host, 0)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        return self.url

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()

    def open(self, slot_ids: Iterable[str]) -> list[str]:
        """A refit begins: pins each slot to its current engine and returns one gateway URL per slot."""
        self.missed, self.relayed, self._pins = {}, {}, {}
        urls = []
        for sid in slot_ids:
            s = self.fleet.slots[sid]
            usable = s.info is not None and s.health.running
            self._pins[sid] = s.info.url if usable else None
            if not usable:
                self._miss(sid, f"no engine to stream to (state {s.health.state.value})")
            urls.append(f"{self.url}/slot/{sid}")
        return urls

    def _miss(self, sid: str, why: str) -> None:
        if sid not in self.missed:
            self.missed[sid] = why
            self.fleet.events.emit("fleet", sid, "refit_missed", why, level="warning",
                                   version_pending=True, relayed=self.relayed.get(sid, 0))

    def _absorbed(self, sid: str, tail: str) -> web.Response:
        msg = f"belayer: engine slot {sid} missed this refit ({self.missed[sid]}); not routed until a refit reaches it"
        if tail.startswith("update_weights"):
            return web.json_response({"success": True, "message": msg})
        return web.Response(text=msg)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        sid, tail = request.match_info["sid"], request.match_info["tail"]
        if sid not in self._pins:
            return web.json_response({"error": f"no slot {sid!r} in this refit"}, status=404)
        pin = self._pins[sid]
        s = self.fleet.slots[sid]
        if sid not in self.missed and (pin is None or s.info is None or s.info.url != pin):
            self._miss(sid, "its engine was replaced during the refit")
        if sid in self.missed:
            return self._absorbed(sid, tail)
        body = await request.read()
        t0 = time.monotonic()
        try:
            async with self._session.request(request.method, f"{pin}/{tail}", data=body,
                                             params=request.query,
                                             headers={"Content-Type": request.headers.get("Content-Type",
                                                                                          "application/json")},
                                             timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                data = await r.read()
                self.relayed[sid] = self.relayed.get(sid, 0) + 1
                if self.relayed[sid] == 1:  # the stream reached this engine (reports and tests await it)
                    self.fleet.events.emit("fleet", sid, "refit_relayed", f"first {request.method} /{tail}",
                                           status=r.status, url=pin)
                return web.Response(body=data, status=r.status, content_type=r.content_type)
        except asyncio.TimeoutError:
            why = f"no answer to {request.method} /{tail} within {self.timeout_s:g} s"
        except aiohttp.ClientError as e:
            why = f"{type(e).__name__} after {time.monotonic() - t0:.1f} s: {e}"[:300]
        self._miss(sid, why)
        # Fenced either way: a hung engine would hold the next refit too, and one that took part of the stream
        # may report the new version over partial weights. The fleet kills and restarts it (a dead one's
        # liveness report gets there too; the second report is ignored); the trainer goes on.
        await self.fleet.report(sid, Signal.KILLED, f"refit stream cut: {why}", url=pin)
        return self._absorbed(sid, tail)
