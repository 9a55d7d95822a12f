"""Router membership and engine selection: which slots serve, and registering them with sglang-router.

Owns: each slot's `registered` flag and the rule that only a HEALTHY engine at the fleet's weight version is
registered (and deregistered, confirmed, before it is killed). Must not: change a slot's health, start or
stop engines; a router that refuses a registration is reported as a signal to the fleet (`_on_signal`).
"""

from __future__ import annotations

import time
from typing import Optional

from belayer_plugin.fleet.health import Signal, State
from belayer_plugin.fleet.router import RouterError
from belayer_plugin.fleet.slot import NoHealthyEngineError, Slot


class Membership:
    """FleetManager's router membership and engine selection (a mixin).

    Uses from the fleet: slots, router, weights, events, raise_if_fatal, _on_signal."""

    @property
    def url(self) -> Optional[str]:
        return self.router.url if self.router else None

    def states(self) -> dict[str, str]:
        return {sid: s.health.state.value for sid, s in self.slots.items()}

    def serving_slots(self) -> list[Slot]:
        """Slots requests may be routed to (serving health, not being drained)."""
        return [s for s in self.slots.values() if s.health.serving and s.info is not None and not s.draining]

    def pick_engine(self) -> Slot:
        """Direct mode: the least-loaded HEALTHY engine (SUSPECT ones only if nothing else serves)."""
        return self.pick_engine_excluding_urls(set())

    def pick_engine_excluding_urls(self, exclude: set[str]) -> Slot:
        """Like pick_engine, skipping engines by URL (a request's failed engines, not their replacements)."""
        self.raise_if_fatal()
        cands = [s for s in self.serving_slots() if s.info.url not in exclude]
        healthy = [s for s in cands if s.health.state is State.HEALTHY] or cands
        if not healthy:
            raise NoHealthyEngineError(f"no serving engine outside {sorted(exclude)} (states: {self.states()})")
        return min(healthy, key=lambda s: (s.inflight, s.slot_id))

    def slot_for_url(self, url: str) -> Optional[Slot]:
        return next((s for s in self.slots.values() if s.info is not None and s.info.url == url), None)

    async def _deregister(self, s: Slot) -> None:
        if self.router is not None and s.info is not None and s.registered:
            t0 = time.monotonic()
            await self.router.remove(s.info.url)  # confirmed: RouterError if it does not take effect
            self.events.emit("fleet", s.slot_id, "deregistered", f"{s.info.url} removed from the router",
                             took_s=round(time.monotonic() - t0, 4))
        s.registered = False

    async def _register(self, s: Slot) -> None:
        assert s.health.state is State.HEALTHY and s.served_version == self.weights.version, \
            "only a HEALTHY engine with current weights may be registered"
        if self.router is not None and s.info is not None and not s.registered:
            await self.router.add(s.info.url)
            self.events.emit("fleet", s.slot_id, "registered", f"{s.info.url} added to the router",
                             version=s.served_version)
        s.registered = True

    async def _try_register(self, s: Slot) -> None:
        """Registers `s`; a router that refuses it makes the slot SUSPECT (probes then confirm or clear it)."""
        try:
            await self._register(s)
        except RouterError as e:
            await self._on_signal(s.slot_id, Signal.REQUEST_FAILED, s.health.incarnation, f"register failed: {e}")
