"""Recovery of verl's own rollout replicas, bounded by Belayer's restart budget and healthy floor.

`ReplicaRecovery` keeps one `EngineHealth` record per replica (Belayer's pure health state machine) and
Belayer's `RestartPolicy`; a replica whose server actor Ray reports gone is:
1. evicted from the load balancer (the client may already have done so),
2. restarted through verl's replica API (`RolloutReplica.launch_servers`: new server actors for the same
   replica) after the policy's backoff, or retired once its budget is spent (FleetBelowFloorError when fewer
   usable replicas than `restart.min_healthy_engines` are left),
3. STALE until it serves the current weights, and only then re-admitted to the balancer (HEALTHY).
Every step is an event (component "verl") that tests and reports can await.

`BelayerCheckpointEngineManager` is verl's CheckpointEngineManager with that recovery in front of every call
that reaches the replicas: dead replicas are removed from `replicas` before the trainer's next sleep / weight
sync (so the run never calls into them), restarted, added back, brought to the current weights by the weight
sync itself, then admitted. The legacy trainer loads it from `actor_rollout_ref.rollout.checkpoint_manager_class`.
verl's v1 trainer builds its CheckpointEngineManager directly (no such option), so there Belayer's agent loop
manager heals the replicas before each rollout instead (`heal_in_place`; Belayer replicas only, since it must
also bring the new server to the current weights itself).

Owns: restarting verl's replicas under Belayer's policy. Must not: be imported by hooks/verl/replica.py (the
recovery it uses is registered there).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Optional

import ray
from verl.checkpoint_engine import CheckpointEngineManager
from verl.utils.ray_utils import auto_await

from belayer_plugin.config import BelayerConfig
from belayer_plugin.events import EventLog
from belayer_plugin.fleet.health import EngineHealth, Signal, State
from belayer_plugin.fleet.policy import FleetBelowFloorError, RestartPolicy
# current_recovery / set_current_recovery live with the replicas that use them (replica.py must not import this module).
from belayer_plugin.hooks.verl.replica import (current_recovery, drop_servers, forget_server_handles,
                                               set_current_recovery)

__all__ = ["ReplicaRecovery", "BelayerCheckpointEngineManager", "FleetBelowFloorError", "ReplicaSyncError",
           "current_recovery", "set_current_recovery", "guard_replica", "guard_checkpoint_manager",
           "track_checkpoint_managers", "served_steps", "LIFECYCLE"]

# verl's RolloutReplica calls that reach its server actors (CheckpointEngineManager gathers them over replicas)
LIFECYCLE = ("wake_up", "sleep", "abort_all_requests", "resume_generation", "clear_kv_cache", "release_kv_cache",
             "resume_kv_cache")


async def served_steps(handle: Any) -> Optional[int]:
    """The global steps (weights version) a verl server actor serves: verl's servers keep it in `global_steps`,
    set by the trainer's weight sync (`set_global_steps`); read from the actor itself."""
    return await handle.__ray_call__.remote(lambda server: getattr(server, "global_steps", None))


def guard_replica(replica: Any, recovery: "ReplicaRecovery") -> None:
    """Wraps the lifecycle calls of one verl replica object (instance attributes; the class is untouched).

    verl's v1 trainer builds its own CheckpointEngineManager over the replica objects and gathers each call
    over them: one dead server actor raises there and ends the run (vLLMReplica.sleep first calls
    `servers[0].wait_for_requests_to_drain`). Guarded, a call first restarts a replica whose server Ray
    reports gone (verl's own launch code, a fresh server list; STALE until the weight sync reaches it), and a
    call that meets a death on the way restarts and calls again once. A retired replica's calls do nothing.
    Belayer's own replica kind heals itself the same way (BelayerReplica._each) and is not wrapped."""
    if getattr(replica, "_belayer_guarded", False):
        return
    from belayer_plugin.hooks.verl.replica import BelayerReplica

    if isinstance(replica, BelayerReplica):
        return

    def wrap(name: str) -> Callable[..., Any]:
        call = getattr(replica, name)

        async def guarded(*args: Any, **kwargs: Any) -> Any:
            if not recovery.cfg.use_fault_tolerance:
                return await call(*args, **kwargs)
            if recovery.retired(replica):
                return None
            why = await recovery.why_dead(replica)
            if why and not await recovery.restart(replica, why):
                return None
            try:
                return await call(*args, **kwargs)
            except ray.exceptions.RayActorError as e:
                why = await recovery.why_dead(replica) or f"{type(e).__name__} in {name}"
                if not await recovery.restart(replica, why):
                    return None
                return await call(*args, **kwargs)

        guarded.__name__ = name
        return guarded

    for name in LIFECYCLE:
        if hasattr(replica, name):
            setattr(replica, name, wrap(name))
    replica._belayer_guarded = True

