"""The fleet's control server: planned drains, scaling and rolling upgrades over HTTP (loopback by default).

    GET  /fleet                                  engines, states, versions, requests in flight
    POST /drain            {"engine": "engine-1"}
    POST /scale_in         {"n": 1}
    POST /scale_out        {"n": 1}
    POST /rolling_upgrade  {"weights_path": "...", "version": "v2"}

Malformed bodies are 400, an unknown engine 404, a refused or failed change (floor, not serving, timeout)
409; in every refused case the fleet is unchanged. `belayer fleet ...` is its command-line client.

Owns: the control server's routes and their validation. Must not: act on engines itself (it calls the
FleetManager it was given) or import fleet/manager.py (the manager starts it).
"""

from __future__ import annotations

import json
from typing import Any, Optional

from aiohttp import web

from belayer_plugin.fleet.slot import DrainError
from belayer_plugin.http_serve import start_app


class ControlServer:
    """An aiohttp server acting on one FleetManager."""

    def __init__(self, fleet: Any, host: str = "127.0.0.1", port: int = 0):
        # fleet: the FleetManager, untyped here: it starts this server, and this module must not import it.
        self.fleet = fleet
        self.host, self.port = host, port
        self.url = ""
        self._runner: Optional[web.AppRunner] = None

    def status(self) -> dict:
        """The fleet as the control server reports it."""
        fm = self.fleet
        return {"version": fm.weights.version, "phase": fm.phase.value,
                "standbys": len(fm.shadows.ready) if fm.shadows is not None else 0,
                "engines": {sid: {"state": s.health.state.value, "url": s.info.url if s.info else None,
                                  "version": s.served_version, "inflight": s.inflight, "draining": s.draining,
                                  "registered": s.registered} for sid, s in fm.slots.items()}}

    async def start(self) -> str:
        app = web.Application()
        app.add_routes([web.get("/fleet", self._status), web.post("/drain", self._drain),
                        web.post("/scale_in", self._scale_in), web.post("/scale_out", self._scale_out),
                        web.post("/rolling_upgrade", self._upgrade)])
        self._runner, self.url = await start_app(app, self.host, self.port)
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _status(self, _: web.Request) -> web.Response:
        return web.json_response(self.status())

    async def _act(self, request: web.Request, fields: dict[str, type], act: Any) -> web.Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error("body is not valid JSON", 400)
        problems = [] if isinstance(body, dict) else ["body must be a JSON object"]
        for name, typ in fields.items():
            v = body.get(name) if isinstance(body, dict) else None
            if not isinstance(v, typ) or isinstance(v, bool):
                problems.append(f"{name}: a {typ.__name__} is required, got {v!r}")
        if problems:
            return _error("; ".join(problems), 400)
        try:
            out = await act(body)
        except DrainError as e:
            return _error(str(e), 404 if str(e).startswith("no engine") else 409)
        return web.json_response({"ok": True, "result": out, "fleet": self.status()})

    async def _drain(self, request: web.Request) -> web.Response:
        return await self._act(request, {"engine": str}, lambda b: self.fleet.drain(b["engine"]))

    async def _scale_in(self, request: web.Request) -> web.Response:
        return await self._act(request, {"n": int}, lambda b: self.fleet.scale_in(b["n"]))

    async def _scale_out(self, request: web.Request) -> web.Response:
        return await self._act(request, {"n": int}, lambda b: self.fleet.scale_out(b["n"]))

    async def _upgrade(self, request: web.Request) -> web.Response:
        return await self._act(request, {"weights_path": str, "version": str},
                               lambda b: self.fleet.rolling_upgrade(b["weights_path"], b["version"]))


def _error(msg: str, status: int) -> web.Response:
    return web.json_response({"ok": False, "error": {"message": msg, "code": status}}, status=status)
