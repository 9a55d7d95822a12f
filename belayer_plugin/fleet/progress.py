"""Token progress per engine: a hang shows up as silence longer than the engine's own recent gaps allow.

Pure: no I/O, no tasks, no clock (every call takes `now`, monotonic seconds). The monitor feeds it what the
token-level client already sees (a request started on an engine, tokens streamed back, the request ended)
and asks it which engines have gone silent; the monitor then probes those at once and the health machine
(fleet/health.py) decides.

An engine incarnation is *armed* only while all of these hold: the tracker is not suspended (pause, memory
release, refit), the incarnation is warm (it has streamed `min_gaps` inter-token gaps since it was watched
or the fleet last resumed: start-up, compile and warm-up never count), and it has requests in flight.
Armed, its silence deadline is

    last activity + max(floor_s, gap_multiplier x p95(recent gaps)) x 2^(probes it answered in this silence)
                  + prefill_s_per_1k_tokens x (prompt tokens of its requests that have no first token yet) / 1000

where activity is a token, a request ending, the engine turning busy, or a re-baseline. A gap is measured
per request, between its consecutive reads, divided by the stream chunks the read brought (a coalesced read
of 5 chunks 100 ms after the last is 5 gaps of 20 ms): never across idle time, a pause, or a request's
prefill from its start. So an engine that slows down gradually under load raises its own threshold, and a
long prompt extends it for as long as its first token has not come.

Why per request: a batched engine sends one token per running request at each step, so the gaps between
any two tokens of the engine are mostly the near-zero spread of one step's tokens. With 30 requests in a
1 s step, 29 of every 30 engine-wide gaps are ~0 and the p95 misses the step entirely: the threshold fell
to the floor and a saturated engine was suspected at every step. A request's own gaps are the step time.

Owns: per-incarnation token gaps and silence deadlines. Must not: do I/O, read clocks or probe (the monitor
does).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from belayer_plugin.config import ProgressConfig


@dataclass(frozen=True)
class Stall:
    """One engine incarnation silent past its deadline."""

    engine: str
    incarnation: int
    silent_s: float
    threshold_s: float
    inflight: int
    waiting_first_token: int

    @property
    def reason(self) -> str:
        return (f"progress: no token for {self.silent_s:.2f} s with {self.inflight} request(s) in flight "
                f"(threshold {self.threshold_s:.2f} s from its recent inter-token gaps, floor and prefill "
                f"allowance; {self.waiting_first_token} awaiting a first token)")


@dataclass
class _Engine:
    incarnation: int
    gaps: deque = field(default_factory=deque)  # recent per-chunk gaps of its requests
    warm_gaps: int = 0  # gaps seen since watched or since the fleet last resumed
    inflight: dict[str, int] = field(default_factory=dict)  # rid -> its prompt tokens while awaiting a first token, else 0
    last_read: dict[str, float] = field(default_factory=dict)  # rid -> its last read since started / rebaselined
    last_served: Optional[float] = None  # the last token seen from this incarnation, ever
    last_activity: float = 0.0
    answered: int = 0  # probes answered (engine alive) during the current silence: each doubles the threshold
    reported: bool = False  # the current silence was reported (once per silence)


class ProgressTracker:
    """Per-engine token progress and silence deadlines (see the module docstring)."""

    def __init__(self, cfg: ProgressConfig):
        self.cfg = cfg
        self._engines: dict[str, _Engine] = {}
        self.suspended = False

    # ------------------------------------------------------------ incarnations and phases
    def watch(self, engine: str, incarnation: int) -> None:
        """A new incarnation of `engine`: no gaps, not warm, nothing in flight."""
        self._engines[engine] = _Engine(incarnation, deque(maxlen=self.cfg.gap_window))

    def forget(self, engine: str) -> None:
        self._engines.pop(engine, None)

    def suspend(self) -> None:
        """Pause, memory release or refit: no engine is armed until `resume`."""
        self.suspended = True

    def resume(self, now: float) -> None:
        """Back to serving: every silence counts from now, and each engine must warm up again."""
        self.suspended = False
        for e in self._engines.values():
            e.warm_gaps, e.last_activity, e.answered, e.reported = 0, now, 0, False
            e.last_read.clear()

    def answered(self, engine: str, incarnation: int, now: float) -> None:
        """A probe found the silent engine alive: its silence counts again from now, with a doubled threshold."""
        e = self._get(engine, incarnation)
        if e is not None:
            e.answered += 1
            e.last_activity, e.reported = now, False

    def excuse(self, seconds: float) -> None:
        """The observer itself was stalled this long: that much of every current silence is not the engines'."""
        for e in self._engines.values():
            e.last_activity += seconds

    # ------------------------------------------------------------ observations
    def started(self, engine: str, incarnation: int, rid: str, prompt_tokens: int, now: float) -> None:
        """A request (or a resumed segment, `prompt_tokens` = prompt + committed ids) began on the engine."""
        e = self._get(engine, incarnation)
        if e is None:
            return
        if not e.inflight:  # idle -> busy: silence counts from here
            e.last_activity, e.answered, e.reported = now, 0, False
        e.inflight[rid] = max(0, int(prompt_tokens))
        e.last_read.pop(rid, None)  # no gap spans its prefill

    def tokens(self, engine: str, incarnation: int, rid: str, now: float, chunks: int = 1) -> None:
        """New tokens of `rid` streamed back from the engine: one read of `chunks` stream chunks."""
        e = self._get(engine, incarnation)
        if e is None:
            return
        chunks = max(1, int(chunks))
        last = e.last_read.get(rid)
        if not self.suspended:
            if last is not None:
                e.gaps.append(max(0.0, now - last) / chunks)
                e.warm_gaps += chunks
            else:
                e.warm_gaps += chunks - 1  # the first chunk's wait is its prefill, not a gap
        e.last_read[rid] = e.last_activity = e.last_served = now
        e.answered, e.reported = 0, False
        if rid in e.inflight:
            e.inflight[rid] = 0  # its prefill is done

    def ended(self, engine: str, incarnation: int, rid: str, now: float) -> None:
        """The request left the engine (finished, failed or moved)."""
        e = self._get(engine, incarnation)
        if e is None or e.inflight.pop(rid, None) is None:
            return
        e.last_read.pop(rid, None)
        e.last_activity, e.reported = now, False

    # ------------------------------------------------------------ verdicts
    def threshold(self, engine: str) -> Optional[float]:
        """The silence the engine is allowed right now (None: not armed)."""
        e = self._engines.get(engine)
        if e is None or not self._armed(e):
            return None
        base = max(self.cfg.floor_s, self.cfg.gap_multiplier * _p95(e.gaps))
        prefill = self.cfg.prefill_s_per_1k_tokens * sum(e.inflight.values()) / 1000.0
        return base * (2 ** min(e.answered, 16)) + prefill

    def deadline(self, engine: str) -> Optional[float]:
        """When the engine's current silence becomes a stall (None: not armed, or already reported)."""
        e = self._engines.get(engine)
        th = self.threshold(engine)
        if e is None or th is None or e.reported:
            return None
        return e.last_activity + th

    def next_deadline(self) -> Optional[float]:
        """The earliest deadline over all engines (None: nothing to watch)."""
        ds = [d for d in (self.deadline(k) for k in self._engines) if d is not None]
        return min(ds) if ds else None

    def stalled(self, now: float) -> list[Stall]:
        """Engines silent past their deadline, each reported once per silence."""
        out = []
        for name, e in self._engines.items():
            d = self.deadline(name)
            if d is None or now < d:
                continue
            e.reported = True
            out.append(Stall(name, e.incarnation, now - e.last_activity, d - e.last_activity, len(e.inflight),
                             sum(1 for v in e.inflight.values() if v > 0)))
        return out

    def served_within(self, engine: str, incarnation: int, window_s: float, now: float) -> bool:
        """Whether the incarnation streamed a token in the last `window_s` and is not silent past its deadline
        (a reported or overdue silence needs a real probe, whatever it served before)."""
        e = self._get(engine, incarnation)
        if e is None or self.suspended or e.reported or e.last_served is None or now - e.last_served > window_s:
            return False
        d = self.deadline(engine)
        return d is None or now < d

    def fault(self, engine: str, incarnation: int) -> None:
        """A fault was reported for the incarnation (a request failed, a probe failed ...): tokens it streamed
        before that no longer vouch for its readiness; only a token after it, or a real probe, does."""
        e = self._get(engine, incarnation)
        if e is not None:
            e.last_served = None

    def silent_since(self, engine: str, incarnation: int) -> Optional[float]:
        """The time of the engine's last activity (None: unknown engine or incarnation)."""
        e = self._get(engine, incarnation)
        return None if e is None else e.last_activity

    def _armed(self, e: _Engine) -> bool:
        return not self.suspended and bool(e.inflight) and e.warm_gaps >= self.cfg.min_gaps

    def _get(self, engine: str, incarnation: int) -> Optional[_Engine]:
        e = self._engines.get(engine)
        return e if e is not None and e.incarnation == incarnation else None


def _p95(xs: deque) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, math.ceil(0.95 * len(s)) - 1)]
