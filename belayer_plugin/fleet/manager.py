"""The fleet manager: the only component that acts on engines (deregister, kill, restart, refit, register).

Signals from the monitor (and from clients that saw a request fail) go through the pure health machine;
transitions to DEAD start one recovery task per slot (fleet/recovery.py): deregister from the router and
confirm, kill, then restart under the restart policy (or retire), bring the new incarnation to the current
weight version (STALE until then, fleet/refit.py), and register it only once HEALTHY with current weights
(fleet/membership.py). Planned changes (drain, scale, rolling upgrade) are fleet/planned.py; phases and
engine memory fleet/phases.py; node evidence and placement fleet/placement.py.

Owns: the FleetManager facade, its shared state (cfg, events, slots, monitor, router, policy, shadows, fatal,
the change condition), start and shutdown, and the one path every health signal takes (`_on_signal`,
`_apply`). Must not: hold any concern's logic itself (each lives in the module named above); the modules it
combines must not import this one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any, Optional

from belayer_plugin.config import BelayerConfig
from belayer_plugin.events import EventLog
from belayer_plugin.fleet.health import EngineHealth, Signal, State
from belayer_plugin.fleet.launch import resolve_model_path
from belayer_plugin.fleet.membership import Membership
from belayer_plugin.fleet.monitor import HealthMonitor
from belayer_plugin.fleet.phases import Phases
from belayer_plugin.fleet.placement import Placement
from belayer_plugin.fleet.planned import PlannedOps
from belayer_plugin.fleet.policy import FleetBelowFloorError, RestartPolicy
from belayer_plugin.fleet.recovery import Recovery
from belayer_plugin.fleet.refit import Refit
from belayer_plugin.fleet.router import Router
from belayer_plugin.fleet.shadow import ShadowPool
from belayer_plugin.fleet.slot import DrainError, NoHealthyEngineError, Phase, Slot, WeightVersionError, Weights
from belayer_plugin.metrics import FleetMetrics

# The fleet's vocabulary (fleet/slot.py) is importable from here too.
__all__ = ["DrainError", "FleetManager", "NoHealthyEngineError", "Phase", "Slot", "WeightVersionError", "Weights"]

log = logging.getLogger("belayer.fleet")


class FleetManager(Membership, Placement, Recovery, Refit, Phases, PlannedOps):
    """Engines with health, bounded restarts, router membership and weight-version safety."""

    def __init__(self, cfg: BelayerConfig, run_dir: Path, events: Optional[EventLog] = None,
                 model_path: Optional[str] = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.events = events or EventLog(self.run_dir / "events.jsonl")
        self.metrics = FleetMetrics()  # fed from events only; `metrics.serve()` exposes them on loopback
        self.events.subscribe(self.metrics.on_event)
        self.model_path = model_path or resolve_model_path(cfg)
        self.engine_model_path = self.model_path  # the shared-memory copy when shadow.shared_weights
        self.ft = cfg.use_fault_tolerance  # off: engines run, but nothing watches, restarts or hands over
        self.holder: Any = None
        self.shadows: Optional[ShadowPool] = None
        self.slots: dict[str, Slot] = {}
        self.policy = RestartPolicy(cfg.restart)
        self.monitor = HealthMonitor(cfg.monitor, self._on_signal)
        self.router: Optional[Router] = None
        self.fatal: Optional[FleetBelowFloorError] = None
        self._changed = asyncio.Condition()
        self._closing = False
        self._bg: set[asyncio.Task] = set()
        self._init_placement()
        self._init_refit()
        self._init_phases()
        self._init_planned()

    # ----------------------------------------------------------------- start / stop
    async def start(self) -> None:
        """Starts every engine and the router; returns when all are HEALTHY and registered."""
        if self.cfg.router.mode == "sglang_router":
            self.router = Router(self.cfg.router, self.run_dir)
            await self.router.start()
        if self.cfg.shadow.shared_weights and self.cfg.engines.kind == "cpu":
            await self._start_holder()
        for i in range(self.cfg.engines.num_engines):
            sid = f"engine-{i}"
            self.slots[sid] = Slot(sid, EngineHealth(sid, self.cfg.monitor.failure_threshold, since=time.monotonic()))
        ups = [self._bring_up(s) for s in self.slots.values()]
        if self.ft and self.cfg.shadow.num_standby > 0:
            self.shadows = ShadowPool(self)
            ups.append(self.shadows.start())
        await asyncio.gather(*ups)
        if self.ft:
            self.monitor.resume()
        self.raise_if_fatal()

    async def _start_holder(self) -> None:
        """CPU engines map the weights from one shared-memory copy owned by a holder actor."""
        import ray

        from belayer_plugin.engines.shared_weights import WeightsHolder

        self.holder = ray.remote(WeightsHolder).options(num_cpus=0, max_restarts=0).remote()
        self.engine_model_path = await self.holder.publish.remote(self.model_path, "base")

    async def shutdown(self) -> None:
        """Stops the monitor, every engine and the router; safe with recoveries and probes in flight."""
        import ray

        self._closing = True
        try:
            if self.control is not None:
                await self.control.stop()
        finally:
            # A control server that fails to stop must not leave the monitor probing (and its session open).
            await self.monitor.stop()
        for t in [*self._node_checks.values(), *self._bg]:
            t.cancel()
        if self.shadows is not None:
            await self.shadows.shutdown()
        tasks = [s.recovery for s in self.slots.values() if s.recovery and not s.recovery.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10)
        async def stop(actor: Any) -> None:
            try:
                await asyncio.wait_for(actor.stop.remote(), self.cfg.engines.shutdown_timeout_s * 2)
            except Exception:  # dead or hung: ray.kill below takes it (and PDEATHSIG its server)
                pass
            ray.kill(actor, no_restart=True)

        await asyncio.gather(*(stop(s.actor) for s in self.slots.values() if s.actor is not None))
        if self.router is not None:
            await self.router.aclose()
        if self.holder is not None:
            try:
                await asyncio.wait_for(self.holder.release.remote(), 10)
            except Exception:
                pass
            ray.kill(self.holder, no_restart=True)

    # ----------------------------------------------------------------- waiting
    def raise_if_fatal(self) -> None:
        """Raises the fleet's fatal error (FleetBelowFloorError), if it has one."""
        if self.fatal is not None:
            raise self.fatal

    async def wait_all_healthy(self, timeout: float) -> None:
        """Waits until every non-retired engine is HEALTHY; raises the fleet's fatal error if any."""

        def done() -> bool:
            return self.fatal is not None or all(
                s.health.state in (State.HEALTHY, State.RETIRED) for s in self.slots.values())

        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(done), timeout)
        self.raise_if_fatal()

    async def wait_changed(self, timeout: float) -> None:
        """Returns at the next health transition, or after `timeout` seconds."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    # ----------------------------------------------------------------- signals
    async def report(self, slot_id: str, sig: Signal, reason: str, url: Optional[str] = None) -> None:
        """Lets a client report what it saw (e.g. a failed request); ignored if about an older incarnation."""
        s = self.slots.get(slot_id)
        if s is None or (url is not None and (s.info is None or s.info.url != url)):
            return
        await self._on_signal(slot_id, sig, s.health.incarnation, reason)

    async def _on_signal(self, slot_id: str, sig: Signal, incarnation: int, reason: str) -> None:
        s = self.slots.get(slot_id)
        if s is None or self._closing or s.draining:
            return  # a draining engine is being stopped on purpose: what it does now is no fault
        now = time.monotonic()
        if sig in (Signal.PROBE_FAILED, Signal.REQUEST_FAILED, Signal.UNAVAILABLE, Signal.PROGRESS_STALLED):
            if s.fault_t is None and s.health.incarnation == incarnation:
                s.fault_t = time.time()
            self.monitor.fault_reported(slot_id, incarnation)
        tr = s.health.apply(sig, now, incarnation, reason)
        if tr is None:
            return
        self._transition_event(tr)
        if tr.to_state is State.HEALTHY:
            s.fault_t = None
            if s.register_when_healthy and s.served_version == self.weights.version:
                s.register_when_healthy = False
                await self._try_register(s)
        elif tr.to_state is not State.SUSPECT:
            s.register_when_healthy = False  # DEAD, RESTARTING...: the next incarnation registers itself
        if sig is Signal.UNAVAILABLE and s.info is not None:
            self.check_node(s.info.node_id)
        if tr.to_state is State.DEAD:
            crashed = sig in (Signal.LIVENESS_LOST, Signal.PROBE_FAILED, Signal.PROGRESS_HUNG)  # not our fence
            if crashed and s.info is not None:
                # Node evidence only together with other slots' deaths (fleet/nodes.py), never alone;
                # or from Ray itself, asked (bounded) whether the node is still alive.
                self.note_death(s.info.node_id, slot_id, incarnation, frozenset(s.rids))
                self.check_node(s.info.node_id)
            # Its requests died with it: their releases name this incarnation and no longer count here, so
            # the next incarnation starts at 0 in flight (else least-loaded picks skip it for phantom load).
            s.rids = set()
            s.inflight = 0
            first_seen = s.fault_t or time.time()
            self.events.emit("monitor", slot_id, "detected", reason, level="warning", signal=sig.value,
                             incarnation=incarnation, phase=self.phase.value,
                             latency_from_first_symptom_s=round(time.time() - first_seen, 4))
            s.fault_t = None
            if self.ft and (s.recovery is None or s.recovery.done()):
                s.recovery = asyncio.create_task(self._recover(s), name=f"recover-{slot_id}")
        await self._notify()

    def _transition_event(self, tr: Any) -> None:
        if tr.to_state is State.HEALTHY:
            self.monitor.end_grace(tr.engine, tr.incarnation)  # serving: under full readiness bounds from now
        level = "warning" if tr.to_state in (State.DEAD, State.SUSPECT, State.RETIRED) else "info"
        self.events.emit("fleet", tr.engine, "transition", tr.reason, tr.from_state.value, tr.to_state.value,
                         level=level, signal=tr.signal.value, incarnation=tr.incarnation)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _apply(self, s: Slot, sig: Signal, reason: str = "") -> None:
        tr = s.health.apply(sig, time.monotonic(), s.health.incarnation, reason)
        if tr is not None:
            self._transition_event(tr)
            await self._notify()
