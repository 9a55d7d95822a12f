"""The fleet manager: the only component that acts on engines (deregister, kill, restart, refit, register).

Signals from the monitor (and from clients that saw a request fail) go through the pure health machine;
transitions to DEAD start one recovery task per slot: deregister from the router and confirm, kill,
then restart under the restart policy (or retire), bring the new incarnation to the current weight
version (STALE until then), and register it only once HEALTHY with current weights.

Planned changes go through the same actions without being faults: a drain takes an engine out of the
router (confirmed), cuts its requests at their committed position so they continue elsewhere, and only
then stops it; rolling upgrades and scale-in/out are built on it (no restart budget, no node evidence).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import signal as _signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from belayer_plugin.config import BelayerConfig
from belayer_plugin.engines.actor import EngineInfo, remote_engine_actor
from belayer_plugin.events import EventLog
from belayer_plugin.metrics import FleetMetrics
from belayer_plugin.fleet.health import EngineHealth, Signal, State
from belayer_plugin.fleet.launch import resolve_model_path
from belayer_plugin.fleet.monitor import HealthMonitor
from belayer_plugin.fleet.nodes import Death, NodeHealth, Verdict
from belayer_plugin.fleet.policy import FleetBelowFloorError, RestartPolicy
from belayer_plugin.fleet.router import Router, RouterError
from belayer_plugin.fleet.shadow import Shadow, ShadowPool

log = logging.getLogger("belayer.fleet")


class Phase(str, enum.Enum):
    SERVING = "serving"
    PAUSED = "paused"
    RELEASED = "released"  # paused with engine memory released (weights/KV cache offloaded)
    REFIT = "refit"


class WeightVersionError(RuntimeError):
    """An engine reports a weight version other than the fleet's current one after a refit."""


class NoHealthyEngineError(RuntimeError):
    """No engine can take a request right now (all are dead, restarting or stale)."""


class DrainError(RuntimeError):
    """A planned drain, upgrade or scale change was refused or could not finish; the engine keeps serving."""


@dataclass
class Slot:
    """One engine position in the fleet; its incarnations come and go."""

    slot_id: str
    health: EngineHealth
    actor: Any = None
    info: Optional[EngineInfo] = None
    registered: bool = False
    recovery: Optional[asyncio.Task] = None
    fault_t: Optional[float] = None  # when the current fault was first observed (for detection figures)
    served_version: str = ""
    handover_t: Optional[float] = None  # when a shadow last took this slot over (monotonic)
    rids: set[str] = field(default_factory=set)  # requests in flight on the current incarnation
    draining: bool = False  # planned drain under way: not routable, and its signals are no faults
    # Made current while a probe blip held it SUSPECT: registered at its next HEALTHY (nobody else would).
    register_when_healthy: bool = False
    # Requests a drain cut here: their cut is a move even when seen after a failed drain re-admitted the engine.
    drain_cut: set[str] = field(default_factory=set)
    # Memory tags this incarnation has released and not resumed. SGLang's scheduler dies (KeyError) when asked
    # to resume a tag it does not hold released, e.g. "weights" again after a refit already resumed them.
    released: set[str] = field(default_factory=set)
    _inflight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while no request is in flight here

    def __post_init__(self) -> None:
        self.idle.set()

    @property
    def inflight(self) -> int:
        """Requests a Belayer selector has in flight on this slot (a drain waits for 0)."""
        return self._inflight

    @inflight.setter
    def inflight(self, n: int) -> None:
        self._inflight = n
        if n <= 0:
            self.idle.set()
        else:
            self.idle.clear()


@dataclass
class Weights:
    version: str = "default"
    path: Optional[str] = None  # None: the base model every engine starts from
    external: bool = False  # streamed into the engines by the trainer (NeMo-RL's refit): Belayer cannot load them


