"""The goodput bench's fault schedule and its delivery (bench/goodput.py runs the arms).

A seeded Poisson schedule of mixed real faults, each delivered by the chaos injector's own functions to a live
target of the running reference loop, at the first moment after its due time at which its kind has one.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from belayer_plugin.chaos.injector import ChaosInjector, pid_alive  # noqa: E402
from belayer_plugin.config import ChaosConfig  # noqa: E402
from belayer_plugin.loop import ReferenceLoop  # noqa: E402

KINDS = ("engine_server_kill", "engine_hang", "engine_actor_kill", "sandbox_kill", "learner_kill")
ENGINE_KINDS = KINDS[:3]


@dataclass
class Fault:
    """One fault of the schedule: due `t` seconds into an arm; where and when it was delivered."""

    i: int
    t: float
    kind: str
    delivered_s: Optional[float] = None  # seconds into the arm
    target: str = ""
    step: int = 0
    phase: str = ""
    segment: int = 0


def make_schedule(seed: int, mtbf_s: float, horizon_s: float) -> list[tuple[float, str]]:
    """Poisson arrivals (exponential gaps, mean `mtbf_s`) up to `horizon_s`, each of a kind drawn from KINDS."""
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        if t > horizon_s:
            return out
        out.append((round(t, 2), rng.choice(KINDS)))


class FaultDriver:
    """Delivers an arm's faults to live targets of the running loop (one job run after another).

    It is the loop's `chaos` hook (on_phase, before_action, stop) and its `on_step`; delivery is the chaos
    injector's own (`ChaosInjector._fire`: a signal to a process verified alive, a container verified running
    killed and seen stopped, an `inject` event written only then). Faults of one class (engine, sandbox,
    learner) are delivered in their order; a class never waits for another's target."""

    def __init__(self, schedule: list[tuple[float, str]], seed: int):
        self.faults = [Fault(i, t, k) for i, (t, k) in enumerate(schedule)]
        self.rng = random.Random(seed)
        self.t0: Optional[float] = None  # the arm's clock: its first step's start (monotonic)
        self.t0_wall = 0.0
        self.started = asyncio.Event()
        self.last_end: Optional[float] = None  # the last step's end (monotonic)
        self.step_start: dict[tuple[int, int], float] = {}  # (run, step) -> arm seconds at its start
        # arm seconds of each class's latest chance to be hit: a fault due later had no target left
        self.last_chance = {"engine": 0.0, "sandbox": 0.0, "learner": 0.0}
        self.loop: Any = None
        self.segment = 0
        self.phase, self.step = "start", 0
        self.serving = asyncio.Event()
        self.hit = asyncio.Event()  # a fault was delivered in this run of the job
        self.injectors: dict[str, ChaosInjector] = {}

    def now(self) -> float:
        return time.monotonic() - (self.t0 or time.monotonic())

    @staticmethod
    def cls(kind: str) -> str:
        return "engine" if kind in ENGINE_KINDS else kind.split("_")[0]

    # ---------------------------------------------------------------- the loop's hooks
    def attach(self, loop: ReferenceLoop, segment: int) -> None:
        self.loop, self.segment = loop, segment
        self.phase, self.injectors = "start", {}
        self.serving, self.hit = asyncio.Event(), asyncio.Event()
        loop.chaos = self  # chaos.enabled is false: the loop calls these hooks and nothing else of chaos

    def on_step(self, loop: ReferenceLoop, step: int, edge: str) -> None:
        if edge == "start":
            if self.t0 is None:
                self.t0, self.t0_wall = time.monotonic(), time.time()
                self.started.set()
            self.step_start[(self.segment, step)] = self.now()
        else:
            self.last_end = time.monotonic()

    def on_phase(self, phase: str, step: int) -> None:
        if self.phase == "serving" and phase != "serving":
            self.last_chance["engine"] = self.now()
        self.phase, self.step = phase, step
        if phase == "serving":
            self.serving.set()
        else:
            self.serving.clear()
        if phase == "paused":  # before the step's update
            self.last_chance["learner"] = self.now()
            f = self.due("learner")
            if f is not None:
                self._deliver(f, None, None)

    def before_action(self, traj_id: str, turn: int, sandbox: Any) -> None:
        self.last_chance["sandbox"] = self.now()
        f = self.due("sandbox")
        if f is not None:
            self._deliver(f, None, sandbox)

    def stop(self) -> None:
        for inj in self.injectors.values():  # a SIGSTOPped engine is never left behind
            inj.stop()

    # ---------------------------------------------------------------- delivery
    def due(self, cls: str) -> Optional[Fault]:
        """The earliest fault of class `cls` due now and not delivered."""
        if self.t0 is None:
            return None
        now = self.now()
        return next((f for f in self.faults if f.delivered_s is None and f.t <= now and self.cls(f.kind) == cls),
                    None)

    def _injector(self, kind: str) -> ChaosInjector:
        if kind not in self.injectors:
            cc = ChaosConfig(enabled=True, scenario="goodput", kind=kind, trigger="none", at=0, victim_state="any",
                             probability=1.0, count=1, seed=0, expect=[], poison_token_id=-1)
            loop = self.loop
            self.injectors[kind] = ChaosInjector(cc, loop.events, loop.fleet, lambda: loop.learner_pid)
        return self.injectors[kind]

    def _deliver(self, f: Fault, engine: Optional[str], sandbox: Any) -> bool:
        inj = self._injector(f.kind)
        inj.phase, inj.step = self.phase, self.step
        if not inj._fire(f"goodput fault {f.i} ({f.kind}, due at {f.t:.1f} s)", engine, sandbox):
            return False  # the injector wrote a `missed` event; the fault stays due
        f.delivered_s, f.step, f.phase, f.segment = round(self.now(), 2), self.step, self.phase, self.segment
        f.target = engine or (getattr(sandbox, "name", "") if sandbox is not None else "learner")
        self.hit.set()
        return True

    def _live_engine(self) -> Optional[str]:
        fleet = self.loop.fleet if self.loop is not None else None
        if fleet is None:
            return None
        live = [s for s in fleet.slots.values() if s.info is not None and s.health.state.value == "HEALTHY"
                and pid_alive(s.info.pid) and pid_alive(s.info.actor_pid)]
        busy = [s for s in live if s.rids]  # requests in flight (seen through Belayer's generator only)
        pick = busy or live
        return self.rng.choice(sorted(s.slot_id for s in pick)) if pick else None

    async def pump(self) -> None:
        """Delivers the engine faults in order as they fall due, while rollouts generate (beside one run of
        the job; a new run starts a new pump)."""
        await self.started.wait()
        for f in self.faults:
            if f.delivered_s is not None or f.kind not in ENGINE_KINDS:
                continue
            wait_s = self.t0 + f.t - time.monotonic()
            if wait_s > 0:
                await asyncio.sleep(wait_s)  # the schedule's own clock, not a synchronisation
            while f.delivered_s is None:
                await self.serving.wait()
                engine = self._live_engine()
                if engine is None or not self._deliver(f, engine, None):
                    await asyncio.sleep(0.05)  # no event says "an engine is serving again"; the arm's cap bounds it

    def undelivered(self, t_end: float) -> tuple[list[Fault], list[Fault]]:
        """(faults due by `t_end` that had a chance and were not delivered, those due after their class's last
        chance: outside the run)."""
        late = [f for f in self.faults if f.delivered_s is None and f.t <= t_end]
        outside = [f for f in late if f.t > self.last_chance[self.cls(f.kind)]]
        return [f for f in late if f not in outside], outside
