"""The checkpoint policy's accounting beyond tests/test_sandbox_policy.py: its configuration and defaults, the
running estimates it decides with, what a failed checkpoint reports, and the background thread's priority
(no containers; bench/mutation.py runs these against mutants of sandbox/policy.py)."""

from __future__ import annotations

import os
import threading

import pytest

from belayer_plugin.sandbox.base import CheckpointError, CheckpointTimeout
from belayer_plugin.sandbox.config import SandboxPolicyConfig
from belayer_plugin.sandbox.policy import CheckpointPolicy, lower_thread_priority


class Clock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _nice_of_worker(p: CheckpointPolicy) -> tuple[str, int]:
    """The name and nice value of the policy's worker thread, read inside it."""
    out = {}

    def probe():
        out["name"] = threading.current_thread().name
        out["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    p._pool.submit(probe).result(timeout=10)
    return out["name"], out["nice"]


def test_a_policy_from_config_takes_every_setting_of_the_config():
    cfg = SandboxPolicyConfig(enabled=False, failure_prob=0.25, min_overhead_s=0.7, every_n_actions=3,
                              async_checkpoint=False, cooldown_s=9.0, overhead_ema=0.6, skip_unchanged=True,
                              checkpoint_nice=2)
    fn = lambda b: b  # noqa: E731
    p = CheckpointPolicy.from_config(cfg, fn, subject="traj-7")
    try:
        assert p.checkpoint_fn is fn and p.subject == "traj-7"
        assert (p.failure_prob, p.min_overhead_s, p.every_n_actions, p.async_checkpoint, p.cooldown_s, p.alpha,
                p.enabled) == (0.25, 0.7, 3, False, 9.0, 0.6, False)
        base = os.getpriority(os.PRIO_PROCESS, 0)
        assert _nice_of_worker(p)[1] == min(19, base + 2)
    finally:
        p.close()


def test_a_policy_starts_from_its_documented_defaults():
    p = CheckpointPolicy(lambda b: b, failure_prob=0.1)
    try:
        assert (p.min_overhead_s, p.every_n_actions, p.async_checkpoint, p.cooldown_s, p.alpha, p.enabled,
                p.est_checkpoint_s, p.subject) == (0.05, 0, True, 20.0, 0.3, True, 0.5, "policy")
        assert (p.est_generation_s, p.measured_visible_s, p.est_clean_generation_s, p.work_since_last_s,
                p.actions_since_last, p.cooldown_until, p.last_error) == (0.0, 0.0, 0.0, 0.0, 0, 0.0, None)
        inp = p.inputs(5)
        assert (inp.boundary, inp.every_n_actions, inp.in_flight, inp.cooldown_left_s) == (5, 0, False, 0.0)
        name, nice = _nice_of_worker(p)
        assert name.startswith("belayer-ckpt") and nice == os.getpriority(os.PRIO_PROCESS, 0)
        assert p._pool._max_workers == 1  # one checkpoint at a time, in order
    finally:
        p.close()


def test_work_accumulates_and_only_generations_train_the_generation_estimate():
    p = CheckpointPolicy(lambda b: b, failure_prob=0.1, overhead_ema=0.25, clock=Clock())
    p.note_work(2.0)
    assert p.est_generation_s == 2.0 and p.work_since_last_s == 2.0 and p.actions_since_last == 0
    p.note_work(6.0)
    assert p.est_generation_s == pytest.approx(0.75 * 2.0 + 0.25 * 6.0)
    p.note_work(1.0, kind="action", action_done=True)
    p.note_work(-3.0, kind="action", action_done=True)  # a negative duration adds no work
    assert p.est_generation_s == pytest.approx(3.0) and p.work_since_last_s == pytest.approx(9.0)
    assert p.actions_since_last == 2
    assert p.est_clean_generation_s == pytest.approx(0.75 * 2.0 + 0.25 * 6.0)  # no checkpoint overlapped them
    p.close()


def test_a_generation_touching_a_checkpoints_span_only_at_an_end_is_clean():
    clock = Clock(100.0)
    release = threading.Event()
    p = CheckpointPolicy(lambda b: release.wait(10) and "ck", failure_prob=1.0, min_overhead_s=0.0,
                         overhead_ema=0.5, clock=clock)
    clock.t = 102.0
    p.note_work(2.0, action_done=True)  # clean, 100 -> 102
    fut = p.maybe_checkpoint_async(1)  # in flight from 102
    p.note_work(0.0)  # ends at 102 exactly where the checkpoint started: clean, not overlapped
    assert p.est_clean_generation_s == pytest.approx(1.0) and p.measured_slowdown_s == 0.0
    clock.t = 103.0
    release.set()
    fut.result(timeout=10)  # the checkpoint ran 102 -> 103 by this clock
    p.wait_ready(timeout=10)
    clock.t = 106.0
    p.note_work(3.0)  # 103 -> 106: starts where the checkpoint ended, clean
    assert p.est_clean_generation_s == pytest.approx(2.0) and p.measured_slowdown_s == 0.0
    p.close()


def test_only_the_last_four_checkpoints_spans_are_kept():
    clock = Clock(0.0)
    p = CheckpointPolicy(lambda b: "ck", failure_prob=1.0, min_overhead_s=0.0, async_checkpoint=False,
                         clock=clock)
    for b in range(6):
        clock.t += 1.0
        p.note_work(1.0, kind="action", action_done=True)
        p.maybe_checkpoint_async(b)
    assert len(p._ck_spans) == 4 and p._ck_spans[0][0] == pytest.approx(3.0)
    p.close()


@pytest.mark.parametrize("exc, timed_out, word", [(CheckpointTimeout("slow"), True, "timed out"),
                                                  (CheckpointError("broken"), False, "failed"),
                                                  (OSError("disk"), False, "failed")])
def test_a_failed_checkpoint_is_counted_reported_and_cools_down(exc, timed_out, word):
    clock = Clock(50.0)
    events: list[dict] = []

    def ck(b):
        clock.t += 1.5  # the attempt took 1.5 s
        raise exc

    p = CheckpointPolicy(ck, failure_prob=1.0, min_overhead_s=0.0, async_checkpoint=False, cooldown_s=7.0,
                         clock=clock, on_event=events.append, subject="t1")
    for b in (4, 5):
        p.note_work(1.0, kind="action", action_done=True)
        clock.t += 10.0  # past any cool-down
        assert p.maybe_checkpoint_async(b).result() is None
    assert (p.stats.failed, p.stats.timed_out, p.stats.succeeded) == (2, 2 * int(timed_out), 0)
    assert p.last_error is exc and p.cooldown_until == pytest.approx(clock.t + 7.0)
    [first, second] = [e for e in events if e["kind"] == "checkpoint_cooldown"]
    assert first["reason"] == f"{word}: {exc}" and first["boundary"] == 4 and second["boundary"] == 5
    assert first["duration_s"] == pytest.approx(1.5) and first["cooldown_s"] == 7.0 and first["subject"] == "t1"
    assert p.stats.visible_wait_s == pytest.approx(3.0)  # synchronous: the agent waited for both attempts
    p.close()


def test_an_event_sink_that_raises_does_not_fail_the_checkpoint():
    def sink(rec):
        raise RuntimeError("sink down")

    p = CheckpointPolicy(lambda b: "ck", failure_prob=1.0, min_overhead_s=0.0, async_checkpoint=False,
                         on_event=sink)
    p.note_work(1.0, action_done=True)
    assert p.maybe_checkpoint_async(1).result() == "ck" and p.stats.succeeded == 1
    p.close()


class WaitClock(Clock):
    """A clock whose first read from the test's thread once armed (wait_ready's start) lets the checkpoint finish
    and moves time on by `step`: the wait is measured as exactly `step`, whatever the threads' timing."""

    def __init__(self, release: threading.Event, step: float):
        super().__init__()
        self.release, self.step, self.armed = release, step, False
        self.owner = threading.get_ident()

    def __call__(self) -> float:
        v = self.t
        if self.armed and threading.get_ident() == self.owner:
            self.armed = False
            self.t += self.step
            self.release.set()
        return v


def test_visible_waits_add_up_over_checkpoints():
    release = threading.Event()
    clock = WaitClock(release, 2.0)
    p = CheckpointPolicy(lambda b: release.wait(10) and "ck", failure_prob=1.0, min_overhead_s=0.0, clock=clock)
    for b in (1, 2):
        release.clear()
        p.note_work(1.0, kind="action", action_done=True)
        p.maybe_checkpoint_async(b)
        clock.armed = True
        assert p.wait_ready(timeout=10) == pytest.approx(2.0)
    assert p.stats.visible_wait_s == pytest.approx(4.0)
    p.close()


def _thread_nice(nice: int) -> tuple[int, int]:
    out = {}

    def run():
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        lower_thread_priority(nice)
        out["v"] = before, os.getpriority(os.PRIO_PROCESS, tid)

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    return out["v"]


@pytest.mark.parametrize("nice", [0, -3])
def test_no_positive_nice_leaves_the_thread_priority_alone(nice):
    before, after = _thread_nice(nice)
    assert after == before


def test_nice_one_lowers_the_thread_by_one_and_never_past_nineteen():
    before, after = _thread_nice(1)
    assert after == min(19, before + 1)
    before, after = _thread_nice(40)
    assert after == 19


async def test_the_async_wait_is_bounded_by_its_timeout():
    import asyncio
    import time

    release = threading.Event()
    p = CheckpointPolicy(lambda b: release.wait(10) and "ck", failure_prob=1.0, min_overhead_s=0.0)
    p.note_work(1.0, kind="action", action_done=True)
    fut = p.maybe_checkpoint_async(1)
    t0 = time.monotonic()
    waited = await p.wait_ready_async(timeout=0.05)
    assert time.monotonic() - t0 < 5.0 and waited < 5.0 and not fut.done()
    release.set()
    assert await asyncio.wrap_future(fut) == "ck"
    p.close()


def test_reset_after_a_rollback_forgets_the_work_and_actions_since_the_checkpoint():
    p = CheckpointPolicy(lambda b: "ck", failure_prob=1.0)
    p.note_work(3.0, kind="action", action_done=True)
    p.reset()
    assert p.work_since_last_s == 0.0 and p.actions_since_last == 0
    p.note_work(2.0, kind="action", action_done=True)
    assert p.work_since_last_s == 2.0 and p.actions_since_last == 1
    p.close()


def _inp(**kw):
    from belayer_plugin.sandbox.policy import PolicyInputs

    base = dict(boundary=3, failure_prob=0.1, work_since_last_s=10.0, actions_since_last=2, est_checkpoint_s=0.5,
                est_generation_s=0.0, async_checkpoint=False, min_overhead_s=0.05, every_n_actions=0,
                cooldown_left_s=0.0, in_flight=False)
    base.update(kw)
    return PolicyInputs(**base)


@pytest.mark.parametrize("kw, take, reason", [
    (dict(in_flight=True), False, "a checkpoint is already in flight"),
    (dict(cooldown_left_s=0.5), False, "cooling down for 0.5s after a failed checkpoint"),
    (dict(actions_since_last=0), False, "nothing new since the last checkpoint"),
    (dict(every_n_actions=2, enabled=False), True, "2 actions since the last checkpoint (every_n_actions)"),
    (dict(enabled=False), False, "adaptive policy disabled"),
    (dict(), True, "expected saving 1.000s > visible overhead 0.500s"),
    (dict(failure_prob=0.05), False, "expected saving 0.500s <= visible overhead 0.500s"),
])
def test_every_decision_carries_its_reason_figures_and_inputs(kw, take, reason):
    from belayer_plugin.sandbox.policy import decide

    inp = _inp(**kw)
    d = decide(inp)
    assert d.take is take and d.reason == reason and d.inputs is inp
    assert d.expected_saved_s == pytest.approx(inp.failure_prob * 10.0) and d.visible_overhead_s == pytest.approx(0.5)


def test_the_runner_counts_decisions_outcomes_and_durations():
    clock = Clock(0.0)
    events: list[dict] = []
    results = iter(["ck-a", None, type("Ck", (), {"boundary": 1})(), "ck-d"])

    def ck(b):
        clock.t += 0.25
        return next(results)

    p = CheckpointPolicy(ck, failure_prob=1.0, min_overhead_s=0.0, async_checkpoint=False, clock=clock,
                         on_event=events.append, overhead_ema=0.5, initial_checkpoint_s=0.5)
    assert p.maybe_checkpoint_async(1) is None  # nothing new: decided, not taken
    for b in (1, 2, 3, 4):
        p.note_work(1.0, kind="action", action_done=True)
        p.maybe_checkpoint_async(b)
    s = p.stats
    assert (s.decisions, s.taken, s.succeeded, s.superseded, s.unchanged) == (5, 4, 3, 1, 1)
    assert s.durations == [0.25, 0.25, 0.25] and s.checkpoint_s == pytest.approx(0.75)
    # the estimate learns from new checkpoints only (b=1 and b=4), not from the reused one (b=3)
    assert p.est_checkpoint_s == pytest.approx(0.5 * (0.5 * 0.5 + 0.5 * 0.25) + 0.5 * 0.25)
    decisions = [e for e in events if e["kind"] == "policy_decision"]
    assert [e["boundary"] for e in decisions] == [1, 1, 2, 3, 4]
    assert decisions[1]["take"] is True and decisions[1]["expected_saved_s"] == pytest.approx(1.0)
    assert decisions[1]["visible_overhead_s"] == pytest.approx(0.5) and decisions[1]["inputs"]["boundary"] == 1


def test_a_sandbox_death_during_a_checkpoint_is_reported_as_skipped():
    from belayer_plugin.sandbox.base import SandboxDead

    events: list[dict] = []

    def ck(b):
        raise SandboxDead("container gone")

    p = CheckpointPolicy(ck, failure_prob=1.0, min_overhead_s=0.0, async_checkpoint=False, on_event=events.append)
    for b in (6, 7):
        p.note_work(1.0, kind="action", action_done=True)
        p.maybe_checkpoint_async(b)
    assert p.stats.failed == 2 and p.stats.timed_out == 0
    skipped = [e for e in events if e["kind"] == "checkpoint_skipped"]
    assert [(e["reason"], e["boundary"]) for e in skipped] == [("sandbox died: container gone", 6),
                                                               ("sandbox died: container gone", 7)]
    p.close()
