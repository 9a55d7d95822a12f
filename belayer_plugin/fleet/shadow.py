"""The shadow pool: fully initialised standby engines that take over a dead engine's slot at once.

Standbys are never registered with the router while standing by. They are kept at the fleet's weight
version (updated at each refit, or brought up to date at handover: `shadow.keep_warm`), and on SGLang with
`release_memory_when_idle` they hold no GPU memory until handover (unverified on this CPU machine). A
standby that dies is replaced in the background under its own restart budget.

With `shadow.freeze_parked`, a parked standby on the fleet's own Ray node has its Ray actor process stopped
(SIGSTOP) whenever nothing is asked of it: an idle Ray actor is not idle (Ray's core worker runs a fixed 10 ms
signal-check timer, ~5-9 ms of CPU per second), and that was most of what a standby cost a training step. It is
woken (SIGCONT) for each of its refits and for good at handover. While it is stopped its server still runs, but
nothing in the actor would notice the server's exit, so the pool watches the server itself through a pidfd; the
stopped actor's own death is still reported by Ray (the raylet sees its socket close). A stopped process cannot
answer gRPC keepalive pings either: Ray's client gives up on an actor whose pings go unanswered (300 s + 120 s by
default) and fails its pending calls with ActorUnavailableError. So every `shadow.freeze_breath_s` (at most half
of Ray's keepalive timeout) each stopped standby is woken for one Ray call and stopped again.

Owns: the standbys (build, park, freeze, refit in the background, replace). Must not: give a standby a slot
(fleet/recovery.py's handover does) or import fleet/manager.py (it reaches the fleet through `ShadowHost`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol

from belayer_plugin.config import BelayerConfig
from belayer_plugin.engines.actor import EngineInfo, remote_engine_actor
from belayer_plugin.events import EventLog
from belayer_plugin.fleet.health import State
from belayer_plugin.fleet.policy import RestartPolicy
from belayer_plugin.fleet.slot import Slot, Weights

_POOL = "shadow-pool"


def _actor_lost(e: BaseException) -> bool:
    """The actor died or became unreachable (not a failure of the engine's own start)."""
    import ray

    return isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError))


class ShadowHost(Protocol):
    """What the pool needs from the fleet that owns it (the FleetManager; the pool never imports it)."""

    cfg: BelayerConfig
    events: EventLog
    run_dir: Path
    engine_model_path: str
    weights: Weights
    slots: dict[str, Slot]

    @property
    def excluded_nodes(self) -> set[str]: ...

    async def actor_opts(self, sid: str, role: str) -> dict: ...

    def note_death(self, node: str, position: str, incarnation: int, rids: frozenset = frozenset()) -> None: ...

    def check_node(self, node: str) -> None: ...

    async def wait_changed(self, timeout: float) -> None: ...

    async def alive_nodes(self) -> list[str]: ...


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
    frozen: bool = False  # its actor process is SIGSTOPped (shadow.freeze_parked)
    holds: int = 0  # callers that need its actor awake (refits): it is frozen again when the last one ends
    pidfd: Optional[int] = None  # its server's pidfd, watched by the event loop while it can be frozen


