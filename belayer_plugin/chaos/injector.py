"""The chaos injector: real faults at configured moments of a run.

Kinds: engine_actor_kill, engine_server_kill (SIGKILL), engine_hang (SIGSTOP), engine_flaky (every new
incarnation of one slot is killed), shadow_kill, sandbox_kill, sandbox_kill_checkpoint,
sandbox_kill_restore, learner_kill. Triggers: time (seconds into the run), step (at the phase given by
victim_state: serving, paused, refit), token (a request reaching token `at`), action (a trajectory
reaching turn `at`).

Every fault is recorded as delivered, never as intended: an `inject` event is written only after a signal
reached a process verified alive, or a container verified running was killed and seen stopped; otherwise a
`missed` event says why and the trigger re-arms (chaos/check.py fails a run without a delivered fault).

Owns: delivering real faults (signals, container kills) to verified-live targets at configured moments, and
recording each as an event. Must not: run unless chaos.enabled, recover anything, or import the fleet (targets
are handed to it).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from belayer_plugin.config import ChaosConfig
from belayer_plugin.events import EventLog

ENGINE_KINDS = ("engine_actor_kill", "engine_server_kill", "engine_hang", "engine_flaky")
SANDBOX_KINDS = ("sandbox_kill", "sandbox_kill_checkpoint", "sandbox_kill_restore")
KINDS = ENGINE_KINDS + SANDBOX_KINDS + ("shadow_kill", "learner_kill")


class ChaosInjector:
    """Fires `cfg.count` faults of `cfg.kind` when the trigger matches (with `cfg.probability`)."""

    def __init__(self, cfg: ChaosConfig, events: EventLog, fleet: Any,
                 learner_pid: Callable[[], Optional[int]] = lambda: None,
                 learner_node: Callable[[], Optional[str]] = lambda: None):
        if cfg.kind not in KINDS:
            raise ValueError(f"belayer.chaos.kind: unknown {cfg.kind!r}; known: {', '.join(KINDS)}")
        self.cfg = cfg
        self.events = events
        self.fleet = fleet
        self.learner_pid = learner_pid
        self.learner_node = learner_node  # the learner's Ray node (None: this process's)
        self.rng = random.Random(cfg.seed)
        self.fired = 0
        self.phase, self.step = "serving", 0
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._timer: Optional[threading.Timer] = None
        self.faulty_backend: Any = None
        self._flaky_slot: Optional[str] = None
        self._stopped_pids: list[tuple[int, Optional[str]]] = []  # (pid, its Ray node; None: this one)

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
        self.faulty_backend = _KillingBackend(backend, self)
        if self.cfg.kind == "sandbox_kill_checkpoint":
            self.faulty_backend.arm("checkpoint", int(self.cfg.at) or 1)
            with self._lock:
                self.fired = self.cfg.count  # the backend fires this one itself; no trigger of ours
        # sandbox_kill_restore: our trigger kills the sandbox; the backend then kills its first restore
        return self.faulty_backend

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.faulty_backend is not None:
            self.faulty_backend.disarm()
        for pid, node in self._stopped_pids:  # never leave a SIGSTOPped process behind
            try:
                if node is None:
                    os.kill(pid, signal.SIGKILL)
                else:
                    signal_on_node(node, pid, signal.SIGKILL, self.cfg.deliver_timeout_s)
            except Exception:  # gone already, or its node with it
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
                self._signal(slot.info.pid, signal.SIGKILL, f"{self._flaky_slot} (flaky)",
                             f"incarnation {ev.figures.get('incarnation')}", self._flaky_slot, slot.info.node_id)

    def _victim_phase_ok(self) -> bool:
        return self.cfg.victim_state in ("any", self.phase)

    # ------------------------------------------------------------------ firing
    def _maybe(self, why: str, engine: Optional[str] = None, sandbox: Any = None) -> None:
        with self._lock:
            if self.fired >= self.cfg.count or self.rng.random() >= self.cfg.probability:
                return
            self.fired += 1
        if not self._fire(why, engine, sandbox):
            with self._lock:  # nothing was hit: the next trigger point tries again
                self.fired -= 1

    def _fire(self, why: str, engine: Optional[str], sandbox: Any) -> bool:
        k = self.cfg.kind
        if k in ENGINE_KINDS:
            slots = [s for s in self.fleet.slots.values() if s.info is not None and s.health.state.value != "RETIRED"]
            slot = next((s for s in slots if s.slot_id == engine), None) or (slots[0] if slots else None)
            if slot is None:
                return self._missed("engine", why, "no engine with a process to hit")
            node = slot.info.node_id
            if k == "engine_actor_kill":
                return self._signal(slot.info.actor_pid, signal.SIGKILL, f"{slot.slot_id} actor", why, slot.slot_id,
                                    node)
            if k == "engine_server_kill":
                return self._signal(slot.info.pid, signal.SIGKILL, f"{slot.slot_id} server", why, slot.slot_id, node)
            if k == "engine_hang":
                ok = self._signal(slot.info.pid, signal.SIGSTOP, f"{slot.slot_id} server", why, slot.slot_id, node)
                if ok:
                    self._stopped_pids.append((slot.info.pid, None if _here(node) else node))
                return ok
            self._flaky_slot = slot.slot_id  # engine_flaky
            return self._signal(slot.info.pid, signal.SIGKILL, f"{slot.slot_id} (flaky)", why, slot.slot_id, node)
        if k == "shadow_kill":
            pool = getattr(self.fleet, "shadows", None)
            if pool is None or not pool.ready:
                return self._missed("shadow", why, "no standby was ready")
            sh = pool.ready[0]
            return self._signal(sh.info.pid, signal.SIGKILL, sh.sid, why, sh.sid, sh.info.node_id)
        if k == "learner_kill":
            pid = self.learner_pid()
            if not pid:
                return self._missed("learner", why, "no learner process")
            return self._signal(pid, signal.SIGKILL, "learner", why, "learner", self.learner_node())
        if k in SANDBOX_KINDS and sandbox is not None:
            ok = self.kill_container(sandbox.backend, sandbox.container_id, sandbox.sandbox_id, why,
                                     victim=sandbox.name)
            if ok and self.faulty_backend is not None and k == "sandbox_kill_restore":
                self.faulty_backend.arm("restore", 1)  # the restore of this sandbox is killed in its turn
            return ok
        return self._missed("sandbox", why, "no sandbox given")

    # ------------------------------------------------------------------ delivery
    def _missed(self, victim: str, why: str, reason: str, **figures: Any) -> bool:
        self.events.emit("chaos", victim, "missed", f"{why}: {reason}", level="error", fault=self.cfg.kind,
                         phase=self.phase, step=self.step, **figures)
        return False

    def _signal(self, pid: Optional[int], sig: int, victim: str, why: str = "", target: str = "",
                node: Optional[str] = None) -> bool:
        """Sends `sig` to a process verified alive, on its own Ray node (`node`; None: this process's node);
        the `inject` event records the delivery, not the intent."""
        name = signal.Signals(sig).name
        if not pid:
            return self._missed(victim, why, f"no process id: {name} not sent", pid=pid)
        if _here(node):
            problem = _deliver(pid, sig)
        else:
            # A pid read on another machine names some other process here: a task on that node signals it.
            try:
                problem = signal_on_node(node, pid, sig, self.cfg.deliver_timeout_s)
            except Exception as e:  # the node is gone or did not answer within chaos.deliver_timeout_s
                problem = f"{type(e).__name__}: {str(e)[:200]}"
            problem = problem and f"on node {node[:12]}: {problem}"
        if problem:
            return self._missed(victim, why, problem, pid=pid)
        self.events.emit("chaos", victim, "inject", why, level="warning", fault=self.cfg.kind, pid=pid,
                         signal=name, phase=self.phase, step=self.step, delivered=True, target=target or victim,
                         node=node, via="here" if _here(node) else "a task on its node")
        return True

    def kill_container(self, backend: Any, cid: str, subject: str, why: str, victim: str = "",
                       confirm_s: float = 10.0) -> bool:
        """Kills a container verified running and confirms it stopped; the `inject` event records that."""
        if not cid or not backend.is_running(cid):
            return self._missed(subject, why, f"container {str(cid)[:12]} was not running: not killed")
        backend.kill(cid)
        deadline = time.monotonic() + confirm_s
        stopped = not backend.is_running(cid)
        while not stopped and time.monotonic() < deadline:
            # the runtime reports the state a moment after the kill; bounded, and only in chaos runs
            time.sleep(0.05)
            stopped = not backend.is_running(cid)
        if not stopped:
            return self._missed(subject, why, f"container {cid[:12]} still running {confirm_s:g} s after the kill")
        self.events.emit("chaos", subject, "inject", why, level="warning", fault=self.cfg.kind, victim=victim or subject,
                         container=cid[:12], phase=self.phase, step=self.step, delivered=True, target=subject)
        return True


def _here(node: Optional[str]) -> bool:
    """True when `node` is None or the Ray node this process runs on."""
    if node is None:
        return True
    import ray

    return not ray.is_initialized() or node == ray.get_runtime_context().get_node_id()


def _deliver(pid: int, sig: int) -> Optional[str]:
    """On the target's node: sends `sig` to `pid` verified alive; None when sent, else why not."""
    name = signal.Signals(sig).name
    if not pid_alive(pid):
        return f"process {pid} was not alive: {name} not sent"
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError) as e:
        return f"{name} to {pid} failed: {type(e).__name__}"
    return None


