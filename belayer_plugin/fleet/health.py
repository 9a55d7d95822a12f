"""Engine health as a pure state machine: no I/O, no threads, no clocks (time is passed in).

    HEALTHY --probe failed / request failed / unavailable / progress stalled--> SUSPECT --threshold failures--> DEAD
    SUSPECT --progress resumed--> HEALTHY      HEALTHY|SUSPECT --progress hung (stall + failed probe)--> DEAD
    HEALTHY|SUSPECT|STALE|RESTARTING --liveness lost--> DEAD
    DEAD --restart begun--> RESTARTING --started--> STALE --weights current--> HEALTHY
    HEALTHY --version mismatch--> STALE           DEAD --budget spent--> RETIRED
    RETIRED --retry (the manager, once restart.retire_cooldown_s is over)--> RESTARTING (a new incarnation)

Every signal carries the engine incarnation it was observed on: a late probe result from a previous
incarnation can never revive a dead engine or condemn its replacement.

Owns: the health states, signals and transitions per incarnation. Must not: do I/O, read clocks, or act on
engines.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional


class State(str, enum.Enum):
    HEALTHY = "HEALTHY"
    SUSPECT = "SUSPECT"
    DEAD = "DEAD"
    RESTARTING = "RESTARTING"
    STALE = "STALE"
    RETIRED = "RETIRED"


class Signal(str, enum.Enum):
    PROBE_OK = "probe_ok"
    PROBE_FAILED = "probe_failed"
    REQUEST_FAILED = "request_failed"  # a client saw this engine fail a request
    UNAVAILABLE = "unavailable"  # Ray: actor unreachable, not (yet) confirmed dead
    PROGRESS_STALLED = "progress_stalled"  # no token for longer than the engine's recent gaps allow
    PROGRESS_RESUMED = "progress_resumed"  # a token came while the stall was being confirmed
    PROGRESS_HUNG = "progress_hung"  # still no token, and the immediate probe went unanswered
    LIVENESS_LOST = "liveness_lost"  # Ray: actor died, or its server process exited
    KILLED = "killed"  # Belayer itself killed it (hung, or fenced)
    RESTART_BEGUN = "restart_begun"
    STARTED = "started"
    WEIGHTS_CURRENT = "weights_current"
    VERSION_MISMATCH = "version_mismatch"
    RETIRE = "retire"
    RETRY = "retry"  # a retired slot's cool-down is over: try it again (applied by the manager, never observed)


@dataclass(frozen=True)
class Transition:
    t: float
    engine: str
    incarnation: int
    from_state: State
    to_state: State
    signal: Signal
    reason: str


@dataclass
class EngineHealth:
    """The health record of one engine slot across its incarnations."""

    engine: str
    failure_threshold: int
    state: State = State.RESTARTING  # a new slot is starting
    incarnation: int = 0
    failures: int = 0  # consecutive failed probes in this incarnation
    since: float = 0.0
    history: list[Transition] = field(default_factory=list)

    @property
    def serving(self) -> bool:
        """Whether requests may be routed here."""
        return self.state in (State.HEALTHY, State.SUSPECT)

    @property
    def running(self) -> bool:
        """Whether an incarnation is up to take calls: serving, or STALE (up, not yet routed)."""
        return self.state in (State.HEALTHY, State.SUSPECT, State.STALE)

    def apply(self, signal: Signal, now: float, incarnation: Optional[int] = None, reason: str = "") -> Optional[Transition]:
        """Feeds one observation; returns the transition it caused, or None when the state is unchanged."""
        if incarnation is not None and incarnation != self.incarnation:
            return None  # observed on another incarnation: stale news
        s = self.state
        new: Optional[State] = None
        if s is State.RETIRED:
            if signal is not Signal.RETRY:
                return None  # nothing observed revives a retired slot; only the manager's retry does
            self.incarnation += 1
            self.failures = 0
            new = State.RESTARTING
        if signal in (Signal.LIVENESS_LOST, Signal.KILLED):
            if s is not State.DEAD:
                new = State.DEAD
        elif signal in (Signal.PROBE_OK, Signal.PROGRESS_RESUMED):
            self.failures = 0
            if s is State.SUSPECT:
                new = State.HEALTHY
        elif signal is Signal.PROBE_FAILED:
            if s in (State.HEALTHY, State.SUSPECT):
                self.failures += 1
                new = State.DEAD if self.failures >= self.failure_threshold else State.SUSPECT
        elif signal is Signal.PROGRESS_HUNG:
            if s in (State.HEALTHY, State.SUSPECT):
                new = State.DEAD  # the stall and the failed probe together are the confirmation
        elif signal in (Signal.REQUEST_FAILED, Signal.UNAVAILABLE, Signal.PROGRESS_STALLED):
            if s is State.HEALTHY:
                new = State.SUSPECT  # confirmation comes from liveness or probes, not from one client
        elif signal is Signal.RESTART_BEGUN:
            if s is State.DEAD:
                self.incarnation += 1
                self.failures = 0
                new = State.RESTARTING
        elif signal is Signal.STARTED:
            if s is State.RESTARTING:
                new = State.STALE  # never serving before its weights are checked
        elif signal is Signal.WEIGHTS_CURRENT:
            if s is State.STALE:
                new = State.HEALTHY
        elif signal is Signal.VERSION_MISMATCH:
            if s in (State.HEALTHY, State.SUSPECT):
                new = State.STALE
        elif signal is Signal.RETIRE:
            if s is State.DEAD:
                new = State.RETIRED
        if new is None or new is s:
            return None
        tr = Transition(now, self.engine, self.incarnation, s, new, signal, reason)
        self.state, self.since = new, now
        self.history.append(tr)
        return tr
