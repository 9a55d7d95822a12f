"""The restart policy: a per-engine budget in a sliding window, capped exponential backoff, retirement,
and a floor of engines below which the run fails fast. Pure: time is passed in.

Owns: restart budgets, backoff, retirement and the healthy floor. Must not: do I/O or act on engines.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

from belayer_plugin.config import RestartConfig
from belayer_plugin.fleet.health import EngineHealth, State


@dataclass(frozen=True)
class Decision:
    action: str  # "restart" | "retire"
    delay_s: float  # backoff before the restart
    restarts_in_window: int
    reason: str


class FleetBelowFloorError(RuntimeError):
    """Fewer usable engines than restart.min_healthy_engines: the run cannot continue."""

    def __init__(self, usable: int, floor: int, engines: Iterable[EngineHealth]):
        self.usable, self.floor = usable, floor
        self.engines = list(engines)
        lines = [f"only {usable} usable engine(s), below the floor restart.min_healthy_engines={floor}:"]
        for h in self.engines:
            steps = ", ".join(f"{tr.from_state.value}->{tr.to_state.value} ({tr.signal.value}"
                              + (f": {tr.reason}" if tr.reason else "") + ")" for tr in h.history[-8:])
            lines.append(f"  {h.engine}: {h.state.value}, incarnation {h.incarnation}; history: {steps or '-'}")
        super().__init__("\n".join(lines))


class RestartPolicy:
    """Decides restart-or-retire for dead engines and checks the healthy floor."""

    def __init__(self, cfg: RestartConfig):
        self.cfg = cfg
        self._restarts: dict[str, list[tuple[float, object]]] = defaultdict(list)

    def restarts_in_window(self, engine: str, now: float) -> int:
        times = [(t, tag) for t, tag in self._restarts[engine] if now - t < self.cfg.window_s]
        self._restarts[engine] = times
        return len(times)

    def decide(self, engine: str, now: float) -> Decision:
        """Restart (after a backoff) while the engine's budget lasts; retire it once spent."""
        n = self.restarts_in_window(engine, now)
        if n >= self.cfg.max_restarts:
            return Decision("retire", 0.0, n, f"{n} restarts within {self.cfg.window_s:g} s "
                                              f"(budget restart.max_restarts={self.cfg.max_restarts})")
        delay = min(self.cfg.backoff_max_s, self.cfg.backoff_initial_s * self.cfg.backoff_multiplier ** n)
        return Decision("restart", delay, n, f"restart {n + 1} of {self.cfg.max_restarts} in the window")

    def record_restart(self, engine: str, now: float, cause: object = None) -> None:
        """Spends one restart of the engine's budget; `cause` names the death it answers (for refunds)."""
        self._restarts[engine].append((now, cause))

    def renew(self, engine: str) -> None:
        """Forgets the engine's spent restarts: a retired slot tried again after its cool-down starts afresh."""
        self._restarts.pop(engine, None)

    def refund(self, engine: str, cause: object) -> bool:
        """Gives back the restart spent on `cause` (a death a poison request caused); True if there was one."""
        for i, (_, tag) in enumerate(self._restarts[engine]):
            if tag == cause:
                del self._restarts[engine][i]
                return True
        return False

    def check_floor(self, engines: Iterable[EngineHealth]) -> None:
        """Raises FleetBelowFloorError when fewer engines than the floor can still serve.

        Engines being restarted count as usable (they come back); retired ones do not, even while their
        restart.retire_cooldown_s runs: a slot cooling down is not usable until it is back.
        """
        engines = list(engines)
        usable = sum(1 for h in engines if h.state is not State.RETIRED)
        if usable < self.cfg.min_healthy_engines:
            raise FleetBelowFloorError(usable, self.cfg.min_healthy_engines, engines)
