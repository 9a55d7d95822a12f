"""Recovery and restarts: a DEAD slot is deregistered, killed, and restarted under the restart policy (or
handed to a standby, or retired and tried again after the cool-down).

Owns: one recovery task per slot (`Slot.recovery`), bringing up a new incarnation (`_bring_up`), fencing
(`_kill`), handovers from the shadow pool and the retire cool-down. Must not: decide health (fleet/health.py
does, through the fleet's `_apply`/`_on_signal`) or restart budgets (fleet/policy.py does); weights are
brought current by fleet/refit.py's `_make_current`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal as _signal
import time
from typing import Optional

from belayer_plugin.engines.actor import remote_engine_actor
from belayer_plugin.fleet.health import Signal, State
from belayer_plugin.fleet.policy import FleetBelowFloorError
from belayer_plugin.fleet.router import RouterError
from belayer_plugin.fleet.shadow import Shadow, ShadowPool
from belayer_plugin.fleet.slot import Slot

log = logging.getLogger("belayer.fleet")


class Recovery:
    """FleetManager's recovery and restarts (a mixin).

    Uses from the fleet: cfg, events, slots, policy, monitor, shadows, weights, fatal, _closing, _absolved,
    _apply, _notify, _on_signal, _deregister, _make_current, _update_weights_actor, note_death, check_node,
    excluded_nodes, exclusions, actor_opts."""

    def on_driver_node(self, node_id: Optional[str]) -> bool:
        """Whether a process Ray placed on `node_id` shares this (the driver's) machine, so that its PID means
        the same process here. Across machines a PID names some other process of the driver's host."""
        import ray

        return node_id is not None and node_id == ray.get_runtime_context().get_node_id()

    async def _kill(self, s: Slot) -> None:
        import ray

        if s.info is not None:
            if self.on_driver_node(s.info.node_id):
                try:  # the server first: a SIGSTOPped process still takes SIGKILL
                    os.killpg(s.info.pid, _signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            elif s.actor is not None:
                # Another machine: the engine's actor signals its own server. A hung actor cannot; its server
                # dies with it (PR_SET_PDEATHSIG) when Ray kills the actor below.
                try:
                    await asyncio.wait_for(s.actor.kill.remote(_signal.SIGKILL), self.cfg.monitor.liveness_timeout_s)
                except Exception:  # noqa: BLE001  (hung or gone: the actor's own death takes the server)
                    pass
        if s.actor is not None:
            ray.kill(s.actor, no_restart=True)

    async def _bring_up(self, s: Slot) -> None:
        """Starts a new incarnation (RESTARTING -> STALE), brings it to current weights, registers it."""
        import ray

        from belayer_plugin.engines.actor import EngineStartError

        cls = remote_engine_actor(self.cfg.engines, **await self.actor_opts(s.slot_id, "engine"))
        s.actor = cls.remote(s.slot_id, self.cfg.engines, self.engine_model_path, str(self.run_dir / "engines"))
        try:
            s.info = await s.actor.start.remote()
            s.released = set()
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError, EngineStartError) as e:
            cause = e.as_instanceof_cause() if isinstance(e, ray.exceptions.RayTaskError) else e
            self.events.emit("fleet", s.slot_id, "start_failed", str(cause)[:500], level="error")
            await self._on_signal(s.slot_id, Signal.LIVENESS_LOST, s.health.incarnation, f"start failed: {type(cause).__name__}")
            return
        s.served_version = s.info.weight_version
        if self.ft:
            self.monitor.watch(s.slot_id, s.health.incarnation, s.actor, s.info.url)
        await self._apply(s, Signal.STARTED, f"pid {s.info.pid} at {s.info.url} in {s.info.started_s:.2f} s")
        await self._make_current(s)

    async def _recover(self, s: Slot) -> None:
        """DEAD: deregister (confirmed), kill, then restart under the policy or retire."""
        try:
            while s.health.state is State.DEAD and not self._closing:
                try:
                    await self._deregister(s)
                except RouterError as e:
                    self.events.emit("fleet", s.slot_id, "deregister_failed", str(e), level="error")
                self.monitor.unwatch(s.slot_id)
                await self._kill(s)
                self.events.emit("fleet", s.slot_id, "killed", "fenced before restart", incarnation=s.health.incarnation)
                now = time.monotonic()
                cause = (s.slot_id, s.health.incarnation)  # the death this restart answers (refundable)
                decision = self.policy.decide(s.slot_id, now)
                if decision.action == "retire":
                    await self._apply(s, Signal.RETIRE, decision.reason)
                    node = s.info.node_id if s.info is not None else ""
                    s.actor, s.info = None, None
                    try:  # a slot cooling down is not usable until it is back
                        self.policy.check_floor(h.health for h in self.slots.values())
                    except FleetBelowFloorError as e:
                        self.fatal = e
                        self.events.emit("fleet", "fleet", "below_floor", str(e), level="error",
                                         usable=e.usable, floor=e.floor)
                        await self._notify()
                        return
                    if not await self._retire_cooldown(s, node):
                        return
                    continue  # RESTARTING -> STALE/HEALTHY, or DEAD again (then the policy decides afresh)
                backed_off = False
                if decision.restarts_in_window > 0 and decision.delay_s > 0:
                    # Died again within the window (a crash loop?): back off before spending another engine,
                    # standby or not. The first death of a window is answered at once by a standby.
                    self.events.emit("restart", s.slot_id, "backoff", decision.reason, delay_s=decision.delay_s)
                    await asyncio.sleep(decision.delay_s)  # the backoff itself
                    backed_off = True
                shadow = self.shadows.take() if self.shadows is not None else None
                if shadow is not None:
                    if cause not in self._absolved:
                        self.policy.record_restart(s.slot_id, time.monotonic(), cause)  # a handover spends budget
                    if await self._handover(s, shadow):
                        continue
                if decision.delay_s > 0 and not backed_off:
                    self.events.emit("restart", s.slot_id, "backoff", decision.reason, delay_s=decision.delay_s)
                    await asyncio.sleep(decision.delay_s)  # the backoff itself
                if shadow is None and cause not in self._absolved:
                    self.policy.record_restart(s.slot_id, time.monotonic(), cause)
                await self._apply(s, Signal.RESTART_BEGUN, decision.reason)
                t0 = time.monotonic()
                await self._bring_up(s)
                if s.health.state in (State.STALE, State.HEALTHY):
                    self.events.emit("restart", s.slot_id, "restarted", decision.reason,
                                     incarnation=s.health.incarnation, took_s=round(time.monotonic() - t0, 3),
                                     state=s.health.state.value)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never leave a slot silently stuck
            log.exception("recovery of %s failed", s.slot_id)
            self.events.emit("fleet", s.slot_id, "recovery_error", f"{type(e).__name__}: {e}", level="error")
            await self._notify()  # requests waiting for this slot to come back stop waiting for it

    async def _retire_cooldown(self, s: Slot, node: str) -> bool:
        """RETIRED: waits restart.retire_cooldown_s (and, when the slot's node is excluded, for the exclusion to
        lift), then tries the slot again with a renewed budget. False when it stays retired (cool-down 0, or the
        fleet is closing)."""
        cooldown = self.cfg.restart.retire_cooldown_s
        if cooldown <= 0:
            return False
        self.events.emit("restart", s.slot_id, "retire_cooldown", f"tried again in {cooldown:g} s "
                         f"(restart.retire_cooldown_s) with a renewed budget", level="warning", cooldown_s=cooldown)
        t0 = time.monotonic()
        await asyncio.sleep(cooldown)
        if node and node in self.excluded_nodes:  # retired on node evidence: back only once the node is
            self.events.emit("restart", s.slot_id, "retire_cooldown_waits_for_node",
                             f"node {node[:12]} is excluded: {self.exclusions().get(node, '')}"[:300], node=node)
            while node in self.excluded_nodes and not self._closing:
                # Exclusions lift by decay (checked when read) or by hand (readmit_node): no event to await.
                await asyncio.sleep(1.0)
        if self._closing or s.health.state is not State.RETIRED:
            return False
        self.policy.renew(s.slot_id)
        await self._apply(s, Signal.RETRY, f"retire cool-down of {cooldown:g} s over")
        self.events.emit("restart", s.slot_id, "retire_cooldown_over", "tried again with a renewed budget",
                         incarnation=s.health.incarnation, waited_s=round(time.monotonic() - t0, 3))
        self.policy.record_restart(s.slot_id, time.monotonic(), (s.slot_id, s.health.incarnation))
        t1 = time.monotonic()
        await self._bring_up(s)
        if s.health.state in (State.STALE, State.HEALTHY):
            self.events.emit("restart", s.slot_id, "restarted", "after the retire cool-down",
                             incarnation=s.health.incarnation, took_s=round(time.monotonic() - t1, 3),
                             state=s.health.state.value)
        return True

    async def _handover(self, s: Slot, sh: Shadow, kind: str = "handover") -> bool:
        """A standby takes the dead engine's slot (or, kind="promoted", a new slot of a planned scale-out):
        checked, made current, registered; False if it failed."""
        t0 = time.monotonic()
        want = self.weights
        try:
            async with asyncio.timeout(self.cfg.shadow.handover_timeout_s):
                if sh.nice:  # back to normal priority first: a refit under way then finishes at full speed
                    sh.nice = await sh.actor.set_background.remote(0)
                    if sh.nice:
                        raise RuntimeError(f"its server stays {sh.nice} nicer than normal")
                await ShadowPool.settle(sh)  # a background refit of it finishes first
                await sh.actor.ping.remote()
                if sh.memory_released:
                    r = await sh.actor.call.remote("POST", "/resume_memory_occupation", {"tags": ["weights", "kv_cache"]})
                    if r["status"] != 200:
                        raise RuntimeError(f"resume_memory_occupation: HTTP {r['status']}")
                version = await sh.actor.weight_version.remote()  # a cheap readiness check with the version
                if version != want.version and not want.external \
                        and not await self._update_weights_actor(sh.actor, want):
                    raise RuntimeError(f"could not bring the standby from {version} to {want.version}")
                await sh.actor.call.remote("POST", "/flush_cache", None)
        except Exception as e:
            self.events.emit("shadow", s.slot_id, "handover_failed", f"{sh.sid}: {type(e).__name__}: {e}"[:300],
                             level="warning", shadow=sh.sid)
            import ray

            if isinstance(e, ray.exceptions.RayActorError):  # the standby itself died (not just slow)
                self.note_death(sh.info.node_id, sh.sid, 0)
                self.check_node(sh.info.node_id)
            ShadowPool._kill(sh.actor)
            if self.shadows is not None:
                self.shadows.replenish(failed=True)
            return False
        await self._apply(s, Signal.RESTART_BEGUN, f"handover to {sh.sid}")
        # External weights: the standby keeps what it has and the slot stays STALE until the trainer's refit.
        s.actor, s.info, s.served_version = sh.actor, sh.info, version if want.external else want.version
        s.released = set()  # a standby released while idle was resumed above
        s.rids = set()
        self.monitor.watch(s.slot_id, s.health.incarnation, s.actor, s.info.url)
        await self._apply(s, Signal.STARTED, f"{sh.sid} at {sh.info.url}")
        await self._make_current(s)
        s.handover_t = time.monotonic()
        self.events.emit("shadow", s.slot_id, kind, f"{sh.sid} took over the slot", shadow=sh.sid,
                         took_s=round(time.monotonic() - t0, 4), state=s.health.state.value, version=want.version)
        if self.shadows is not None:
            self.shadows.replenish()
        return True

    async def recover_dead(self, timeout: float) -> int:
        """Waits for recoveries under way; a no-op (returns 0 at once, changes nothing) when nothing died."""
        # A retired slot's task waits out restart.retire_cooldown_s (minutes): not a recovery to wait for here.
        pending = [s.recovery for s in self.slots.values() if s.recovery is not None and not s.recovery.done()
                   and s.health.state is not State.RETIRED]
        if not pending:
            return 0
        await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), timeout)
        self.raise_if_fatal()
        return len(pending)