class FleetManager:
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
        self.nodes = NodeHealth(cfg.restart.node_exclusion_slots, cfg.shadow.fault_window_s,
                                cfg.restart.node_exclusion_decay_s)
        self._absolved: set[tuple[str, int]] = set()  # (slot, incarnation) deaths a poison request caused
        self._node_checks: dict[str, asyncio.Task] = {}
        self.holder: Any = None
        self.shadows: Optional[ShadowPool] = None
        self.slots: dict[str, Slot] = {}
        self.weights = Weights()
        self.phase = Phase.SERVING
        self.memory_released = False  # engines' weights and KV cache released (trainer holds the memory)
        self._standby_refit_due = False  # a refit while paused: the standbys load it once serving resumes
        self.policy = RestartPolicy(cfg.restart)
        self.monitor = HealthMonitor(cfg.monitor, self._on_signal)
        self.router: Optional[Router] = None
        self.fatal: Optional[FleetBelowFloorError] = None
        self._changed = asyncio.Condition()
        self._closing = False
        self._elastic = asyncio.Lock()  # one planned change (drain, upgrade, scale) at a time
        self._bg: set[asyncio.Task] = set()
        # Extra Ray options per engine or standby id (e.g. a trainer's placement group bundle); None: none.
        self.actor_options: Optional[Callable[[str], dict]] = None
        self.control: Any = None  # the control server, once serve_control() started it

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

    # ----------------------------------------------------------------- nodes
    @property
    def excluded_nodes(self) -> set[str]:
        """Ray nodes that may not host engines now (node evidence; see fleet/nodes.py)."""
        for n in self.nodes.decay(time.monotonic()):
            self.events.emit("fleet", n, "node_readmitted",
                             f"exclusion decayed after restart.node_exclusion_decay_s="
                             f"{self.cfg.restart.node_exclusion_decay_s:g} s")
        return set(self.nodes.excluded)

    def readmit_node(self, node: str) -> bool:
        """Lifts a node's exclusion by hand (e.g. after the machine was repaired); True if it was excluded."""
        ok = self.nodes.readmit(node)
        if ok:
            self.events.emit("fleet", node, "node_readmitted", "re-admitted by hand")
        return ok

    def exclusions(self) -> dict[str, str]:
        """{node: why it is excluded}, for reports."""
        return {n: why for n, (_, why) in self.nodes.excluded.items()}

    async def _alive_nodes(self) -> list[str]:
        import ray

        nodes = await asyncio.to_thread(ray.nodes)
        return sorted(n["NodeID"] for n in nodes if n.get("Alive"))

    async def placement(self, role: str) -> dict:
        """Ray options placing a new engine ("engine") or standby ("standby") on a node that may host it.

        Nothing is pinned while no node is excluded (Ray places it), except standbys with
        shadow.placement=spread, which go to the alive node with the fewest standbys, then engines.
        """
        excluded = self.excluded_nodes
        spread = role == "standby" and self.cfg.shadow.placement == "spread"
        if not excluded and not spread:
            return {}
        allowed = [n for n in await self._alive_nodes() if n not in excluded]
        if not allowed:
            return {}
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        load = {n: [0, 0] for n in allowed}
        for s in self.slots.values():
            if s.info is not None and s.info.node_id in load:
                load[s.info.node_id][1] += 1
        for node in (self.shadows.nodes() if self.shadows is not None else []):
            if node in load:
                load[node][0] += 1
        node = min(allowed, key=lambda n: (load[n] if spread else load[n][::-1], n))
        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}

    def actor_env(self) -> dict:
        """Ray options passing chaos-only switches to CPU engines (never without chaos.enabled)."""
        c = self.cfg.chaos
        if c.enabled and c.poison_token_id >= 0 and self.cfg.engines.kind == "cpu":
            return {"runtime_env": {"env_vars": {"BELAYER_CHAOS_POISON_TOKEN_ID": str(c.poison_token_id)}}}
        return {}

    async def actor_opts(self, sid: str, role: str) -> dict:
        """All Ray options for a new engine or standby: a trainer's own options for that id (`actor_options`)
        win over Belayer's placement; none (or empty) lets Belayer place it."""
        extra = self.actor_options(sid) if self.actor_options else {}
        if extra:
            return {**extra, **self.actor_env()}
        try:
            return {**await self.placement(role), **self.actor_env()}
        except Exception:  # the GCS did not answer: let Ray place it
            return self.actor_env()

    def note_death(self, node: str, position: str, incarnation: int, rids: frozenset = frozenset()) -> None:
        """Feeds one engine or standby death into node health; excludes the node on node evidence."""
        if (position, incarnation) in self._absolved or not node or self._closing:
            return
        t = asyncio.ensure_future(self._note_death(Death(node, position, incarnation, time.monotonic(), rids)))
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    async def _note_death(self, d: Death) -> None:
        try:
            hosts = await self._alive_nodes()
        except Exception:  # GCS unreachable: no verdict now (never exclude on missing information)
            return
        if (d.position, d.incarnation) in self._absolved:
            return
        self._verdict(self.nodes.record_death(d, hosts))

    def _verdict(self, v: Optional[Verdict]) -> None:
        if v is None:
            return
        if v.action == "exclude":
            self.events.emit("fleet", v.node, "node_excluded", v.reason, level="error")
        else:
            self.events.emit("fleet", v.node, "node_exclusion_refused", v.reason, level="warning")

    def check_node(self, node: str) -> None:
        """An actor on `node` is unreachable: asks Ray (bounded) whether the node itself is dead."""
        t = self._node_checks.get(node)
        if node and (t is None or t.done()) and not self.nodes.is_excluded(node) and not self._closing:
            self._node_checks[node] = asyncio.create_task(self._check_node(node), name=f"node-check-{node[:8]}")

    async def _check_node(self, node: str) -> None:
        deadline = time.monotonic() + self.cfg.restart.node_check_timeout_s
        while not self._closing:
            try:
                alive = node in await self._alive_nodes()
            except Exception:
                alive = True
            if not alive:
                self._verdict(self.nodes.node_dead(node, time.monotonic(), f"Ray reports node {node[:12]} dead"))
                return
            if time.monotonic() >= deadline:
                return
            # The GCS marks a lost node dead only after its health checks fail (seconds): there is no
            # event to await from here, so ask once a second until restart.node_check_timeout_s.
            await asyncio.sleep(1.0)

    def absolve(self, rid: str, deaths: list[tuple[str, int]], reason: str) -> None:
        """A poison request caused these (slot, incarnation) deaths: refund their restarts, forget them as
        node evidence, and say so in the events."""
        refunded = []
        for slot, inc in deaths:
            self._absolved.add((slot, inc))
            self.nodes.forget(slot, inc)
            if self.policy.refund(slot, (slot, inc)):
                refunded.append(slot)
        self.events.emit("fleet", rid, "poison_request", reason, level="error", deaths=[list(d) for d in deaths],
                         refunded=refunded)

    # ----------------------------------------------------------------- queries
    @property
    def url(self) -> Optional[str]:
        return self.router.url if self.router else None

    def states(self) -> dict[str, str]:
        return {sid: s.health.state.value for sid, s in self.slots.items()}

    def serving_slots(self) -> list[Slot]:
        """Slots requests may be routed to (serving health, not being drained)."""
        return [s for s in self.slots.values() if s.health.serving and s.info is not None and not s.draining]

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

    def slot_for_url(self, url: str) -> Optional[Slot]:
        return next((s for s in self.slots.values() if s.info is not None and s.info.url == url), None)

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

    # ----------------------------------------------------------------- actions
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

    async def _make_current(self, s: Slot) -> None:
        """STALE -> HEALTHY once the engine verifiably serves the fleet's current version; then register."""
        if s.health.state is not State.STALE:
            return
        want = self.weights
        if s.served_version != want.version and want.external:
            # Only the trainer holds these weights: STALE (unrouted) until its next refit streams them here.
            # Meanwhile it follows the fleet's phase like the others: a replacement must not hold a full
            # engine's memory on a colocated GPU while the policy trains.
            await self._match_phase(s)
            self.events.emit("fleet", s.slot_id, "awaiting_weights", f"serves {s.served_version}; version "
                             f"{want.version} comes with the trainer's next refit", version=want.version,
                             released=sorted(s.released))
            return
        if s.served_version != want.version:
            ok = await self._update_weights(s, want)
            if not ok:
                return
        if want is not self.weights:  # a refit happened meanwhile: go again with the newer version
            return await self._make_current(s)
        await self._apply(s, Signal.WEIGHTS_CURRENT, f"serves weight version {s.served_version}")
        await self._match_phase(s)
        if s.health.state is State.HEALTHY:
            await self._try_register(s)
        elif s.health.state is State.SUSPECT:
            # A probe failed while the phase was matched (CI: a 0.5 s probe timeout under load): the slot was
            # left unregistered for good when its next probe turned it HEALTHY again. That HEALTHY registers it.
            s.register_when_healthy = True

    async def _update_weights(self, s: Slot, want: Weights) -> bool:
        """Loads `want` into the engine and checks the version it then reports; False if it failed."""
        path = want.path or self.engine_model_path
        try:
            if "weights" in s.released:
                # Weights must be resident to be replaced (SGLang: resume the weights, not yet the KV cache).
                await self._memory_call(s, "/resume_memory_occupation", ["weights"])
                s.released.discard("weights")
            r = await self._load_from_disk(s.actor, path, want.version)
            if r["status"] != 200:
                # SGLang loads the weights, then refuses to flush its prefix cache while a request is still in
                # its scheduler (one a client abandoned just before the refit, as a partial rollout's abort
                # does) and answers 400, keeping the old version label. That engine is healthy: once the
                # request has drained (the flush), the same load succeeds. Fencing it would cost a restart.
                self.events.emit("fleet", s.slot_id, "refit_refused", f"HTTP {r['status']}: {r['body']}"[:300],
                                 level="warning", version=want.version)
                if await self.flush_cache(s, self.cfg.engines.flush_cache_timeout_s):
                    r = await self._load_from_disk(s.actor, path, want.version)
            version = await asyncio.wait_for(s.actor.weight_version.remote(), self.cfg.monitor.liveness_timeout_s * 5)
        except Exception as e:  # the engine died mid-refit: liveness reports it; nothing to do here
            self.events.emit("fleet", s.slot_id, "refit_failed", f"{type(e).__name__}: {e}"[:300], level="warning",
                             version=want.version)
            return False
        s.served_version = version
        if r["status"] != 200 or version != want.version:
            self.events.emit("fleet", s.slot_id, "weight_version_mismatch",
                             f"expected {want.version}, engine reports {version} (HTTP {r['status']})",
                             level="error", expected=want.version, actual=version)
            return False
        return True

    async def _load_from_disk(self, actor: Any, path: str, version: str, timeout: Optional[float] = None) -> dict:
        # Bounded: a hung engine must not hold the refit (and the whole step) hostage.
        t = self.cfg.engines.startup_timeout_s if timeout is None else timeout
        return await asyncio.wait_for(actor.call.remote(
            "POST", "/update_weights_from_disk", {"model_path": path, "weight_version": version}, t), t)

    async def flush_cache(self, s: Slot, timeout: float) -> bool:
        """Flushes the engine's prefix cache once its requests have drained, within `timeout` s; False if not.

        SGLang refuses a flush while any request runs or waits. Its `timeout` query makes the scheduler itself
        wait for idle (no polling); an engine that answers at once instead (the CPU engine, a flush already
        pending) is asked again with backoff until the deadline."""
        loop = asyncio.get_running_loop()
        end, delay = loop.time() + timeout, 0.05
        while True:
            left = end - loop.time()
            try:
                r = await asyncio.wait_for(s.actor.call.remote("POST", f"/flush_cache?timeout={max(left, 0):.3f}",
                                                               None, left + 5), left + 5)
                if isinstance(r, dict) and r.get("status") == 200:
                    return True
            except Exception:
                if s.actor is None or not s.health.serving:
                    return False  # it died: liveness and recovery take it from here
            if loop.time() + delay > end:
                return False
            await asyncio.sleep(delay)  # backoff between refusals, not synchronisation
            delay = min(delay * 2, 1.0)

    async def _match_phase(self, s: Slot) -> None:
        """A replacement joins in the fleet's phase (e.g. memory released while the trainer trains)."""
        if self.memory_released and self.phase is not Phase.REFIT:
            try:
                await self._release(s, ["kv_cache", "weights"])
            except Exception as e:  # it died again: Ray liveness reports it and recovery goes on
                self.events.emit("fleet", s.slot_id, "release_failed", f"{type(e).__name__}"[:200], level="warning")

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

    async def _update_weights_actor(self, actor: Any, want: Weights) -> bool:
        r = await self._load_from_disk(actor, want.path or self.engine_model_path, want.version, 600.0)
        return r["status"] == 200 and await actor.weight_version.remote() == want.version

    # ----------------------------------------------------------------- trainer lifecycle
    async def pause(self, release_memory: bool = False) -> None:
        """Leaves the serving phase (readiness probes stop; liveness keeps watching)."""
        self.monitor.pause()
        self.phase = Phase.RELEASED if release_memory else Phase.PAUSED
        self.memory_released = release_memory
        if release_memory:  # every engine, STALE ones too (a replacement awaiting the trainer's weights)
            await asyncio.gather(*(self._release(s, ["kv_cache", "weights"]) for s in self.slots.values()
                                   if s.actor is not None and s.health.running),
                                 return_exceptions=True)
        self.events.emit("fleet", "fleet", "phase", self.phase.value)

    async def _memory_call(self, s: Slot, path: str, tags: list[str]) -> dict:
        """A memory release or resume on the engine; probes it holds up are excused (monitor.control_call)."""
        with self.monitor.control_call(s.slot_id):
            return await s.actor.call.remote("POST", path, {"tags": tags})

    async def _release(self, s: Slot, tags: list[str]) -> None:
        """Releases those of `tags` this engine still holds (a replacement released by _match_phase is not
        released twice by the pause that follows)."""
        want = [t for t in tags if t not in s.released]
        if not want:
            return
        await self._memory_call(s, "/release_memory_occupation", want)
        s.released.update(want)

    async def _resume_tags(self, s: Slot, tags: list[str]) -> None:
        """Resumes those of `tags` that this engine holds released (never one it does not: see Slot.released)."""
        want = [t for t in tags if t in s.released]
        if want:
            r = await self._memory_call(s, "/resume_memory_occupation", want)
            if r.get("status") != 200:
                self.events.emit("fleet", s.slot_id, "resume_failed", f"tags {want}: HTTP {r.get('status')}",
                                 level="warning", tags=want)
                return
            s.released.difference_update(want)

    async def resume(self) -> None:
        """Back to serving: resumes memory where released, then readiness probes."""
        await self._back_to_serving(["kv_cache", "weights"])

    async def _back_to_serving(self, tags: list[str]) -> None:
        """Resumes the released memory named by `tags` (where it was released), then serving with readiness
        probes. The `phase` event carries the tags resumed."""
        await asyncio.gather(*(self._resume_tags(s, tags) for s in self.slots.values()
                               if s.actor is not None and s.info is not None), return_exceptions=True)
        self.phase = Phase.SERVING
        self.memory_released = False
        if self.ft:
            self.monitor.resume()
        self.events.emit("fleet", "fleet", "phase", self.phase.value, tags=tags)
        if self._standby_refit_due and self.shadows is not None:
            self._standby_refit_due = False
            self.shadows.refit_in_background(self.weights)

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

    async def refit(self, weights_path: str, version: str) -> dict[str, str]:
        """Loads new policy weights into every engine and verifies each reports `version`.

        Engines that die meanwhile are restarted by recovery straight onto the new version; a live engine
        that does not serve it is an error event, deregistered and fenced (restarted onto it), never used.
        Returns {engine: version served}; raises WeightVersionError when no engine could load `version`.
        """
        self.raise_if_fatal()
        prev = self.phase
        self.phase = Phase.REFIT
        self.monitor.pause()
        if self.holder is not None:
            weights_path = await self.holder.publish.remote(weights_path, version)
        self.weights = Weights(version, weights_path)  # first: restarts racing with us pick it up
        self.events.emit("fleet", "fleet", "refit_begin", f"to {version}", version=version)
        targets = [s for s in self.slots.values() if s.health.state in (State.HEALTHY, State.SUSPECT)]
        # A slot whose engine died and was replaced (handover, restart) during the refit has a new incarnation
        # that its own path brought to this version: only the incarnation we tried to update can be stale.
        incarnations = {s.slot_id: s.health.incarnation for s in targets}
        results = await asyncio.gather(*(self._update_weights(s, self.weights) for s in targets))
        if self.shadows is not None:
            # Off the refit barrier: the trainer waits for the serving engines only. Paused, the standbys load
            # the version only once serving resumes (_back_to_serving): loading beside the serving engines'
            # refit, then beside their resume, it slowed the barrier on shared CPUs (~2.5%, then +14 ms of
            # resume per step: bench/overhead.py). Serving, they start now. A standby needed before it is
            # current is brought up to date by the handover itself (which settles a refit under way, then
            # checks the version).
            if prev in (Phase.SERVING, Phase.REFIT):
                self.shadows.refit_in_background(self.weights)
            else:
                self._standby_refit_due = True
        bad = []
        for s, ok in zip(targets, results):
            if not ok and s.health.state in (State.HEALTHY, State.SUSPECT) \
                    and s.health.incarnation == incarnations[s.slot_id]:
                alive = await self._alive(s)
                if alive:
                    # Never silent: the engine leaves the router and is fenced and restarted.
                    await self._deregister(s)
                    await self._apply(s, Signal.VERSION_MISMATCH, f"serves {s.served_version}, want {version}")
                    bad.append(s.slot_id)
                    await self._on_signal(s.slot_id, Signal.KILLED, s.health.incarnation, "stale after refit")
        self.phase = prev if prev is not Phase.REFIT else Phase.SERVING
        if self.phase is Phase.SERVING:
            self.monitor.resume()
        served = {sid: s.served_version for sid, s in self.slots.items() if s.health.serving}
        self.events.emit("fleet", "fleet", "refit_done", f"to {version}", version=version, engines=served,
                         mismatched=bad)
        if targets and not served:
            # Not one engine could load it: the weights, not the engines, are at fault.
            raise WeightVersionError(f"no engine could load weight version {version} from {weights_path}; "
                                     f"engines {bad} were fenced")
        return served

    async def _alive(self, s: Slot) -> bool:
        try:
            return bool(await asyncio.wait_for(s.actor.server_alive.remote(), self.cfg.monitor.liveness_timeout_s))
        except Exception:
            return False

    async def verify_versions(self) -> dict[str, str]:
        """Asks every serving engine for its version; a mismatch fences it (never silent)."""
        out = {}
        for s in self.serving_slots():
            try:
                v = await s.actor.weight_version.remote()
            except Exception:
                continue  # dying: liveness handles it
            out[s.slot_id] = v
            if v != self.weights.version:
                self.events.emit("fleet", s.slot_id, "weight_version_mismatch",
                                 f"expected {self.weights.version}, engine reports {v}", level="error")
                await self._deregister(s)
                await self._apply(s, Signal.VERSION_MISMATCH, f"serves {v}, want {self.weights.version}")
                await self._on_signal(s.slot_id, Signal.KILLED, s.health.incarnation, "stale weights")
        return out

    # ----------------------------------------------------------------- refits streamed by the trainer
    async def begin_external_refit(self) -> None:
        """The trainer streams weights itself next (NeMo-RL's refit): readiness probes stop (a long update
        must not look like a hang), Ray liveness stays on, weights memory comes back where it was released."""
        self.raise_if_fatal()
        self.phase = Phase.REFIT
        self.monitor.pause()
        await asyncio.gather(*(self._resume_tags(s, ["weights"]) for s in self.slots.values()
                               if s.actor is not None and s.info is not None), return_exceptions=True)
        self.events.emit("fleet", "fleet", "phase", self.phase.value, tags=["weights"])

    async def adopt_version(self, version: str, slot_ids: Iterable[str]) -> dict[str, str]:
        """The trainer streamed weight `version` into the engines of `slot_ids`: it becomes the fleet's current
        version. Each engine is asked what it serves: at `version` it is current (a STALE one turns HEALTHY and
        joins the router); otherwise it leaves the router and stays STALE until a refit reaches it (Belayer
        never loads other weights in its place). Returns {slot: version it reports}."""
        self.raise_if_fatal()
        self.weights = Weights(version, None, external=True)  # first: recoveries racing with us pick it up
        out: dict[str, str] = {}
        for sid in slot_ids:
            s = self.slots[sid]
            if s.info is None or not s.health.running:
                continue
            try:
                v = await asyncio.wait_for(s.actor.weight_version.remote(), self.cfg.monitor.liveness_timeout_s * 5)
            except Exception:
                continue  # dying: liveness reports it and recovery brings it back STALE
            out[sid] = s.served_version = v
            if v == version:
                await self._make_current(s)
        for s in self.serving_slots():  # never silent: whatever serves another version leaves the router
            if s.served_version != version:
                self.events.emit("fleet", s.slot_id, "weight_version_mismatch",
                                 f"expected {version}, engine reports {s.served_version}", level="error",
                                 expected=version, actual=s.served_version)
                await self._deregister(s)
                await self._apply(s, Signal.VERSION_MISMATCH, f"serves {s.served_version}, want {version}")
        self.events.emit("fleet", "fleet", "version_adopted", f"to {version}", version=version, engines=out,
                         stale=[sid for sid, s in self.slots.items() if s.health.state is State.STALE])
        return out

    async def end_external_refit(self) -> None:
        """After the trainer's refit: KV cache memory back where released, then serving with readiness probes."""
        await self._back_to_serving(["kv_cache"])

    # ----------------------------------------------------------------- planned drain, elastic fleet
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
            cands = sorted(self.serving_slots(), key=lambda s: (s.inflight, -_index(s.slot_id)))
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
            nxt = max((_index(sid) for sid in self.slots), default=-1) + 1
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
            return sorted(ids, key=_index)

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
            for sid in sorted(self.slots, key=_index):
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


def _index(slot_id: str) -> int:
    """engine-3 -> 3 (ordering of slots; unknown shapes sort first)."""
    try:
        return int(slot_id.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return -1
