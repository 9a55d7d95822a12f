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

A third signal, token progress (`monitor.progress`, fleet/progress.py), finds a hang in about a second
instead of probe_interval_s + failure_threshold x probe_timeout_s: clients report what they stream
(`request_started`, `tokens_seen`, `request_ended`); an engine with requests in flight that stays silent
past its own adaptive threshold is SUSPECT at once and probed at once (/health_generate, bounded by
`progress.confirm_timeout_s`); a token or an answer within that bound clears it, neither makes it DEAD
(`Signal.PROGRESS_HUNG`, fenced and replaced like any other death). Never while paused, released or
refitting, nor before an incarnation has streamed `progress.min_gaps` gaps since it started or resumed.

Owns: liveness waits, readiness probes and the token-progress tracker's deadlines, per incarnation. Must not:
decide transitions (fleet/health.py) or act on engines (the FleetManager): it reports signals only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterator, Optional

import aiohttp

from belayer_plugin.config import MonitorConfig
from belayer_plugin.fleet.health import Signal
from belayer_plugin.fleet.progress import ProgressTracker, Stall

log = logging.getLogger("belayer.monitor")

OnSignal = Callable[[str, Signal, int, str], Awaitable[None]]

# A wake-up of the progress watcher later than this means the monitor's own event loop was blocked: the
# overshoot is excused from every engine's silence (tokens may sit unread in our sockets, not be missing).
_LOOP_LAG_S = 0.25
# Before a silence is declared, the loop gets this long to read tokens that arrived with the deadline.
_SETTLE_S = 0.02


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
        self._calls: dict[str, list[int]] = {}  # control calls per engine (control_call)
        self.probes_excused = 0  # failed probes discarded because a control call overlapped them
        # aiohttp, made at the first probe (it belongs to a running loop): a probe through httpx cost several
        # times its CPU, paid every probe interval on every engine. No keep-alive: a pooled connection the
        # server closed while idle (uvicorn's 5 s) would fail the next probe and make a healthy engine SUSPECT.
        self._session: Optional[aiohttp.ClientSession] = None
        self._stopped = False
        self.progress = ProgressTracker(cfg.progress)
        self._progress_task: Optional[asyncio.Task] = None
        self._progress_wake = asyncio.Event()
        self._confirming: dict[str, asyncio.Event] = {}  # engine -> set when a token arrives during confirmation
        self.probes_sent = 0  # /health_generate: only ever while serving
        self.light_probes_sent = 0  # /get_model_info: while paused, released or refitting
        self.probes_skipped = 0  # /health_generate not sent: the engine streamed tokens within the interval
        self._generating: set[asyncio.Future] = set()  # one per /health_generate probe in flight

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
        if self.cfg.progress.enabled:
            self.progress.watch(engine, incarnation)
            if self._progress_task is None:
                self._progress_task = asyncio.create_task(self._progress_loop(), name="progress-watch")

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
        self.progress.forget(engine)
        self._confirming.pop(engine, None)
        if w is not None:
            for t in w.tasks:
                t.cancel()

    @contextlib.contextmanager
    def control_call(self, engine: str) -> Iterator[None]:
        """Marks a call that may hold the engine's server for a while (a memory release or resume): a failed
        readiness probe that overlaps it says nothing about the engine and is discarded. Liveness still
        watches, and the call is bounded by its own timeout. (CI: a CPU engine's release held its event loop
        past two 0.5 s probes on a loaded machine, and a healthy engine was declared dead.)"""
        c = self._calls.setdefault(engine, [0, 0])  # [in flight, begun so far]
        c[0] += 1
        c[1] += 1
        try:
            yield
        finally:
            c[0] -= 1

    def _calls_now(self, engine: str) -> tuple[int, int]:
        c = self._calls.get(engine, (0, 0))
        return c[0], c[1]

    def _overlapped(self, engine: str, then: tuple[int, int]) -> bool:
        """Whether a control call ran at any time between `then` (_calls_now) and now."""
        now = self._calls_now(engine)
        return then[0] > 0 or now[0] > 0 or now[1] != then[1]

    def pause(self) -> None:
        """Stops readiness probes (liveness continues); in-flight probe results are discarded."""
        self._epoch += 1
        self._serving.clear()
        self.progress.suspend()

    async def generate_probes_settled(self, timeout: float) -> bool:
        """Waits until every /health_generate probe in flight has its answer or its own timeout; False if
        `timeout` passed first. A probe is a real request on the engine's scheduler, and SGLang asserts (and
        its scheduler dies) when memory is released with one still there."""
        pending = list(self._generating)
        if not pending:
            return True
        _, left = await asyncio.wait(pending, timeout=timeout)
        return not left

    def resume(self) -> None:
        """Resumes readiness probes. Does NOT re-arm any boot grace deadline."""
        self._epoch += 1
        self._serving.set()
        self.progress.resume(time.monotonic())
        self._progress_wake.set()

    # ------------------------------------------------------------ token progress (fed by clients)
    def request_started(self, engine: str, incarnation: int, rid: str, prompt_tokens: int) -> None:
        """A streamed request (or resumed segment) of `prompt_tokens` input tokens began on the engine."""
        if self.cfg.progress.enabled:
            self.progress.started(engine, incarnation, rid, prompt_tokens, time.monotonic())
            self._progress_wake.set()  # an idle engine turned busy: a new, maybe earlier, deadline

    def tokens_seen(self, engine: str, incarnation: int, rid: str, chunks: int = 1) -> None:
        """New tokens of `rid` streamed back from the engine, in `chunks` stream chunks (one read)."""
        if self.cfg.progress.enabled:
            self.progress.tokens(engine, incarnation, rid, time.monotonic(), chunks)
            ev, w = self._confirming.get(engine), self._watches.get(engine)
            if ev is not None and w is not None and w.incarnation == incarnation:
                ev.set()

    def fault_reported(self, engine: str, incarnation: int) -> None:
        """A fault signal reached the engine's health (from a client or a probe): readiness from tokens must
        not clear it with tokens streamed before it (a killed engine's last tokens turned SUSPECT back to
        HEALTHY for a moment, found by tests/test_sglang_fleet.py)."""
        self.progress.fault(engine, incarnation)

    def request_ended(self, engine: str, incarnation: int, rid: str) -> None:
        """The request left the engine (finished, failed or moved elsewhere)."""
        if self.cfg.progress.enabled:
            self.progress.ended(engine, incarnation, rid, time.monotonic())

    async def _progress_loop(self) -> None:
        while True:
            try:
                await self._progress_round()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not end hang detection for good
                log.exception("progress watcher round failed")
                await asyncio.sleep(self.cfg.progress.floor_s)  # not a hot loop if it keeps failing

    async def _progress_round(self) -> None:
        """Sleeps until the earliest silence deadline (or a change), then reports and confirms stalls."""
        self._progress_wake.clear()
        d = self.progress.next_deadline()
        t_sleep = time.monotonic()
        timeout = None if d is None else d - t_sleep
        if timeout is None or timeout > 0:
            try:
                await asyncio.wait_for(self._progress_wake.wait(), timeout)
                return  # something changed: recompute the deadlines
            except asyncio.TimeoutError:
                pass
            late = time.monotonic() - (t_sleep + timeout)
            if late > _LOOP_LAG_S:
                self.progress.excuse(late)
                log.warning("monitor loop was %.2f s late: excused from every engine's silence", late)
                return
        await asyncio.sleep(_SETTLE_S)  # let readers take tokens that arrived with the deadline
        for st in self.progress.stalled(time.monotonic()):
            w = self._watches.get(st.engine)
            if w is None or w.incarnation != st.incarnation or not self.serving or self.in_grace(st.engine):
                continue
            log.warning("%s: %s", st.engine, st.reason)
            await self._emit(w, Signal.PROGRESS_STALLED, st.reason)
            w.tasks = [t for t in w.tasks if not t.done()]
            w.tasks.append(asyncio.create_task(self._confirm(w, st), name=f"confirm-{st.engine}"))

    async def _confirm(self, w: _Watch, st: Stall) -> None:
        """Probes a silent engine at once: a token or an answer clears it; neither within the bound: DEAD."""
        epoch, timeout = self._epoch, self.cfg.progress.confirm_timeout_s
        seen = self._confirming[w.engine] = asyncio.Event()
        probe = asyncio.create_task(self._probe(w.url, "/health_generate", timeout))
        token = asyncio.create_task(seen.wait())
        try:
            await asyncio.wait({probe, token}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if self._confirming.get(w.engine) is seen:
                del self._confirming[w.engine]
            token.cancel()
            if not probe.done():
                probe.cancel()
        if epoch != self._epoch:
            return  # paused or resumed meanwhile: the silence is about another phase
        if seen.is_set():
            await self._emit(w, Signal.PROGRESS_RESUMED, "progress: tokens again")
            return
        ok, reason = probe.result()
        if ok:
            self.progress.answered(w.engine, w.incarnation, time.monotonic())
            await self._emit(w, Signal.PROBE_OK, "progress: silent but answered /health_generate")
        else:
            await self._emit(w, Signal.PROGRESS_HUNG, f"{st.reason}; then {reason}")

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
            if path == "/health_generate" and self._served_recently(w):
                # Its own tokens answered within the interval: a generate probe would only add a request
                # to its batch. A silence past its threshold or the interval gets the real probe.
                self.probes_skipped += 1
                w.boot_deadline = 0.0
                await self._emit(w, Signal.PROBE_OK, "")
                await asyncio.sleep(self.cfg.probe_interval_s)  # the probe period, not synchronisation
                continue
            calls = self._calls_now(w.engine)
            ok, reason = await self._probe(w.url, path)
            if epoch != self._epoch:
                continue  # the phase changed mid-probe: the result is about the other kind of probe
            if not ok and self._overlapped(w.engine, calls):
                self.probes_excused += 1
                await asyncio.sleep(self.cfg.probe_interval_s)  # the probe period, not synchronisation
                continue
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

    def _served_recently(self, w: _Watch) -> bool:
        p = self.cfg.progress
        return p.enabled and p.readiness_from_tokens and self.progress.served_within(
            w.engine, w.incarnation, self.cfg.probe_interval_s, time.monotonic())

    async def _probe(self, url: str, path: str, timeout: Optional[float] = None) -> tuple[bool, str]:
        timeout = self.cfg.probe_timeout_s if timeout is None else timeout
        if self._stopped:
            return False, "monitor stopped"
        settled = None
        if path == "/health_generate":
            self.probes_sent += 1
            settled = asyncio.get_running_loop().create_future()
            self._generating.add(settled)
        else:
            self.light_probes_sent += 1
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0),
                                                  trust_env=False)
        try:
            async with self._session.get(f"{url}{path}", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                await r.read()
                return (True, "") if r.status == 200 else (False, f"{path} HTTP {r.status}")
        except asyncio.TimeoutError:
            return False, f"{path} timed out after {timeout:g} s"
        except aiohttp.ClientError as e:
            return False, f"{path} {type(e).__name__}"
        finally:
            if settled is not None:
                self._generating.discard(settled)
                settled.set_result(None)

    async def stop(self) -> None:
        """Cancels every watch and waits for the tasks to end; safe with probes in flight."""
        self._stopped = True
        tasks = [t for w in self._watches.values() for t in w.tasks]
        if self._progress_task is not None:
            tasks.append(self._progress_task)
        self._watches.clear()
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        if self._session is not None:
            await self._session.close()
            self._session = None
