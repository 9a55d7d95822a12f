"""Adaptive checkpoint policy: checkpoint when the expected regeneration time saved exceeds the visible cost.

expected_saved_s = failure_prob x work_since_last_s (LLM generation + action time a failure would redo);
visible_overhead_s = max(min_overhead_s, est_checkpoint_s - est_generation_s) when the checkpoint overlaps
the next LLM generation (async), else est_checkpoint_s; and never less than what checkpoints were measured
to cost: the agent's waits for them, and how much longer the generations they overlapped took than those
without one (a hidden checkpoint is not free where it shares the CPU with the engine that generates).
`decide` is pure; `CheckpointPolicy` runs the checkpoints on one worker thread, measures what the agent
actually waited for, and cools down after a checkpoint timed out or failed.

Owns: when to checkpoint, from measured costs. Must not: take checkpoints itself.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

from belayer_plugin.sandbox.base import CheckpointError, CheckpointTimeout, EventSink, SandboxDead

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PolicyInputs:
    """Everything one decision looks at (logged with the decision)."""

    boundary: int
    failure_prob: float
    work_since_last_s: float
    actions_since_last: int
    est_checkpoint_s: float
    est_generation_s: float
    async_checkpoint: bool
    min_overhead_s: float
    every_n_actions: int
    cooldown_left_s: float
    in_flight: bool
    enabled: bool = True
    measured_visible_s: float = 0.0  # running estimate of what each checkpoint actually made the agent wait
    measured_slowdown_s: float = 0.0  # running estimate of how much a checkpoint lengthens the generation it overlaps


@dataclass(frozen=True)
class Decision:
    take: bool
    reason: str
    expected_saved_s: float
    visible_overhead_s: float
    inputs: PolicyInputs


def visible_overhead(inp: PolicyInputs) -> float:
    """What the agent is expected to wait for if it checkpoints now."""
    hidden = inp.est_generation_s if inp.async_checkpoint else 0.0
    # The prediction can be optimistic (checkpoint times vary); what the agent really waited counts too, and so
    # does the generation time a "hidden" checkpoint took from the engine (CPU engines, shared cores).
    return max(inp.min_overhead_s, inp.est_checkpoint_s - hidden, inp.measured_visible_s, inp.measured_slowdown_s)


def decide(inp: PolicyInputs) -> Decision:
    """The policy as a pure function of its inputs."""
    saved = inp.failure_prob * inp.work_since_last_s
    vis = visible_overhead(inp)
    if inp.in_flight:
        return Decision(False, "a checkpoint is already in flight", saved, vis, inp)
    if inp.cooldown_left_s > 0:
        return Decision(False, f"cooling down for {inp.cooldown_left_s:.1f}s after a failed checkpoint", saved, vis, inp)
    if inp.actions_since_last <= 0:
        return Decision(False, "nothing new since the last checkpoint", saved, vis, inp)
    if inp.every_n_actions and inp.actions_since_last >= inp.every_n_actions:
        return Decision(True, f"{inp.actions_since_last} actions since the last checkpoint (every_n_actions)", saved, vis, inp)
    if not inp.enabled:
        return Decision(False, "adaptive policy disabled", saved, vis, inp)
    if saved > vis:
        return Decision(True, f"expected saving {saved:.3f}s > visible overhead {vis:.3f}s", saved, vis, inp)
    return Decision(False, f"expected saving {saved:.3f}s <= visible overhead {vis:.3f}s", saved, vis, inp)


@dataclass
class PolicyStats:
    decisions: int = 0
    taken: int = 0
    succeeded: int = 0
    failed: int = 0
    timed_out: int = 0
    superseded: int = 0
    unchanged: int = 0  # of `succeeded`: boundaries that reused the last checkpoint (no side effect since)
    checkpoint_s: float = 0.0  # total time checkpoints ran
    visible_wait_s: float = 0.0  # total time the agent waited for them
    durations: list[float] = field(default_factory=list)


def lower_thread_priority(nice: int) -> None:
    """Raises the calling thread's nice value by `nice` (Linux: nice is per thread, and the processes the thread
    starts inherit it), so background checkpoints (tar, the Podman CLI, runc and CRIU under it) yield the CPU
    to generation. Docker's CRIU runs under containerd and keeps containerd's priority."""
    if nice <= 0:
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as e:  # not fatal: the checkpoint runs at the normal priority
        log.warning("could not lower the checkpoint thread's priority: %s", e)


class CheckpointPolicy:
    """Decides and runs checkpoints, overlapping them with the next LLM generation.

    `checkpoint_fn(boundary)` takes the checkpoint (normally TrajectoryRecorder.checkpoint). Call
    `note_work` with every generation/action duration, `maybe_checkpoint_async` after each committed
    action, and `wait_ready` before the next action touches the sandbox.
    """

    def __init__(self, checkpoint_fn: Callable[[int], Any], *, failure_prob: float, min_overhead_s: float = 0.05,
                 every_n_actions: int = 0, async_checkpoint: bool = True, cooldown_s: float = 20.0,
                 overhead_ema: float = 0.3, enabled: bool = True, initial_checkpoint_s: float = 0.5,
                 subject: str = "policy", on_event: Optional[EventSink] = None,
                 clock: Callable[[], float] = time.monotonic, nice: int = 0):
        self.checkpoint_fn = checkpoint_fn
        self.failure_prob = failure_prob
        self.min_overhead_s = min_overhead_s
        self.every_n_actions = every_n_actions
        self.async_checkpoint = async_checkpoint
        self.cooldown_s = cooldown_s
        self.alpha = overhead_ema
        self.enabled = enabled
        self.subject = subject
        self.on_event = on_event
        self.clock = clock
        self.est_checkpoint_s = initial_checkpoint_s
        self.est_generation_s = 0.0
        self.measured_visible_s = 0.0
        self.est_clean_generation_s = 0.0  # generations that no checkpoint overlapped (0: none seen yet)
        self._slowdown_ema = 0.0  # signed: noise around a zero slowdown averages out instead of piling up
        self._ck_spans: collections.deque = collections.deque(maxlen=4)  # [start, end or None] of recent runs
        self._waited_for_current = False
        self.work_since_last_s = 0.0
        self.actions_since_last = 0
        self.cooldown_until = 0.0
        self.stats = PolicyStats()
        self.last_error: Optional[BaseException] = None
        self._lock = threading.Lock()
        self._future: Optional[concurrent.futures.Future] = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="belayer-ckpt",
                                                           initializer=lower_thread_priority, initargs=(nice,))

    @classmethod
    def from_config(cls, cfg: Any, checkpoint_fn: Callable[[int], Any], **kw: Any) -> "CheckpointPolicy":
        """From a SandboxPolicyConfig."""
        return cls(checkpoint_fn, failure_prob=cfg.failure_prob, min_overhead_s=cfg.min_overhead_s,
                   every_n_actions=cfg.every_n_actions, async_checkpoint=cfg.async_checkpoint,
                   cooldown_s=cfg.cooldown_s, overhead_ema=cfg.overhead_ema, enabled=cfg.enabled,
                   nice=cfg.checkpoint_nice, **kw)

    def _emit(self, kind: str, reason: str, **figures: Any) -> None:
        rec = {"t": time.time(), "component": "sandbox", "subject": self.subject, "kind": kind, "reason": reason,
               **figures}
        log.info("policy %s %s: %s %s", self.subject, kind, reason, figures)
        if self.on_event is not None:
            try:
                self.on_event(rec)
            except Exception:
                log.exception("on_event callback failed")

    def note_work(self, seconds: float, kind: str = "generation", action_done: bool = False) -> None:
        """Accounts work a failure would make the agent redo; generations also train the overlap estimate."""
        with self._lock:
            self.work_since_last_s += max(0.0, seconds)
            if action_done:
                self.actions_since_last += 1
            if kind == "generation":
                self.est_generation_s = (seconds if self.est_generation_s == 0.0
                                         else (1 - self.alpha) * self.est_generation_s + self.alpha * seconds)
                self._note_generation(seconds)

    def _note_generation(self, seconds: float) -> None:
        """Splits generations into those a checkpoint overlapped and those it did not; their difference is what
        a checkpoint costs the generation beside it. Called with the lock held."""
        end = self.clock()
        start = end - seconds
        overlapped = any(a < end and (b is None or b > start) for a, b in self._ck_spans)
        if not overlapped:
            self.est_clean_generation_s = (seconds if self.est_clean_generation_s == 0.0 else
                                           (1 - self.alpha) * self.est_clean_generation_s + self.alpha * seconds)
        elif self.est_clean_generation_s > 0.0:
            self._slowdown_ema = (1 - self.alpha) * self._slowdown_ema + self.alpha * (
                seconds - self.est_clean_generation_s)

    @property
    def measured_slowdown_s(self) -> float:
        """How much longer a generation takes while a checkpoint runs beside it (running estimate, >= 0)."""
        return max(0.0, self._slowdown_ema)

    def inputs(self, boundary: int) -> PolicyInputs:
        with self._lock:
            return PolicyInputs(boundary=boundary, failure_prob=self.failure_prob,
                                work_since_last_s=self.work_since_last_s, actions_since_last=self.actions_since_last,
                                est_checkpoint_s=self.est_checkpoint_s, est_generation_s=self.est_generation_s,
                                async_checkpoint=self.async_checkpoint, min_overhead_s=self.min_overhead_s,
                                every_n_actions=self.every_n_actions,
                                cooldown_left_s=max(0.0, self.cooldown_until - self.clock()),
                                in_flight=self._future is not None and not self._future.done(), enabled=self.enabled,
                                measured_visible_s=self.measured_visible_s,
                                measured_slowdown_s=self.measured_slowdown_s)

    def maybe_checkpoint_async(self, boundary: int) -> Optional[concurrent.futures.Future]:
        """Decides; if yes, starts the checkpoint (in the background when async) and returns its future.

        The future resolves to the Checkpoint, or to None when the checkpoint failed (see last_error).
        `await asyncio.wrap_future(f)` awaits it from asyncio code.
        """
        d = decide(self.inputs(boundary))
        self.stats.decisions += 1
        self._emit("policy_decision", d.reason, boundary=boundary, take=d.take, expected_saved_s=d.expected_saved_s,
                   visible_overhead_s=d.visible_overhead_s, inputs=asdict(d.inputs))
        if not d.take:
            return None
        self.stats.taken += 1
        with self._lock:
            covered = (self.work_since_last_s, self.actions_since_last)
            span = [self.clock(), None]  # in flight from now on (the worker thread may start a moment later)
            self._ck_spans.append(span)
        if self.async_checkpoint:
            fut = self._pool.submit(self._run, boundary, covered, span)
        else:
            fut = concurrent.futures.Future()
            t0 = self.clock()
            fut.set_result(self._run(boundary, covered, span))
            self.stats.visible_wait_s += self.clock() - t0
        with self._lock:
            self._future = fut
            self._waited_for_current = not self.async_checkpoint
        return fut

    def _run(self, boundary: int, covered: tuple[float, int], span: list) -> Any:
        try:
            return self._run_checkpoint(boundary, covered, self.clock())
        finally:
            span[1] = self.clock()

    def _run_checkpoint(self, boundary: int, covered: tuple[float, int], t0: float) -> Any:
        try:
            ck = self.checkpoint_fn(boundary)
        except CheckpointTimeout as e:
            return self._failed(e, boundary, t0, timed_out=True)
        except SandboxDead as e:  # an environment failure: recovery's business, not a reason to cool down
            self.last_error = e
            self.stats.failed += 1
            self._emit("checkpoint_skipped", f"sandbox died: {e}", boundary=boundary)
            return None
        except (CheckpointError, Exception) as e:
            return self._failed(e, boundary, t0, timed_out=False)
        dt = self.clock() - t0
        if ck is None:  # superseded: the trajectory moved on or rolled back before it could start
            self.stats.superseded += 1
            return None
        with self._lock:
            # A boundary with no side effect since the last checkpoint reuses it (TrajectoryRecorder's
            # skip_unchanged): it protects the work all the same, but says nothing of what a checkpoint costs.
            if getattr(ck, "boundary", boundary) == boundary:
                self.est_checkpoint_s = (1 - self.alpha) * self.est_checkpoint_s + self.alpha * dt
            else:
                self.stats.unchanged += 1
            self.work_since_last_s = max(0.0, self.work_since_last_s - covered[0])
            self.actions_since_last = max(0, self.actions_since_last - covered[1])
        self.stats.succeeded += 1
        self.stats.checkpoint_s += dt
        self.stats.durations.append(dt)
        return ck

    def _failed(self, e: BaseException, boundary: int, t0: float, timed_out: bool) -> None:
        self.last_error = e
        self.stats.failed += 1
        self.stats.timed_out += int(timed_out)
        with self._lock:
            self.cooldown_until = self.clock() + self.cooldown_s
        self._emit("checkpoint_cooldown", f"{'timed out' if timed_out else 'failed'}: {e}", boundary=boundary,
                   duration_s=self.clock() - t0, cooldown_s=self.cooldown_s)
        return None

    def wait_ready(self, timeout: Optional[float] = None) -> float:
        """Blocks until no checkpoint is in flight (bounded by `timeout`); returns the visible wait in seconds."""
        with self._lock:
            fut = self._future
        if fut is None:
            return 0.0
        waited = 0.0
        if not fut.done():
            t0 = self.clock()
            try:
                fut.result(timeout=timeout)
            except concurrent.futures.TimeoutError:
                pass
            waited = self.clock() - t0
            self.stats.visible_wait_s += waited
        with self._lock:
            # The first wait after each checkpoint is what it cost the agent (zero when fully hidden).
            if fut is self._future and not self._waited_for_current and fut.done():
                self._waited_for_current = True
                self.measured_visible_s = (1 - self.alpha) * self.measured_visible_s + self.alpha * waited
        return waited

    async def wait_ready_async(self, timeout: Optional[float] = None) -> float:
        """`wait_ready` for asyncio code (does not block the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(None, self.wait_ready, timeout)

    def reset(self) -> None:
        """After a rollback: the work since the restored checkpoint is gone with it."""
        with self._lock:
            self.work_since_last_s = 0.0
            self.actions_since_last = 0

    def close(self) -> None:
        self.wait_ready(timeout=None)
        self._pool.shutdown(wait=True)
