"""Structured events: every transition and action is one record; reports and metrics read only these.

Owns: the event record, the event log (events.jsonl) and its subscribers. Must not: import any other Belayer
module or decide anything.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional


@dataclass
class Event:
    t: float  # wall-clock seconds
    component: str  # monitor, fleet, restart, shadow, recovery, sandbox, chaos, loop
    subject: str  # engine, request or trajectory id
    kind: str  # transition, deregistered, restarted, handover, resumed, ...
    reason: str = ""
    from_state: Optional[str] = None
    to_state: Optional[str] = None
    level: str = "info"  # info | warning | error
    figures: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        # by hand: dataclasses.asdict deep-copies the figures, the larger part of an emit's cost
        return {"t": self.t, "component": self.component, "subject": self.subject, "kind": self.kind,
                "reason": self.reason, "from_state": self.from_state, "to_state": self.to_state,
                "level": self.level, "figures": dict(self.figures)}


class EventLog:
    """Collects events, appends them to a JSONL file, and lets callers await one (tests, the report)."""

    def __init__(self, path: Optional[Path] = None):
        self.events: list[Event] = []
        self.path = Path(path) if path else None
        self._subscribers: list[Callable[[Event], None]] = []
        self._lock = threading.Lock()
        self._waiters: list[tuple[Callable[[Event], bool], asyncio.Future, asyncio.AbstractEventLoop]] = []

    def emit(self, component: str, subject: str, kind: str, reason: str = "", from_state: Optional[str] = None,
             to_state: Optional[str] = None, level: str = "info", **figures: Any) -> Event:
        """Records one event and notifies subscribers and waiters; safe from any thread."""
        ev = Event(time.time(), component, subject, kind, reason, from_state, to_state, level, figures)
        with self._lock:
            self.events.append(ev)
            waiters = list(self._waiters)
            subs = list(self._subscribers)
            if self.path is not None:
                with open(self.path, "a") as f:
                    f.write(json.dumps(ev.to_dict(), default=str) + "\n")
        for cb in subs:
            cb(ev)
        for pred, fut, loop in waiters:
            if pred(ev):
                loop.call_soon_threadsafe(lambda f=fut, e=ev: f.done() or f.set_result(e))
        return ev

    def subscribe(self, cb: Callable[[Event], None]) -> None:
        self._subscribers.append(cb)

    def callback(self, component: str) -> Callable[[dict], None]:
        """Adapts plain-dict records ({subject, kind, reason, ...}) from other modules into events."""

        def on_event(rec: dict) -> None:
            rec = dict(rec)
            rec.pop("t", None)
            rec.pop("component", None)
            self.emit(component, str(rec.pop("subject", "")), str(rec.pop("kind", "event")),
                      str(rec.pop("reason", "")), **rec)

        return on_event

    def find(self, pred: Callable[[Event], bool]) -> list[Event]:
        with self._lock:
            return [e for e in self.events if pred(e)]

    async def wait_for(self, pred: Callable[[Event], bool], timeout: float, since: float = 0.0) -> Event:
        """Returns the first event (at or after `since`) matching `pred`, waiting at most `timeout` seconds."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        entry = (lambda e: e.t >= since and pred(e), fut, loop)
        with self._lock:
            for e in self.events:
                if e.t >= since and pred(e):
                    return e
            self._waiters.append(entry)
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            with self._lock:
                self._waiters.remove(entry)