class ReplicaRecovery:
    def __init__(self, cfg: BelayerConfig, balancer: Any = None, events: Optional[EventLog] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.cfg, self.balancer, self.clock = cfg, balancer, clock
        self.events = events or EventLog()
        self.policy = RestartPolicy(cfg.restart)
        self.health: dict[str, EngineHealth] = {}
        self.steps: Optional[int] = None  # the weights' global steps after the last sync this process saw

    @staticmethod
    def key(replica: Any) -> str:
        return f"replica-{replica.replica_rank}{getattr(replica, 'name_suffix', '')}"

    def track(self, replicas: list) -> None:
        """Starts health records for replicas not seen before (HEALTHY: they were started by verl)."""
        for r in replicas:
            if self.key(r) not in self.health:
                self.health[self.key(r)] = EngineHealth(self.key(r), self.cfg.monitor.failure_threshold,
                                                        state=State.HEALTHY, since=self.clock())

    async def why_dead(self, replica: Any) -> Optional[str]:
        """None while every server actor of the replica answers Ray's readiness call, else why not."""
        if not replica.servers:
            return "no server"
        timeout = self.cfg.monitor.liveness_timeout_s
        for s in replica.servers:
            try:
                await asyncio.wait_for(s.__ray_ready__.remote(), timeout)
            except ray.exceptions.RayActorError as e:
                return f"server actor gone: {type(e).__name__}"
            except asyncio.TimeoutError:
                return f"server actor not ready within {timeout:g} s"
        return None

    async def find_dead(self, replicas: list) -> list[tuple[Any, str]]:
        self.track(replicas)
        whys = await asyncio.gather(*(self.why_dead(r) for r in replicas))
        return [(r, w) for r, w in zip(replicas, whys) if w]

    def _transition(self, h: EngineHealth, sig: Signal, reason: str = "") -> None:
        tr = h.apply(sig, self.clock(), reason=reason)
        if tr is not None:
            self.events.emit("fleet", h.engine, "transition", reason, from_state=tr.from_state.value,
                             to_state=tr.to_state.value, signal=sig.value)

    async def restart(self, replica: Any, why: str) -> bool:
        """Evicts, then restarts the dead replica (True) or retires it (False); raises below the floor."""
        key = self.key(replica)
        self.track([replica])
        h = self.health[key]
        self._transition(h, Signal.LIVENESS_LOST, why)
        old = replica.server_address
        if self.balancer is not None and old:
            try:  # Belayer's balancer counts the death (once, if a client already had it evicted)
                evict = self.balancer.evict
            except AttributeError:
                await self.balancer.remove_servers.remote([old])
            else:
                await evict.remote(old, why)
        self.events.emit("verl", key, "evicted", why, level="warning", url=old)
        while True:
            d = self.policy.decide(key, self.clock())
            if d.action == "retire":
                self._transition(h, Signal.RETIRE, d.reason)
                self.events.emit("verl", key, "retired", d.reason, level="error")
                self.policy.check_floor(self.health.values())
                return False
            self.policy.check_floor(self.health.values())
            if d.delay_s > 0:
                await asyncio.sleep(d.delay_s)  # the policy's backoff, not a synchronisation
            self.policy.record_restart(key, self.clock())
            self._transition(h, Signal.RESTART_BEGUN, d.reason)
            try:
                await drop_servers(replica, self.cfg.monitor.liveness_timeout_s + 10)
                await replica.launch_servers()  # verl's replica API: new server actor(s) for this replica
                await self._forget_cached_servers(replica)
            except Exception as e:  # noqa: BLE001  (a failed start is one more death against the budget)
                why = f"restart failed: {type(e).__name__}: {e}"[:300]
                self._transition(h, Signal.KILLED, why)
                self.events.emit("verl", key, "restart_failed", why, level="warning")
                continue
            self._transition(h, Signal.STARTED)  # STALE: not routed before it serves the current weights
            self.events.emit("verl", key, "restarted", f"incarnation {h.incarnation}", url=replica.server_address)
            return True

    async def admit(self, replica: Any, steps: Optional[int]) -> bool:
        """Re-admits a STALE replica once its server serves `steps`; returns whether it was admitted."""
        key = self.key(replica)
        h = self.health.get(key)
        if h is None or h.state is not State.STALE:
            return False
        handle = replica.server_handle
        if steps is not None:
            served = await served_steps(handle)
            if served != steps:
                self.events.emit("verl", key, "admit_refused", f"serves {served}, current {steps}", level="warning")
                return False
        self._transition(h, Signal.WEIGHTS_CURRENT, f"global steps {steps}")
        if self.balancer is not None:
            await self.balancer.add_servers.remote({replica.server_address: handle})
        self.events.emit("verl", key, "admitted", f"at global steps {steps}", url=replica.server_address,
                         version=steps)
        return True

    def retired(self, replica: Any) -> bool:
        h = self.health.get(self.key(replica))
        return h is not None and h.state is State.RETIRED

    def stale(self, replicas: list) -> list:
        return [r for r in replicas if self.health.get(self.key(r)) and self.health[self.key(r)].state is State.STALE]

    async def heal_in_place(self, replicas: list) -> int:
        """v1 trainer path (verl's own checkpoint manager keeps the replica objects): restarts dead Belayer
        replicas in place, brings STALE ones to the current weights and admits them; returns how many."""
        for r, why in await self.find_dead(replicas):
            await self.restart(r, why)
        stale = self.stale(replicas)
        if not stale:
            return 0
        # verl's own checkpoint manager does not tell this process the version: the serving replicas say it
        got = [await served_steps(r.server_handle) for r in replicas if all(r is not x for x in stale)]
        steps = max((g for g in got if g is not None), default=self.steps)
        n = 0
        for r in stale:
            handle = r.server_handle
            if steps is not None and hasattr(handle, "load_weights") and await served_steps(handle) != steps:
                await handle.load_weights.remote(steps)  # died after the last sync: load the current weights
            # verl's servers load weights only from the trainer's sync: one that missed it stays STALE (not
            # routed) until the next sync reaches it
            n += await self.admit(r, steps)
        return n

    async def _forget_cached_servers(self, replica: Any) -> None:
        """verl's hybrid rollout workers cache their server's actor handle: point them at the new one."""
        workers = list(getattr(replica, "workers", None) or [])
        if not workers:
            return
        try:
            n = await asyncio.wait_for(asyncio.gather(*(w.__ray_call__.remote(forget_server_handles)
                                                        for w in workers)), self.cfg.monitor.liveness_timeout_s + 10)
        except Exception as e:  # noqa: BLE001  (a dead worker is a trainer fault, not this replica's)
            self.events.emit("verl", self.key(replica), "workers_not_reset", f"{type(e).__name__}: {e}"[:300],
                             level="warning")
            return
        if sum(n):
            self.events.emit("verl", self.key(replica), "workers_reset", f"{sum(n)} server adapter(s)")

    def guard(self, replica: Any) -> None:
        """Makes a verl replica object heal itself before and after each lifecycle call (see `guard_replica`)."""
        guard_replica(replica, self)


class ReplicaSyncError(RuntimeError):
    """A replica's server died during a weight sync that Belayer cannot redo; names the replicas and the fault."""


def guard_checkpoint_manager(ckpt: Any) -> None:
    """verl's own CheckpointEngineManager (the v1 trainer builds it itself): a weight sync that fails because a
    replica's server actor died is recovered instead of ending the run.

    With the naive backend (hybrid: the trainer's workers push into their colocated servers, and wake them) the
    dead replicas are restarted through verl's launch code, their workers pointed at the new servers, and the
    sync runs again: it is a full push, so running it twice loads the same weights. Other backends build a
    process group over the replicas' workers mid-sync; redoing half of one is not safe, so the run ends with a
    ReplicaSyncError naming the replicas and the fault, at once. Without Belayer's recovery in this process (fault
    tolerance off), verl's error as is."""
    if isinstance(ckpt, BelayerCheckpointEngineManager) or getattr(ckpt, "_belayer_guarded", False):
        return
    raw = type(ckpt).update_weights.__wrapped__  # the coroutine under verl's auto_await

    async def update_weights(global_steps: Optional[int] = None) -> Any:
        try:
            return await raw(ckpt, global_steps=global_steps)
        except Exception as e:
            rec = current_recovery()
            if rec is None or not rec.cfg.use_fault_tolerance:
                raise
            dead = await rec.find_dead(ckpt.replicas)
            if not dead:
                raise
            what = ", ".join(f"{rec.key(r)} ({why})" for r, why in dead)
            if ckpt.backend != "naive":
                raise ReplicaSyncError(f"the server of {what} died during the trainer's weight sync (checkpoint "
                                       f"engine backend {ckpt.backend!r}); a partial {ckpt.backend} sync cannot be "
                                       "redone: the run ends here") from e
            for r, why in dead:
                if not await rec.restart(r, f"{why} (during the weight sync)"):
                    raise ReplicaSyncError(f"{rec.key(r)} died during the trainer's weight sync and was retired "
                                           f"({why}); its workers cannot take the weight push") from e
            rec.events.emit("verl", "sync", "sync_retried", f"after restarting {what}", level="warning",
                            global_steps=global_steps)
            return await raw(ckpt, global_steps=global_steps)

    ckpt.update_weights = auto_await(update_weights)
    ckpt._belayer_guarded = True


def track_checkpoint_managers() -> None:
    """Guards every verl CheckpointEngineManager built in this process from now on (idempotent); the guard acts
    only where Belayer's recovery runs (see guard_checkpoint_manager)."""
    init = CheckpointEngineManager.__init__
    if getattr(init, "_belayer_tracked", False):
        return

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        guard_checkpoint_manager(self)

    __init__._belayer_tracked = True  # type: ignore[attr-defined]
    __init__.__wrapped__ = init  # type: ignore[attr-defined]
    CheckpointEngineManager.__init__ = __init__  # type: ignore[method-assign]


class BelayerCheckpointEngineManager(CheckpointEngineManager):
    """verl's CheckpointEngineManager that removes, restarts and re-admits dead replicas (see the module doc)."""

    def __init__(self, config: Any, actor_wg: Any, replicas: list, recovery: Optional[ReplicaRecovery] = None):
        super().__init__(config, actor_wg, replicas)
        self._recovery = recovery
        self._healing = False

    @property
    def recovery(self) -> Optional[ReplicaRecovery]:
        """Its own, else the one Belayer's agent loop manager made in this process; None: verl's behaviour."""
        return self._recovery or current_recovery()

    async def heal(self) -> None:
        """Takes dead replicas out of `replicas`, restarts them and puts them back (STALE, not yet routed)."""
        rec = self.recovery
        if rec is None or not rec.cfg.use_fault_tolerance or self._healing:
            return
        self._healing = True
        try:
            dead = await rec.find_dead(self.replicas)
            if not dead:
                return
            self.remove_replicas([r for r, _ in dead])  # never called into again while dead
            for r, why in dead:
                if await rec.restart(r, why):
                    self.add_replicas([r])
        finally:
            self._healing = False

    @auto_await
    async def sleep_replicas(self):
        await self.heal()
        return await super().sleep_replicas()

    @auto_await
    async def wake_up_replicas(self):
        await self.heal()
        return await super().wake_up_replicas()

    @auto_await
    async def abort_replicas(self, reject_request: bool = False):
        await self.heal()
        return await super().abort_replicas(reject_request=reject_request)

    @auto_await
    async def resume_generation_replicas(self):
        await self.heal()
        return await super().resume_generation_replicas()

    @auto_await
    async def release_kv_cache_replicas(self):
        await self.heal()
        return await super().release_kv_cache_replicas()

    @auto_await
    async def resume_kv_cache_replicas(self):
        await self.heal()
        return await super().resume_kv_cache_replicas()

    @auto_await
    async def update_weights(self, global_steps: int = None):
        await self.heal()
        out = await super().update_weights(global_steps=global_steps)
        rec = self.recovery
        if rec is None:
            return out
        if global_steps is not None:
            rec.steps = global_steps
        for r in rec.stale(self.replicas):  # the sync brought them to the current weights: route to them now
            await rec.admit(r, rec.steps)
        return out
