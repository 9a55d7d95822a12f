"""The shadow pool: fully initialised standby engines that take over a dead engine's slot at once.

Standbys are never registered with the router while standing by. They are kept at the fleet's weight
version (updated at each refit, or brought up to date at handover: `shadow.keep_warm`), and on SGLang with
`release_memory_when_idle` they hold no GPU memory until handover (unverified on this CPU machine). A
standby that dies is replaced in the background under its own restart budget.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from belayer_plugin.engines.actor import EngineInfo, remote_engine_actor
from belayer_plugin.fleet.policy import RestartPolicy

if TYPE_CHECKING:
    from belayer_plugin.fleet.manager import FleetManager

_POOL = "shadow-pool"


@dataclass
class Shadow:
    sid: str
    actor: Any
    info: EngineInfo
    version: str
    memory_released: bool = False
    watcher: Optional[asyncio.Task] = None
    refit_task: Optional[asyncio.Task] = None  # a background refit under way (refit_in_background)
    nice: int = 0  # how much nicer than normal its server runs while parked (shadow.standby_nice)


class ShadowPool:
    """Keeps `shadow.num_standby` standby engines ready for handover."""

    def __init__(self, fleet: "FleetManager"):
        self.fleet = fleet
        self.cfg = fleet.cfg.shadow
        self.ready: list[Shadow] = []
        self.policy = RestartPolicy(fleet.cfg.restart)
        self._count = 0
        self._tasks: set[asyncio.Task] = set()
        self._closing = False
        self._placing = asyncio.Lock()
        self._adding = 0  # replacements being started
        self._starting: dict[str, str] = {}  # standby id -> the node it is being placed on

    @property
    def target(self) -> int:
        return self.cfg.num_standby

    async def start(self) -> None:
        """Brings up every standby (the fleet's start waits for them: a handover needs one ready)."""
        await asyncio.gather(*(self._add() for _ in range(self.target)))

    def nodes(self) -> list[str]:
        """The Ray nodes the ready standbys run on (for spread placement)."""
        return [sh.info.node_id for sh in self.ready] + list(self._starting.values())

    async def _add(self) -> Optional[Shadow]:
        """Starts one standby, brings it to the current version, parks it (memory released if configured)."""
        fm = self.fleet
        sid = f"shadow-{self._count}"
        self._count += 1
        t0 = time.monotonic()
        async with self._placing:  # one at a time, so concurrent starts see each other's nodes
            opts = await fm.actor_opts(sid, "standby")
            node = getattr(opts.get("scheduling_strategy"), "node_id", None)
            if node:
                self._starting[sid] = node
        cls = remote_engine_actor(fm.cfg.engines, **opts)
        # The base model under the current version's name only when that version is the base model.
        base_is_current = fm.weights.path is None and not fm.weights.external
        actor = cls.remote(sid, fm.cfg.engines, fm.engine_model_path, str(fm.run_dir / "engines"),
                           fm.weights.version if base_is_current else "default")
        try:
            info = await actor.start.remote()
            if info.node_id in fm.excluded_nodes:
                raise RuntimeError(f"placed on excluded node {info.node_id}")
            version = info.weight_version
            if version != fm.weights.version and not fm.weights.external:  # external: STALE at handover
                version = await self._update(actor, fm.weights)
            released = False
            if self.cfg.release_memory_when_idle and fm.cfg.engines.kind == "sglang":
                # GPU: a standby holds neither weights nor KV cache (unverified here: no-op on CPU SGLang)
                await actor.call.remote("POST", "/release_memory_occupation", {"tags": ["weights", "kv_cache"]})
                released = True
            # Parked in the background: on shared CPUs its refits (and any other work) yield to the serving
            # engines. 0 where the priority could not be restored at handover (the actor checks).
            nice = await actor.set_background.remote(self.cfg.standby_nice) if self.cfg.standby_nice else 0
        except Exception as e:
            self._starting.pop(sid, None)
            self._kill(actor)
            fm.events.emit("shadow", sid, "shadow_failed", f"{type(e).__name__}: {e}"[:300], level="warning")
            return None
        self._starting.pop(sid, None)
        sh = Shadow(sid, actor, info, version, released, nice=nice)
        sh.watcher = asyncio.create_task(self._watch(sh), name=f"watch-{sid}")
        self.ready.append(sh)
        fm.events.emit("shadow", sid, "shadow_ready", f"standing by at {info.url}", version=version,
                       took_s=round(time.monotonic() - t0, 3), pool=len(self.ready), nice=nice)
        return sh

    async def _update(self, actor: Any, weights: Any) -> str:
        path = weights.path or self.fleet.engine_model_path
        r = await actor.call.remote("POST", "/update_weights_from_disk",
                                    {"model_path": path, "weight_version": weights.version}, 600.0)
        version = await actor.weight_version.remote()
        if r["status"] != 200 or version != weights.version:
            raise RuntimeError(f"standby reports {version} after refit to {weights.version}")
        return version

    async def _watch(self, sh: Shadow) -> None:
        """Ray liveness for a standby: a dead one leaves the pool and is replaced."""
        try:
            code = await sh.actor.wait_exit.remote()
            reason = f"server exited with {code}"
        except asyncio.CancelledError:
            raise
        except Exception as e:
            reason = f"actor died: {type(e).__name__}"
            import ray

            if isinstance(e, ray.exceptions.ActorUnavailableError):
                self.fleet.check_node(sh.info.node_id)  # unreachable: maybe its node is gone
        if sh in self.ready:
            self.fleet.note_death(sh.info.node_id, sh.sid, 0)
            # As for engines: any standby death asks Ray (bounded) whether its node is gone; a lost node's
            # actors can also surface as ActorDiedError, never as ActorUnavailableError.
            self.fleet.check_node(sh.info.node_id)
            self.ready.remove(sh)
            self._kill(sh.actor)
            self.fleet.events.emit("shadow", sh.sid, "shadow_lost", reason, level="warning", pool=len(self.ready))
            self.replenish(failed=True)

    def take(self) -> Optional[Shadow]:
        """Removes and returns a standby for handover (None when the pool is empty)."""
        while self.ready:
            sh = self.ready.pop(0)
            if sh.watcher is not None:
                sh.watcher.cancel()
            if sh.info.node_id not in self.fleet.excluded_nodes:
                return sh
            self._kill(sh.actor)  # on an excluded node: replaced elsewhere
            self.fleet.events.emit("shadow", sh.sid, "shadow_lost", f"on excluded node {sh.info.node_id[:12]}",
                                   level="warning")
            self.replenish()
        return None

    def replenish(self, failed: bool = False) -> None:
        """Starts a replacement standby in the background. Replacing one taken for a handover is free;
        replacing one that failed (died, or failed its handover) spends the pool's restart budget."""
        if self._closing:
            return
        if failed:
            self.policy.record_restart(_POOL, time.monotonic())
        t = asyncio.create_task(self._replenish(), name="shadow-replenish")
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _replenish(self) -> None:
        while not self._closing and len(self.ready) + self._adding < self.target:
            d = self.policy.decide(_POOL, time.monotonic())
            if d.action == "retire":
                self.fleet.events.emit("shadow", _POOL, "shadow_budget_spent", d.reason, level="warning")
                return
            if d.restarts_in_window and d.delay_s:
                await asyncio.sleep(d.delay_s)  # the backoff itself (only after failures)
                if len(self.ready) + self._adding >= self.target:
                    return
            self._adding += 1
            try:
                sh = await self._add()
            finally:
                self._adding -= 1
            if sh is None:
                self.policy.record_restart(_POOL, time.monotonic())  # a start that failed spends budget

    async def refit(self, weights: Any) -> None:
        """keep_warm=refit: every standby loads the new version now (a failing one is replaced)."""
        if self.cfg.keep_warm == "refit":
            self.refit_in_background(weights)
            await asyncio.gather(*(sh.refit_task for sh in list(self.ready) if sh.refit_task is not None),
                                 return_exceptions=True)

    def refit_in_background(self, weights: Any) -> None:
        """keep_warm=refit without holding the caller: each standby loads `weights` in a task of its own,
        after any refit of it still under way (versions arrive in order). A handover awaits that task
        (`settle`) before it checks the standby's version, so a standby is never updated twice at once."""
        if self.cfg.keep_warm != "refit":
            return
        for sh in list(self.ready):
            t = asyncio.create_task(self._refit_one(sh, weights, sh.refit_task), name=f"refit-{sh.sid}")
            sh.refit_task = t
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    @staticmethod
    async def settle(sh: Shadow) -> None:
        """Waits for the standby's background refit, if any (its failure shows in the version check)."""
        if sh.refit_task is not None:
            await asyncio.gather(asyncio.shield(sh.refit_task), return_exceptions=True)

    async def _refit_one(self, sh: Shadow, weights: Any, before: Optional[asyncio.Task]) -> None:
        if before is not None:
            await asyncio.gather(before, return_exceptions=True)
        if sh not in self.ready:
            return  # taken for a handover meanwhile: the handover brings it to the current version
        t0 = time.monotonic()
        try:
            if sh.memory_released:
                await sh.actor.call.remote("POST", "/resume_memory_occupation", {"tags": ["weights"]})
            sh.version = await self._update(sh.actor, weights)
            if sh.memory_released:
                await sh.actor.call.remote("POST", "/release_memory_occupation", {"tags": ["weights", "kv_cache"]})
            self.fleet.events.emit("shadow", sh.sid, "shadow_refit", f"at {sh.version}", version=sh.version,
                                   took_s=round(time.monotonic() - t0, 4))
        except Exception as e:
            if sh in self.ready:
                self.ready.remove(sh)
                if sh.watcher is not None:
                    sh.watcher.cancel()
                self._kill(sh.actor)
                self.fleet.events.emit("shadow", sh.sid, "shadow_lost", f"refit failed: {e}"[:300],
                                       level="warning")
                self.replenish(failed=True)

    @staticmethod
    def _kill(actor: Any) -> None:
        import ray

        try:
            ray.kill(actor, no_restart=True)
        except Exception:
            pass

    async def shutdown(self) -> None:
        self._closing = True
        for t in list(self._tasks):
            t.cancel()
        for sh in self.ready:
            if sh.watcher is not None:
                sh.watcher.cancel()
            try:
                await asyncio.wait_for(sh.actor.stop.remote(), self.fleet.cfg.engines.shutdown_timeout_s * 2)
            except Exception:
                pass
            self._kill(sh.actor)
        self.ready.clear()
