"""The chaos injector: real faults at configured moments of a run.

Kinds: engine_actor_kill, engine_server_kill (SIGKILL), engine_hang (SIGSTOP), engine_flaky (every new
incarnation of one slot is killed), shadow_kill, sandbox_kill, sandbox_kill_checkpoint,
sandbox_kill_restore, learner_kill. Triggers: time (seconds into the run), step (at the phase given by
victim_state: serving, paused, refit), token (a request reaching token `at`), action (a trajectory
reaching turn `at`).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from typing import Any, Callable, Optional

from belayer_plugin.config import ChaosConfig
from belayer_plugin.events import EventLog

ENGINE_KINDS = ("engine_actor_kill", "engine_server_kill", "engine_hang", "engine_flaky")
SANDBOX_KINDS = ("sandbox_kill", "sandbox_kill_checkpoint", "sandbox_kill_restore")
KINDS = ENGINE_KINDS + SANDBOX_KINDS + ("shadow_kill", "learner_kill")


class ChaosInjector:
    """Fires `cfg.count` faults of `cfg.kind` when the trigger matches (with `cfg.probability`)."""

    def __init__(self, cfg: ChaosConfig, events: EventLog, fleet: Any,
                 learner_pid: Callable[[], Optional[int]] = lambda: None):
        if cfg.kind not in KINDS:
            raise ValueError(f"belayer.chaos.kind: unknown {cfg.kind!r}; known: {', '.join(KINDS)}")
        self.cfg = cfg
        self.events = events
        self.fleet = fleet
        self.learner_pid = learner_pid
        self.rng = random.Random(cfg.seed)
        self.fired = 0
        self.phase, self.step = "serving", 0
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._timer: Optional[threading.Timer] = None
        self.faulty_backend: Any = None
        self._flaky_slot: Optional[str] = None
        self._stopped_pids: list[int] = []

    # ------------------------------------------------------------------ wiring
    def start(self) -> None:
        if self.cfg.trigger == "time":
            self._timer = threading.Timer(self.cfg.at, lambda: self._maybe(f"t={self.cfg.at:g}s"))
            self._timer.daemon = True
            self._timer.start()

    def wrap_backend(self, backend: Any) -> Any:
        """Kills during a checkpoint or a restore need to see those calls: wrap the real backend."""
        if self.cfg.kind not in ("sandbox_kill_checkpoint", "sandbox_kill_restore"):
            return backend
        from belayer_plugin.sandbox.scripted import Fault, FaultyBackend

        if self.cfg.kind == "sandbox_kill_checkpoint":
            faults = [Fault("checkpoint", int(self.cfg.at) or 1, 0.05)]
        else:  # the first restore after a kill is itself killed; recovery must retry it
            faults = [Fault("restore", 1, 0.05)]
        self.faulty_backend = FaultyBackend(backend, faults)
        events, kind = self.events, self.cfg.kind

        class _Announced(list):
            # FaultyBackend appends a fault here right before it kills the container: say so in the events
            def append(self, f: Any) -> None:
                super().append(f)
                events.emit("chaos", f"sandbox-{f.phase}", "inject", f"container killed {f.delay_s:g} s into "
                            f"{f.phase} call #{f.nth}", level="warning", fault=kind)

        self.faulty_backend.fired = _Announced()
        if self.cfg.kind == "sandbox_kill_checkpoint":
            with self._lock:
                self.fired = self.cfg.count  # the backend fires this one itself; no trigger of ours
        # sandbox_kill_restore: our trigger kills the sandbox; the backend then kills its first restore
        self.faulty_backend.arm()
        return self.faulty_backend

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.faulty_backend is not None:
            self.faulty_backend.disarm()
        for pid in self._stopped_pids:  # never leave a SIGSTOPped process behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # ------------------------------------------------------------------ triggers
    def on_phase(self, phase: str, step: int) -> None:
        self.phase, self.step = phase, step
        if self.cfg.trigger == "step" and step == int(self.cfg.at) and self.cfg.victim_state in (phase, "any"):
            self._maybe(f"step {step}, {phase}")

    def gen_observer(self, clog: Any, seg: Any) -> None:
        if self.cfg.trigger == "token" and clog.committed >= int(self.cfg.at) and self._victim_phase_ok():
            self._maybe(f"token {clog.committed} of {clog.rid}", engine=seg.engine)

    def before_action(self, traj_id: str, turn: int, sandbox: Any) -> None:
        if self.cfg.trigger == "action" and turn == int(self.cfg.at):
            self._maybe(f"action {turn} of {traj_id}", sandbox=sandbox)

    def on_event(self, ev: Any) -> None:
        # engine_flaky: every new incarnation of the chosen slot dies as soon as it has started
        if self.cfg.kind == "engine_flaky" and self._flaky_slot and ev.subject == self._flaky_slot \
                and ev.kind == "transition" and ev.to_state == "STALE":
            slot = self.fleet.slots.get(self._flaky_slot)
            if slot is not None and slot.info is not None:
                self._signal(slot.info.pid, signal.SIGKILL, f"{self._flaky_slot} (flaky, incarnation {ev.figures.get('incarnation')})")

    def _victim_phase_ok(self) -> bool:
        return self.cfg.victim_state in ("any", self.phase)

    # ------------------------------------------------------------------ firing
    def _maybe(self, why: str, engine: Optional[str] = None, sandbox: Any = None) -> None:
        with self._lock:
            if self.fired >= self.cfg.count or self.rng.random() >= self.cfg.probability:
                return
            self.fired += 1
        self._fire(why, engine, sandbox)

    def _fire(self, why: str, engine: Optional[str], sandbox: Any) -> None:
        k = self.cfg.kind
        if k in ENGINE_KINDS:
            slots = [s for s in self.fleet.slots.values() if s.info is not None and s.health.state.value != "RETIRED"]
            slot = next((s for s in slots if s.slot_id == engine), None) or (slots[0] if slots else None)
            if slot is None:
                return
            if k == "engine_actor_kill":
                self._signal(slot.info.actor_pid, signal.SIGKILL, f"{slot.slot_id} actor", why)
            elif k == "engine_server_kill":
                self._signal(slot.info.pid, signal.SIGKILL, f"{slot.slot_id} server", why)
            elif k == "engine_hang":
                self._stopped_pids.append(slot.info.pid)
                self._signal(slot.info.pid, signal.SIGSTOP, f"{slot.slot_id} server", why)
            elif k == "engine_flaky":
                self._flaky_slot = slot.slot_id
                self._signal(slot.info.pid, signal.SIGKILL, f"{slot.slot_id} (flaky)", why)
        elif k == "shadow_kill":
            pool = getattr(self.fleet, "shadows", None)
            if pool is not None and pool.ready:
                self._signal(pool.ready[0].info.pid, signal.SIGKILL, pool.ready[0].sid, why)
        elif k == "learner_kill":
            pid = self.learner_pid()
            if pid:
                self._signal(pid, signal.SIGKILL, "learner", why)
        elif k in SANDBOX_KINDS and sandbox is not None:
            self.events.emit("chaos", sandbox.sandbox_id, "inject", why, level="warning", fault=k,
                             victim=sandbox.name)
            sandbox.backend.kill(sandbox.container_id)

    def _signal(self, pid: int, sig: int, victim: str, why: str = "") -> None:
        self.events.emit("chaos", victim, "inject", why, level="warning", fault=self.cfg.kind, pid=pid,
                         signal=signal.Signals(sig).name, phase=self.phase, step=self.step)
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