def signal_on_node(node: str, pid: int, sig: int, timeout_s: float) -> Optional[str]:
    """Sends `sig` to `pid` from a Ray task pinned to `node`; None when delivered, else why not. Raises when
    the node does not answer within `timeout_s`."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(_deliver).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
    return ray.get(task.remote(pid, sig), timeout=timeout_s)


def pid_alive(pid: int) -> bool:
    """True when `pid` exists and is not a zombie (a signal to a zombie hits nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


class _KillingBackend:
    """Delegates to the real backend and kills the real container inside one chosen checkpoint or restore.

    Deterministic by construction: a checkpoint is hit as its call begins on a container verified running
    (the call then fails part-way and its staging directory must be discarded); a restore is hit right after
    the runtime restored a running container, before Belayer accepted it (the restore must be retried).
    """

    def __init__(self, inner: Any, injector: ChaosInjector):
        self.inner = inner
        self.name = inner.name
        self.injector = injector
        self.armed: dict[str, int] = {}  # phase -> the call (1-based, counted from arming) to hit
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def __getattr__(self, item: str) -> Any:
        return getattr(self.inner, item)

    def arm(self, phase: str, nth: int) -> None:
        with self._lock:
            self.armed[phase], self.counts[phase] = nth, 0

    def disarm(self) -> None:
        with self._lock:
            self.armed.clear()

    def _due(self, phase: str) -> bool:
        with self._lock:
            if phase not in self.armed:
                return False
            self.counts[phase] += 1
            if self.counts[phase] != self.armed[phase]:
                return False
            del self.armed[phase]
            return True

    def criu_checkpoint(self, cid: str, spec: Any, staging: Any, timeout_s: float, new_name: str) -> Any:
        if self._due("checkpoint"):
            self.injector.kill_container(self.inner, cid, Path(str(staging)).parent.name,
                                         f"checkpoint call #{self.counts['checkpoint']} began")
        return self.inner.criu_checkpoint(cid, spec, staging, timeout_s, new_name)

    def pause(self, cid: str) -> None:  # the file-system-only checkpoint begins with a pause
        if self._due("checkpoint"):
            self.injector.kill_container(self.inner, cid, cid[:12], f"checkpoint call #{self.counts['checkpoint']} began")
        return self.inner.pause(cid)

    def criu_restore(self, ckdir: Any, spec: Any, name: str, timeout_s: float) -> str:
        cid = self.inner.criu_restore(ckdir, spec, name, timeout_s)
        if self._due("restore"):
            self.injector.kill_container(self.inner, cid, Path(str(ckdir)).parent.name,
                                         f"restore #{self.counts['restore']} brought {name} up")
        return cid

    def start(self, cid: str) -> None:  # the file-system-only restore ends with a start
        self.inner.start(cid)
        if self._due("restore"):
            self.injector.kill_container(self.inner, cid, cid[:12], f"restore #{self.counts['restore']} started it")
