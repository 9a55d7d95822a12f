"""The health monitor: feeds observations into the health state machine; decides nothing itself.

Two independent signals, as NeMo-RL's review taught:
- Liveness from Ray, valid in every phase (serving, paused, memory released, mid-refit): one pending
  `wait_exit()` call per engine actor. It returns when the server process exits and raises when the actor
  dies, so a SIGKILL is seen in milliseconds and no probe is needed for it.
- Readiness from `/health_generate`, only while serving (it generates a token, so probing an offloaded or
  refitting engine would fail and kill a healthy engine); outside serving a light probe
  (`/get_model_info`, no generation) still finds a hung server. Each engine is probed by its own task, so
  one slow engine never delays another; a failed probe is retried at once, so a hung engine is declared
  dead within probe_interval_s + failure_threshold x probe_timeout_s, in every phase.
The boot grace covers only an incarnation's boot: it is armed when the incarnation is watched (never by
resume()) and ends at its first successful /health_generate or when the fleet declares it HEALTHY
(`end_grace`), whichever comes first; from then on it is under the full readiness bounds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import httpx

from belayer_plugin.config import MonitorConfig
from belayer_plugin.fleet.health import Signal

log = logging.getLogger("belayer.monitor")

OnSignal = Callable[[str, Signal, int, str], Awaitable[None]]


@dataclass
class _Watch:
    engine: str
    incarnation: int
    actor: Any
    url: str
    boot_deadline: float
    tasks: list[asyncio.Task] = field(default_factory=list)


class HealthMonitor:
    """Watches engine incarnations and reports signals through `on_signal(engine, signal, incarnation, reason)`."""

    def __init__(self, cfg: MonitorConfig, on_signal: OnSignal):
        self.cfg = cfg
        self.on_signal = on_signal
        self._watches: dict[str, _Watch] = {}
        self._serving = asyncio.Event()
        self._epoch = 0  # bumped by pause(): a probe that started before a pause reports nothing
        self._client = httpx.AsyncClient()
        self._stopped = False
        self.probes_sent = 0  # /health_generate: only ever while serving
        self.light_probes_sent = 0  # /get_model_info: while paused, released or refitting

    @property
    def serving(self) -> bool:
        return self._serving.is_set()

    def watch(self, engine: str, incarnation: int, actor: Any, url: str) -> None:
        """Starts watching one incarnation (replacing any earlier watch of the engine)."""
        self.unwatch(engine)
        w = _Watch(engine, incarnation, actor, url, time.monotonic() + self.cfg.boot_grace_s)
        w.tasks = [asyncio.create_task(self._liveness(w), name=f"liveness-{engine}"),
                   asyncio.create_task(self._readiness(w), name=f"readiness-{engine}")]
        self._watches[engine] = w

    def end_grace(self, engine: str, incarnation: int) -> None:
        """Ends the boot grace of an incarnation (it turned HEALTHY): failed probes count from now on."""
        w = self._watches.get(engine)
        if w is not None and w.incarnation == incarnation:
            w.boot_deadline = 0.0

    def in_grace(self, engine: str) -> bool:
        w = self._watches.get(engine)
        return w is not None and time.monotonic() < w.boot_deadline

    def unwatch(self, engine: str) -> None:
        w = self._watches.pop(engine, None)
        if w is not None:
            for t in w.tasks:
                t.cancel()

    def pause(self) -> None:
        """Stops readiness probes (liveness continues); in-flight probe results are discarded."""
        self._epoch += 1
        self._serving.clear()

    def resume(self) -> None:
        """Resumes readiness probes. Does NOT re-arm any boot grace deadline."""
        self._epoch += 1
        self._serving.set()

    async def _emit(self, w: _Watch, sig: Signal, reason: str) -> None:
        if self._stopped or self._watches.get(w.engine) is not w:
            return
        try:
            await self.on_signal(w.engine, sig, w.incarnation, reason)
        except Exception:  # a bug in a consumer must not silence the monitor
            log.exception("signal handler failed for %s %s", w.engine, sig)

    async def _liveness(self, w: _Watch) -> None:
        import ray

        while True:
            try:
                code = await w.actor.wait_exit.remote()
                await self._emit(w, Signal.LIVENESS_LOST, f"server process exited with code {code}")
                return
            except ray.exceptions.ActorUnavailableError as e:
                # Unreachable is not dead (a lost node looks like this for seconds first): suspect, confirm.
                await self._emit(w, Signal.UNAVAILABLE, f"actor unavailable: {type(e).__name__}")
                if not await self._confirm_alive(w):
                    await self._emit(w, Signal.LIVENESS_LOST, "actor unreachable and not answering pings")
                    return
            except ray.exceptions.RayActorError as e:
                await self._emit(w, Signal.LIVENESS_LOST, f"actor died: {type(e).__name__}")
                return

    async def _confirm_alive(self, w: _Watch) -> bool:
        import ray

        for _ in range(self.cfg.failure_threshold):
            try:
                await asyncio.wait_for(w.actor.ping.remote(), self.cfg.liveness_timeout_s)
                return True
            except ray.exceptions.RayActorError:
                return False
            except (asyncio.TimeoutError, ray.exceptions.GetTimeoutError):
                continue
        return False

    async def _readiness(self, w: _Watch) -> None:
        while True:
            epoch = self._epoch
            # Serving: /health_generate proves the engine generates. Paused, offloaded or mid-refit it
            # must not be asked to generate (that killed healthy engines elsewhere), but a hung server
            # must still be found: /get_model_info is answered by the HTTP front without generating.
            path = "/health_generate" if self._serving.is_set() else "/get_model_info"
            ok, reason = await self._probe(w.url, path)
            if epoch != self._epoch:
                continue  # the phase changed mid-probe: the result is about the other kind of probe
            if ok:
                if path == "/health_generate":
                    w.boot_deadline = 0.0  # it generated: booted, the grace is over
                await self._emit(w, Signal.PROBE_OK, "")
                await asyncio.sleep(self.cfg.probe_interval_s)  # the probe period, not synchronisation
            elif time.monotonic() < w.boot_deadline:
                await asyncio.sleep(min(self.cfg.probe_interval_s, max(0.0, w.boot_deadline - time.monotonic())))
            else:
                await self._emit(w, Signal.PROBE_FAILED, reason)
                # no pause after a failure: confirm or clear the suspicion at once

    async def _probe(self, url: str, path: str) -> tuple[bool, str]:
        if path == "/health_generate":
            self.probes_sent += 1
        else:
            self.light_probes_sent += 1
        try:
            r = await self._client.get(f"{url}{path}", timeout=self.cfg.probe_timeout_s)
            return (True, "") if r.status_code == 200 else (False, f"{path} HTTP {r.status_code}")
        except httpx.TimeoutException:
            return False, f"{path} timed out after {self.cfg.probe_timeout_s:g} s"
        except httpx.HTTPError as e:
            return False, f"{path} {type(e).__name__}"

    async def stop(self) -> None:
        """Cancels every watch and waits for the tasks to end; safe with probes in flight."""
        self._stopped = True
        tasks = [t for w in self._watches.values() for t in w.tasks]
        self._watches.clear()
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        await self._client.aclose()