class ShadowPool:
    """Keeps `shadow.num_standby` standby engines ready for handover."""

    def __init__(self, fleet: ShadowHost):
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
        self._here: Optional[str] = None  # the Ray node this pool runs on (standbys there can be frozen)
        self._breather: Optional[asyncio.Task] = None
        self._rebalancer: Optional[asyncio.Task] = None
        self._session: Any = None  # aiohttp, for refits sent straight to a frozen standby's server

    @property
    def target(self) -> int:
        return self.cfg.num_standby

    async def start(self) -> None:
        """Brings up every standby (the fleet's start waits for them: a handover needs one ready)."""
        await asyncio.gather(*(self._add() for _ in range(self.target)))
        if self.cfg.placement == "spread" and self.cfg.rebalance_interval_s > 0 and self.target > 1:
            self._rebalancer = asyncio.create_task(self._rebalance_loop(), name="shadow-rebalance")

    # ----------------------------------------------------------------- spread across nodes that come and go
    async def _rebalance_loop(self) -> None:
        # Ray offers no node-joined feed the pool could await: the node list is read every interval (one GCS
        # call), and a move happens only when counts differ by two or more, so a balanced pool never moves.
        while not self._closing:
            await asyncio.sleep(self.cfg.rebalance_interval_s)
            try:
                await self.rebalance()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the GCS did not answer, a start failed: the next interval tries again
                self.fleet.events.emit("shadow", _POOL, "shadow_rebalance_failed", f"{type(e).__name__}: {e}"[:300],
                                       level="warning")

    def counts(self, nodes: list[str]) -> dict[str, int]:
        """Ready standbys per node of `nodes` (nodes without one count 0)."""
        out = {n: 0 for n in nodes}
        for sh in self.ready:
            if sh.info.node_id in out:
                out[sh.info.node_id] += 1
        return out

    async def rebalance(self) -> Optional[str]:
        """shadow.placement=spread: when the standbys per admitted node differ by two or more (a node returned
        or joined after its standbys had been replaced elsewhere), one moves: a new standby is started on the
        emptiest node, then one on the fullest stops. Returns the node it moved to, None when nothing moved."""
        if self._adding or self._starting or len(self.ready) < self.target:
            return None  # a replacement under way places itself; moving now could overshoot
        excluded = self.fleet.excluded_nodes
        counts = self.counts([n for n in await self.fleet.alive_nodes() if n not in excluded])
        if len(counts) < 2 or max(counts.values()) - min(counts.values()) < 2:
            return None
        full = max(counts, key=lambda n: (counts[n], n))
        self._adding += 1
        try:
            sh = await self._add(rebuild=True)  # spread placement puts it on a node with the fewest
        finally:
            self._adding -= 1
        if sh is None or sh not in self.ready:
            return None
        old = next((x for x in self.ready if x.info.node_id == full and x is not sh), None)
        if old is None:  # the full node lost one meanwhile
            return sh.info.node_id
        self._stop(old)
        self.fleet.events.emit("shadow", old.sid, "shadow_moved",
                               f"node {full[:12]} had {counts[full]} standbys: replaced by {sh.sid} on node "
                               f"{sh.info.node_id[:12]}", to_node=sh.info.node_id, from_node=full, replaced_by=sh.sid,
                               url=old.info.url)
        return sh.info.node_id

    def nodes(self) -> list[str]:
        """The Ray nodes the ready standbys run on (for spread placement)."""
        return [sh.info.node_id for sh in self.ready] + list(self._starting.values())

    async def _add(self, rebuild: bool = False) -> Optional[Shadow]:
        """Starts one standby, brings it to the current version, parks it (memory released if configured).
        A rebuild (a replacement, not the fleet's start) starts niced (shadow.standby_nice) from its first
        moment: a slot that begins a cold restart while it builds comes first (restart before rebuild)."""
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
        niced: Optional[asyncio.Task] = None
        try:
            starting = asyncio.ensure_future(actor.start.remote())
            if rebuild and self.cfg.standby_nice:
                niced = asyncio.create_task(self._nice_while_starting(sid, actor, starting), name=f"nice-{sid}")
            info = await starting
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
        except BaseException as e:
            if niced is not None:
                niced.cancel()
            node = self._starting.pop(sid, None)
            self._kill(actor)
            if node and _actor_lost(e):
                self.fleet.check_node(node)  # died where it was pinned: maybe that node is gone
            if not isinstance(e, Exception):
                # Cancelled (the pool is closing while this one starts): its actor, and by PDEATHSIG its server,
                # went now, not whenever Ray collects the dropped handle (~4 s later here).
                raise
            fm.events.emit("shadow", sid, "shadow_failed", f"{type(e).__name__}: {e}"[:300], level="warning")
            return None
        self._starting.pop(sid, None)
        sh = Shadow(sid, actor, info, version, released, nice=nice)
        sh.watcher = asyncio.create_task(self._watch(sh), name=f"watch-{sid}")
        self.ready.append(sh)
        self._park(sh)
        if sh not in self.ready:
            return sh  # its server was already gone: lost (and replaced, budget spent) by _park
        fm.events.emit("shadow", sid, "shadow_ready", f"standing by at {info.url}", version=version,
                       took_s=round(time.monotonic() - t0, 3), pool=len(self.ready), nice=nice, frozen=sh.frozen)
        return sh

    # ----------------------------------------------------------------- frozen while parked
    def _can_freeze(self, sh: Shadow) -> bool:
        if not self.cfg.freeze_parked or sh.info.actor_pid <= 0:
            return False
        if self._here is None:
            import ray

            self._here = ray.get_runtime_context().get_node_id()
        # Signals reach only this node's processes (and its pid namespace: one raylet spawns them all).
        return sh.info.node_id == self._here

    def _park(self, sh: Shadow) -> None:
        """Stops the standby's actor process if nothing needs it awake and its server can be watched here."""
        if sh.frozen or sh.holds or sh not in self.ready or self._closing or not self._can_freeze(sh):
            return
        if sh.pidfd is None:
            try:
                sh.pidfd = os.pidfd_open(sh.info.pid)
            except ProcessLookupError:
                self._lose(sh, "server exited")
                return
            except OSError:  # no pidfd here (kernel < 5.3): stays awake, watched by its actor
                return
            # The stopped actor cannot see its server exit; its own watcher reports it once woken too, and
            # whichever comes first removes the standby (the other finds it gone).
            asyncio.get_running_loop().add_reader(sh.pidfd, self._lose, sh,
                                                  "server exited (seen by the pool while parked)")
        try:
            os.kill(sh.info.actor_pid, signal.SIGSTOP)
        except ProcessLookupError:
            return  # the actor is gone: Ray reports it to the watcher
        sh.frozen = True
        if self._breather is None:
            # Not among self._tasks: those are replacements and refits, which callers may wait for.
            self._breather = asyncio.create_task(self._breathe(), name="shadow-breathe")

    def breath_s(self) -> float:
        """How often a stopped standby is woken for one call: `freeze_breath_s`, and at most half of Ray's
        gRPC keepalive timeout in this process (a ping must find the actor running within that timeout)."""
        try:
            from ray._raylet import Config

            keepalive_s = Config.grpc_client_keepalive_timeout_ms() / 1000.0
        except Exception:  # not the Ray this was written against: keep the configured interval
            keepalive_s = float("inf")
        return max(0.05, min(self.cfg.freeze_breath_s, keepalive_s / 2))

    async def _breathe(self) -> None:
        every = self.breath_s()
        while not self._closing:
            await asyncio.sleep(every)  # a duty cycle, not a wait for anything
            for sh in [s for s in self.ready if s.frozen]:
                try:
                    async with self.awake(sh):
                        # One call through the driver's channel: it acknowledges any keepalive ping queued
                        # while the actor was stopped. Its death is the watcher's business, a slow answer
                        # the handover's (bounded by handover_timeout_s).
                        await asyncio.wait_for(sh.actor.ping.remote(), self.cfg.handover_timeout_s)
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    self.fleet.events.emit("shadow", sh.sid, "shadow_breath_failed", f"{type(e).__name__}: {e}"[:300],
                                           level="warning")

    def _wake(self, sh: Shadow) -> None:
        """Lets the standby's actor run again (at once: SIGCONT needs no answer)."""
        if sh.frozen:
            sh.frozen = False
            try:
                os.kill(sh.info.actor_pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def _unwatch_server(self, sh: Shadow) -> None:
        if sh.pidfd is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(sh.pidfd)
            os.close(sh.pidfd)
            sh.pidfd = None

    @contextlib.asynccontextmanager
    async def awake(self, sh: Shadow):
        """Keeps the standby's actor running for the calls made inside; parks it again after the last one."""
        sh.holds += 1
        self._wake(sh)
        try:
            yield sh
        finally:
            sh.holds -= 1
            self._park(sh)

    def _direct_call(self, sh: Shadow) -> Any:
        """`actor.call`'s equivalent from this process: one HTTP call to the standby's server."""
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(trust_env=False)

        async def call(method: str, path: str, body: Optional[dict] = None, timeout: float = 60.0) -> dict:
            async with self._session.request(method, f"{sh.info.url}{path}", json=body,
                                             timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                try:
                    data = await r.json(content_type=None)
                except ValueError:
                    data = await r.text()
                return {"status": r.status, "body": data}

        return call

    async def _update(self, actor: Any, weights: Any, call: Any = None) -> str:
        """Loads `weights` into a standby (through `call`, or its actor) and checks the version it reports."""
        path = weights.path or self.fleet.engine_model_path
        r = await (call or actor.call.remote)("POST", "/update_weights_from_disk",
                                              {"model_path": path, "weight_version": weights.version}, 600.0)
        if call is None:
            version = await actor.weight_version.remote()
        else:
            got = await call("GET", "/get_model_info")  # as the actor reads it (SGLang has it there)
            version = str(got["body"].get("weight_version", "default")) if isinstance(got["body"], dict) else None
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
        self._lose(sh, reason)

    def _lose(self, sh: Shadow, reason: str, died: bool = True) -> None:
        """A standby died (or, died=False, failed its refit): it leaves the pool and a replacement is started
        (under the pool's budget)."""
        self._unwatch_server(sh)
        if sh not in self.ready:
            return
        if died:
            self.fleet.note_death(sh.info.node_id, sh.sid, 0)
            # As for engines: any standby death asks Ray (bounded) whether its node is gone; a lost node's
            # actors can also surface as ActorDiedError, never as ActorUnavailableError.
            self.fleet.check_node(sh.info.node_id)
        self._stop(sh)
        self.fleet.events.emit("shadow", sh.sid, "shadow_lost", reason, level="warning", pool=len(self.ready))
        self.replenish(failed=True)

    def _stop(self, sh: Shadow) -> None:
        """Takes a standby out of the pool and kills it (its watcher cancelled, unless it is the caller)."""
        self._unwatch_server(sh)
        if sh.watcher is not None and sh.watcher is not asyncio.current_task():
            sh.watcher.cancel()
        self.ready.remove(sh)
        self._wake(sh)  # a stopped actor would only be killed by Ray's grace timeout (~5 s), not at once
        self._kill(sh.actor)

    def take(self) -> Optional[Shadow]:
        """Removes and returns a standby for handover (None when the pool is empty)."""
        while self.ready:
            sh = self.ready.pop(0)
            if sh.watcher is not None:
                sh.watcher.cancel()
            self._unwatch_server(sh)
            self._wake(sh)  # for good: it serves from now on (or is killed below)
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
            await self._yield_to_restarts()
            if self._closing or len(self.ready) + self._adding >= self.target:
                return
            self._adding += 1
            try:
                sh = await self._add(rebuild=True)
            finally:
                self._adding -= 1
            if sh is None:
                self.policy.record_restart(_POOL, time.monotonic())  # a start that failed spends budget

    async def _nice_while_starting(self, sid: str, actor: Any, starting: asyncio.Future) -> None:
        """Moves a rebuilding standby's server to the background as soon as its process exists (the actor's
        set_background answers while its start is under way), so that its start yields the CPU to a slot's
        restart and to serving engines."""
        t0 = time.monotonic()
        while not starting.done():
            try:
                nice = await actor.set_background.remote(self.cfg.standby_nice)
            except Exception:  # noqa: BLE001  (the start reports the actor's death)
                return
            if nice:
                self.fleet.events.emit("shadow", sid, "shadow_build_niced", "built in the background", nice=nice,
                                       after_s=round(time.monotonic() - t0, 3))
                return
            if starting.done():
                return
            await asyncio.sleep(0.1)  # its server process is not spawned yet (or cannot come back: then 0)

    async def _yield_to_restarts(self) -> None:
        """Restart before rebuild: a slot's cold restart and a standby's build compete for the same CPU, GPU and
        memory, and only the slot serves requests. A rebuild waits while any slot is RESTARTING (at most
        engines.startup_timeout_s, the bound of a start) and begins once each has reached STALE (or died)."""
        fm = self.fleet

        def restarting() -> list[str]:
            return sorted(s.slot_id for s in fm.slots.values() if s.health.state is State.RESTARTING)

        slots = restarting()
        if not slots:
            return
        t0 = time.monotonic()
        fm.events.emit("shadow", _POOL, "shadow_build_deferred", f"slot(s) restarting first: {', '.join(slots)}",
                       slots=slots)
        deadline = t0 + fm.cfg.engines.startup_timeout_s
        while restarting() and not self._closing and time.monotonic() < deadline:
            await fm.wait_changed(max(0.01, min(1.0, deadline - time.monotonic())))  # any transition wakes it
        fm.events.emit("shadow", _POOL, "shadow_build_resumed", f"restarting now: {restarting() or 'none'}",
                       waited_s=round(time.monotonic() - t0, 3))

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
        # A frozen standby's server is on this node and watched here: its refit goes to the server straight
        # from this process and the stopped actor stays stopped (waking it costs more CPU than the refit: its
        # Ray threads catch up on everything they missed). Elsewhere the actor forwards the calls.
        direct = sh.frozen
        try:
            async with contextlib.AsyncExitStack() as stack:
                call = self._direct_call(sh) if direct else sh.actor.call.remote
                if not direct:
                    await stack.enter_async_context(self.awake(sh))
                if sh.memory_released:
                    await call("POST", "/resume_memory_occupation", {"tags": ["weights"]})
                sh.version = await self._update(sh.actor, weights, call)
                if sh.memory_released:
                    await call("POST", "/release_memory_occupation", {"tags": ["weights", "kv_cache"]})
            self.fleet.events.emit("shadow", sh.sid, "shadow_refit", f"at {sh.version}", version=sh.version,
                                   took_s=round(time.monotonic() - t0, 4), direct=direct)
        except Exception as e:
            self._lose(sh, f"refit failed: {e}"[:300], died=False)

    @staticmethod
    def _kill(actor: Any) -> None:
        import ray

        try:
            ray.kill(actor, no_restart=True)
        except Exception:
            pass

    async def shutdown(self) -> None:
        self._closing = True
        if self._session is not None:
            await self._session.close()
            self._session = None
        for t in [*self._tasks, *(x for x in (self._breather, self._rebalancer) if x is not None)]:
            t.cancel()
        for sh in self.ready:
            if sh.watcher is not None:
                sh.watcher.cancel()
            self._unwatch_server(sh)
            self._wake(sh)
            try:
                await asyncio.wait_for(sh.actor.stop.remote(), self.fleet.cfg.engines.shutdown_timeout_s * 2)
            except Exception:
                pass
            self._kill(sh.actor)
        self.ready.clear()
