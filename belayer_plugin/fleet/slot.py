"""The fleet's vocabulary: a slot (one engine position and its current incarnation), the fleet's phase and
weight version, and the errors the fleet raises.

Owns: these data types only. Must not: act on engines, hold the fleet's state, or import any other fleet
module (every fleet module may import this one).
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Any, Optional

from belayer_plugin.engines.actor import EngineInfo
from belayer_plugin.fleet.health import EngineHealth


class Phase(str, enum.Enum):
    SERVING = "serving"
    PAUSED = "paused"
    RELEASED = "released"  # paused with engine memory released (weights/KV cache offloaded)
    REFIT = "refit"


class WeightVersionError(RuntimeError):
    """An engine reports a weight version other than the fleet's current one after a refit."""


class NoHealthyEngineError(RuntimeError):
    """No engine can take a request right now (all are dead, restarting or stale)."""


class DrainError(RuntimeError):
    """A planned drain, upgrade or scale change was refused or could not finish; the engine keeps serving."""


@dataclass
class Slot:
    """One engine position in the fleet; its incarnations come and go."""

    slot_id: str
    health: EngineHealth
    actor: Any = None
    info: Optional[EngineInfo] = None
    registered: bool = False
    recovery: Optional[asyncio.Task] = None
    fault_t: Optional[float] = None  # when the current fault was first observed (for detection figures)
    served_version: str = ""
    handover_t: Optional[float] = None  # when a shadow last took this slot over (monotonic)
    rids: set[str] = field(default_factory=set)  # requests in flight on the current incarnation
    draining: bool = False  # planned drain under way: not routable, and its signals are no faults
    # Made current while a probe blip held it SUSPECT: registered at its next HEALTHY (nobody else would).
    register_when_healthy: bool = False
    # Requests a drain cut here: their cut is a move even when seen after a failed drain re-admitted the engine.
    drain_cut: set[str] = field(default_factory=set)
    # Memory tags this incarnation has released and not resumed. SGLang's scheduler dies (KeyError) when asked
    # to resume a tag it does not hold released, e.g. "weights" again after a refit already resumed them.
    released: set[str] = field(default_factory=set)
    _inflight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while no request is in flight here

    def __post_init__(self) -> None:
        self.idle.set()

    @property
    def inflight(self) -> int:
        """Requests a Belayer selector has in flight on this slot (a drain waits for 0)."""
        return self._inflight

    @inflight.setter
    def inflight(self, n: int) -> None:
        self._inflight = n
        if n <= 0:
            self.idle.set()
        else:
            self.idle.clear()


@dataclass
class Weights:
    version: str = "default"
    path: Optional[str] = None  # None: the base model every engine starts from
    external: bool = False  # streamed into the engines by the trainer (NeMo-RL's refit): Belayer cannot load them


def slot_index(slot_id: str) -> int:
    """engine-3 -> 3 (ordering of slots; unknown shapes sort first)."""
    try:
        return int(slot_id.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return -1
