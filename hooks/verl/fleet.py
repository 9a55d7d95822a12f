"""Attaches a Belayer fleet (health monitor, restart policy, weight-version fencing) to a verl load balancer.

verl 0.9.1's load balancer holds `{server id: actor handle}`; its replicas have no restart hook of their own.
When the rollout servers are Belayer engines, the fleet watches them (Ray liveness in every phase, readiness
while serving), restarts them under its bounded policy and refits them to the current weights; this bridge
mirrors the fleet's membership into the balancer: an engine leaves the balancer as soon as it is DEAD (or
RETIRED, RESTARTING or STALE) and its replacement joins once HEALTHY with current weights. Every change the
balancer confirms is an event (component "verl": `evicted` / `admitted`), so tests and reports can await it.

Owns: attaching a FleetManager to verl's balancer. Must not: duplicate the fleet's logic.
"""

from __future__ import annotations

import asyncio
from typing import Any

from belayer_plugin.events import Event
from belayer_plugin.fleet.manager import FleetManager

_GONE = {"DEAD", "RETIRED", "RESTARTING", "STALE"}  # STALE: wrong weights, never routed


def fleet_servers(fleet: FleetManager) -> dict[str, Any]:
    """The servers dict verl's get_router_handle takes: {engine url: engine actor} of the serving engines."""
    return {s.info.url: s.actor for s in fleet.serving_slots()}


class FleetBridge:
    def __init__(self, fleet: FleetManager, balancer: Any):
        self.fleet, self.balancer = fleet, balancer
        self.loop = asyncio.get_running_loop()
        self.urls: dict[str, str] = {s.slot_id: s.info.url for s in fleet.serving_slots()}
        self.tasks: set[asyncio.Task] = set()
        fleet.events.subscribe(self._on_event)

    def _on_event(self, ev: Event) -> None:  # any thread; the work runs on the fleet's loop
        if ev.component != "fleet" or ev.kind != "transition":
            return
        self.loop.call_soon_threadsafe(self._spawn, ev.subject, str(ev.to_state).upper())

    def _spawn(self, slot_id: str, to_state: str) -> None:
        t = self.loop.create_task(self._apply(slot_id, to_state))
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    async def _apply(self, slot_id: str, to_state: str) -> None:
        ev = self.fleet.events
        if to_state in _GONE:
            url = self.urls.pop(slot_id, None)
            if url is not None:
                await self.balancer.evict.remote(url, f"fleet: {slot_id} is {to_state}")
                ev.emit("verl", slot_id, "evicted", f"{url} left the load balancer", url=url)
        elif to_state == "HEALTHY":
            s = self.fleet.slots.get(slot_id)
            if s is None or s.info is None or self.urls.get(slot_id) == s.info.url:
                return
            admitted = await self.balancer.add_servers.remote({s.info.url: s.actor})
            if s.info.url in admitted:
                self.urls[slot_id] = s.info.url
                ev.emit("verl", slot_id, "admitted", f"{s.info.url} joined the load balancer", url=s.info.url,
                        version=s.served_version)
            else:
                ev.emit("verl", slot_id, "admit_refused", f"{s.info.url} not ready", level="warning")

    async def close(self) -> None:
        self.fleet.events._subscribers.remove(self._on_event)
        for t in list(self.tasks):
            t.cancel()
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=5)


def attach_fleet(fleet: FleetManager, balancer: Any) -> FleetBridge:
    """Call from the driver's event loop after `fleet.start()` and building the balancer."""
    return FleetBridge(fleet, balancer)
