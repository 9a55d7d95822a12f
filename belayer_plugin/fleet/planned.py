"""Planned operations: drain, scale in and out, rolling upgrade, and the control server that exposes them.

Planned changes go through the same actions as recovery without being faults: a drain takes an engine out of
the router (confirmed), cuts its requests at their committed position so they continue elsewhere, and only
then stops it; rolling upgrades and scale-in/out are built on it (no restart budget, no node evidence).

Owns: `_elastic` (one planned change at a time), each slot's `draining`/`drain_cut`, and `control` (the HTTP
server, fleet/control.py). Must not: run while the fleet is not serving, or take the fleet below
restart.min_healthy_engines (DrainError, fleet unchanged).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

from belayer_plugin.fleet.health import EngineHealth, Signal, State
from belayer_plugin.fleet.router import RouterError
from belayer_plugin.fleet.slot import DrainError, Phase, Slot, Weights, slot_index


class PlannedOps:
    """FleetManager's planned operations (a mixin: state set up by `_init_planned`).

    Uses from the fleet: cfg, ft, events, slots, monitor, shadows, holder, weights, phase, fatal, _changed,
    _apply, _notify, _register, _deregister, _bring_up, _handover, _update_weights, serving_slots, states,
    raise_if_fatal."""

    def _init_planned(self) -> None:
        self._elastic = asyncio.Lock()  # one planned change (drain, upgrade, scale) at a time
        self.control: Any = None  # the control server, once serve_control() started it

    def is_draining(self, slot_id: str, url: Optional[str] = None, rid: Optional[str] = None) -> bool:
        """Whether `slot_id` (at `url`, when given) is being drained on purpose, or request `rid` was cut there
        by a drain: a request cut there is moved, not failed (no fault report, no attempt spent)."""
        s = self.slots.get(slot_id)
        if s is None or (url is not None and (s.info is None or s.info.url != url)):
            return False
        return s.draining or (rid is not None and rid in s.drain_cut)

    def _check_floor_without(self, leaving: list[Slot]) -> None:
        """Raises DrainError unless enough engines keep serving without `leaving` (one must take the requests)."""
        rest = [s for s in self.serving_slots() if s not in leaving]
        need = max(1, self.cfg.restart.min_healthy_engines)
        if len(rest) < need:
            raise DrainError(f"taking {[s.slot_id for s in leaving]} out would leave {len(rest)} serving engine(s), "
                             f"fewer than {need} (restart.min_healthy_engines="
                             f"{self.cfg.restart.min_healthy_engines}; at least one must take the moved requests); "
                             f"states: {self.states()}")

    def _drainable(self, slot_id: str) -> Slot:
        s = self.slots.get(slot_id)
        if s is None:
            raise DrainError(f"no engine {slot_id!r} in the fleet (engines: {sorted(self.slots)})")
        if s.draining or not s.health.serving or s.info is None:
            raise DrainError(f"{slot_id} is not serving ({s.health.state.value}"
                             f"{', already draining' if s.draining else ''}): nothing to drain")
        return s

    def _check_elastic(self) -> None:
        self.raise_if_fatal()
        if self.phase is not Phase.SERVING:
            raise DrainError(f"the fleet is {self.phase.value}: drains, upgrades and scaling run while serving")

    async def _abort_all(self, s: Slot) -> None:
        """Asks the engine to finish every request it holds with finish_reason abort (the stream's last chunk
        carries every token generated, so the client commits them all: the cut loses nothing)."""
        try:
            r = await asyncio.wait_for(s.actor.call.remote("POST", "/abort_request", {"abort_all": True},
                                                           self.cfg.monitor.liveness_timeout_s * 5),
                                       self.cfg.monitor.liveness_timeout_s * 5)
            if r["status"] != 200:
                raise RuntimeError(f"HTTP {r['status']}: {str(r['body'])[:200]}")
        except Exception as e:  # its clients then fail over when they notice (still no fault: it is draining)
            self.events.emit("fleet", s.slot_id, "abort_failed", f"{type(e).__name__}: {e}"[:300], level="warning")

    async def _drain_out(self, s: Slot, timeout: Optional[float] = None) -> dict:
        """Takes a serving engine out: not routable (selector and router, confirmed), then its requests are cut
        at their committed position until none is left on it. The engine process keeps running. On a timeout
        or a router error the engine is re-admitted and DrainError raised."""
        timeout = self.cfg.engines.drain_timeout_s if timeout is None else timeout
        t0 = time.monotonic()
        s.draining = True  # first: a request cut from here on is moved, not failed, and none is routed here
        inflight, rids = s.inflight, sorted(s.rids)
        self.monitor.unwatch(s.slot_id)  # the abort would fail a probe; the stop below is no death
        self.events.emit("fleet", s.slot_id, "drain_begin", f"{inflight} request(s) in flight", inflight=inflight,
                         requests=rids, version=s.served_version)
        try:
            await self._deregister(s)  # confirmed: the router no longer lists it
            t_out = time.monotonic()
            deadline = t0 + timeout
            while True:
                s.drain_cut |= s.rids  # before the abort: its requests may see it before the call returns
                await self._abort_all(s)
                left = deadline - time.monotonic()
                if s.idle.is_set() or left <= 0:
                    break
                try:
                    # A request picked just before the drain may reach the engine after the abort: abort again
                    # every 0.25 s until the selector has released every request on this slot.
                    await asyncio.wait_for(s.idle.wait(), min(0.25, left))
                    break
                except asyncio.TimeoutError:
                    pass
            if not s.idle.is_set():
                raise DrainError(f"{s.slot_id}: {s.inflight} request(s) still on it after "
                                 f"engines.drain_timeout_s={timeout:g} s")
        except (DrainError, RouterError) as e:
            await self._readmit(s, f"drain failed: {e}")
            self.events.emit("fleet", s.slot_id, "drain_failed", str(e)[:300], level="error")
            raise DrainError(str(e)) from e
        moved = round(time.monotonic() - t0, 4)
        self.events.emit("fleet", s.slot_id, "requests_moved", f"{inflight} request(s) moved off in {moved} s",
                         took_s=moved, router_s=round(t_out - t0, 4), moved=inflight)
        return {"engine": s.slot_id, "moved": inflight, "requests": rids, "moved_s": moved}

    async def _readmit(self, s: Slot, reason: str) -> None:
        """A drained engine (still running, HEALTHY at the current version) serves again."""
        s.draining = False
        if self.ft:
            self.monitor.watch(s.slot_id, s.health.incarnation, s.actor, s.info.url)
            self.monitor.end_grace(s.slot_id, s.health.incarnation)  # it booted long ago: no grace
        if s.served_version == self.weights.version:
            await self._register(s)
        self.events.emit("fleet", s.slot_id, "readmitted", reason, version=s.served_version)
        await self._notify()

    async def _stop_engine(self, s: Slot) -> None:
        """Stops a drained engine's actor and server (SIGTERM, bounded, then Ray's kill)."""
        import ray

        t0 = time.monotonic()
        if s.actor is not None:
            try:
                await asyncio.wait_for(s.actor.stop.remote(), self.cfg.engines.shutdown_timeout_s * 2)
            except Exception:  # hung or dead: ray.kill takes it (and PDEATHSIG its server)
                pass
            ray.kill(s.actor, no_restart=True)
        self.events.emit("fleet", s.slot_id, "engine_stopped", "stopped after a planned drain",
                         took_s=round(time.monotonic() - t0, 4), incarnation=s.health.incarnation)

    async def drain(self, slot_id: str, timeout: Optional[float] = None) -> dict:
        """Planned removal of one engine: it leaves the router (confirmed), its in-flight requests are cut at
        their committed position and continue on other engines, and only then is it stopped; the slot leaves
        the fleet. Spends no restart budget and is no node evidence. Raises DrainError (the engine keeps
        serving) for an unknown or non-serving engine, below the floor, or when requests do not move within
        engines.drain_timeout_s. Returns {engine, moved, requests, moved_s, took_s}."""
        async with self._elastic:
            self._check_elastic()
            s = self._drainable(slot_id)
            self._check_floor_without([s])
            return await self._drain_and_remove(s, timeout)

    async def _drain_and_remove(self, s: Slot, timeout: Optional[float]) -> dict:
        t0 = time.monotonic()
        out = await self._drain_out(s, timeout)
        await self._stop_engine(s)
        self.slots.pop(s.slot_id, None)
        out["took_s"] = round(time.monotonic() - t0, 4)
        self.events.emit("fleet", s.slot_id, "drained", f"left the fleet after moving {out['moved']} request(s)",
                         **{k: v for k, v in out.items() if k != "engine"})
        await self._notify()
        return out

    async def scale_in(self, n: int, timeout: Optional[float] = None) -> list[str]:
        """Drains `n` serving engines (the least loaded, newest first) and removes their slots; never below
        restart.min_healthy_engines (DrainError, nothing changed). Returns the removed engine ids."""
        async with self._elastic:
            self._check_elastic()
            if n < 1:
                raise DrainError(f"scale_in: n must be >= 1, got {n}")
            cands = sorted(self.serving_slots(), key=lambda s: (s.inflight, -slot_index(s.slot_id)))
            if n > len(cands):
                raise DrainError(f"scale_in({n}): only {len(cands)} engine(s) serve ({self.states()})")
            victims = cands[:n]
            self._check_floor_without(victims)
            self.events.emit("fleet", "fleet", "scale_in", f"removing {n} engine(s)",
                             engines=[s.slot_id for s in victims])
            await asyncio.gather(*(self._drain_and_remove(s, timeout) for s in victims))
            return [s.slot_id for s in victims]

    async def scale_out(self, n: int, timeout: Optional[float] = None) -> list[str]:
        """Adds `n` engine slots: ready standbys are promoted first, fresh engines start for the rest; each
        joins the router only once HEALTHY at the fleet's current weight version. Waits (bounded by
        engines.startup_timeout_s unless `timeout`) until all serve; returns the new engine ids."""
        async with self._elastic:
            self._check_elastic()
            if n < 1:
                raise DrainError(f"scale_out: n must be >= 1, got {n}")
            nxt = max((slot_index(sid) for sid in self.slots), default=-1) + 1
            new = [Slot(f"engine-{nxt + i}", EngineHealth(f"engine-{nxt + i}", self.cfg.monitor.failure_threshold,
                                                         since=time.monotonic())) for i in range(n)]
            for s in new:
                self.slots[s.slot_id] = s
            self.events.emit("fleet", "fleet", "scale_out", f"adding {n} engine(s)",
                             engines=[s.slot_id for s in new], version=self.weights.version)

            async def up(s: Slot) -> None:
                sh = self.shadows.take() if self.shadows is not None else None
                if sh is not None and await self._handover(s, sh, kind="promoted"):
                    return
                await self._bring_up(s)

            await asyncio.gather(*(up(s) for s in new))
            ids = {s.slot_id for s in new}

            def done() -> bool:
                return self.fatal is not None or all(self.slots[i].health.state in (State.HEALTHY, State.RETIRED)
                                                     and (self.slots[i].registered or self.slots[i].health.state
                                                          is State.RETIRED) for i in ids)

            async with self._changed:
                await asyncio.wait_for(self._changed.wait_for(done),
                                       self.cfg.engines.startup_timeout_s if timeout is None else timeout)
            self.raise_if_fatal()
            return sorted(ids, key=slot_index)

    async def rolling_upgrade(self, weights_path: str, version: str, timeout: Optional[float] = None) -> dict[str, str]:
        """Moves the serving fleet to weight `version` one engine at a time: drain it (its requests continue on
        the others), load the new weights in place (or, when that fails, replace it by a standby or a fresh
        engine at `version`), re-admit it once it serves `version`. Never takes an engine out when fewer than
        restart.min_healthy_engines would remain. Requests moved meanwhile may continue on the new version
        (each segment records the version that produced it). Returns {engine: version served}."""
        async with self._elastic:
            self._check_elastic()
            if self.holder is not None:
                weights_path = await self.holder.publish.remote(weights_path, version)
            self.weights = Weights(version, weights_path)  # first: recoveries and standbys pick it up
            self.events.emit("fleet", "fleet", "upgrade_begin", f"to {version}", version=version)
            if self.shadows is not None:
                await self.shadows.refit(self.weights)
            for sid in sorted(self.slots, key=slot_index):
                s = self.slots.get(sid)
                if s is None or not s.health.serving or s.served_version == version:
                    continue  # not serving: recovery brings it back at the new version
                self._check_floor_without([s])
                await self._drain_out(s, timeout)
                if await self._update_weights(s, self.weights):
                    await self._readmit(s, f"upgraded to {version}")
                else:
                    await self._replace(s, f"could not load {version} in place")
            states = {sid: s.served_version for sid, s in self.slots.items() if s.health.serving}
            self.events.emit("fleet", "fleet", "upgrade_done", f"to {version}", version=version, engines=states)
            return states

    async def _replace(self, s: Slot, reason: str) -> None:
        """A drained engine is stopped and a new incarnation (a standby, else a fresh engine) takes its slot."""
        await self._stop_engine(s)
        s.draining = False
        s.registered = False
        await self._apply(s, Signal.KILLED, f"replaced after a planned drain: {reason}")
        s.actor, s.info = None, None
        sh = self.shadows.take() if self.shadows is not None else None
        if sh is not None and await self._handover(s, sh, kind="promoted"):
            return
        await self._apply(s, Signal.RESTART_BEGUN, reason)
        await self._bring_up(s)

    async def serve_control(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Starts the control server (drain, scale, upgrade, status over HTTP; see fleet/control.py) and
        returns its URL. Loopback unless told otherwise."""
        from belayer_plugin.fleet.control import ControlServer

        self.control = ControlServer(self, host, port)
        return await self.control.start()
