"""The adaptive checkpoint policy as pure logic, and its asynchronous runner (no containers)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from belayer_plugin.sandbox.base import CheckpointError, CheckpointTimeout, SandboxDead
from belayer_plugin.sandbox.policy import CheckpointPolicy, PolicyInputs, decide, visible_overhead


def inputs(**kw) -> PolicyInputs:
    base = dict(boundary=3, failure_prob=0.1, work_since_last_s=10.0, actions_since_last=2, est_checkpoint_s=0.5,
                est_generation_s=0.0, async_checkpoint=False, min_overhead_s=0.05, every_n_actions=0,
                cooldown_left_s=0.0, in_flight=False)
    base.update(kw)
    return PolicyInputs(**base)


def test_checkpoints_when_expected_saving_exceeds_visible_overhead():
    d = decide(inputs(failure_prob=0.1, work_since_last_s=10.0, est_checkpoint_s=0.5))
    assert d.take and d.expected_saved_s == pytest.approx(1.0) and d.visible_overhead_s == pytest.approx(0.5)


def test_skips_when_expected_saving_is_below_visible_overhead():
    d = decide(inputs(failure_prob=0.01, work_since_last_s=10.0, est_checkpoint_s=0.5))
    assert not d.take and "<=" in d.reason


def test_overlap_with_generation_hides_checkpoint_cost_down_to_the_floor():
    sync = inputs(failure_prob=0.02, work_since_last_s=10.0, est_checkpoint_s=0.5, est_generation_s=2.0)
    assert not decide(sync).take  # 0.2 s saved < 0.5 s visible when synchronous
    hidden = inputs(failure_prob=0.02, work_since_last_s=10.0, est_checkpoint_s=0.5, est_generation_s=2.0,
                    async_checkpoint=True)
    assert visible_overhead(hidden) == pytest.approx(0.05)
    assert decide(hidden).take


def test_partially_hidden_checkpoint_counts_only_the_uncovered_part():
    assert visible_overhead(inputs(async_checkpoint=True, est_checkpoint_s=1.5, est_generation_s=1.0)) == pytest.approx(0.5)


def test_never_overlaps_two_checkpoints_or_checkpoints_during_cooldown():
    assert not decide(inputs(failure_prob=1.0, in_flight=True)).take
    d = decide(inputs(failure_prob=1.0, cooldown_left_s=5.0))
    assert not d.take and "cooling down" in d.reason


def test_every_n_actions_forces_a_checkpoint_even_when_disabled():
    assert decide(inputs(failure_prob=0.0, every_n_actions=2, actions_since_last=2, enabled=False)).take
    assert not decide(inputs(failure_prob=0.0, every_n_actions=3, actions_since_last=2, enabled=False)).take


def test_nothing_new_means_no_checkpoint():
    assert not decide(inputs(failure_prob=1.0, actions_since_last=0)).take


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_timed_out_checkpoint_starts_cooldown_and_logs_every_decision_with_inputs():
    clock = FakeClock()
    events: list[dict] = []

    def ck(b):
        raise CheckpointTimeout("took too long")

    p = CheckpointPolicy(ck, failure_prob=1.0, min_overhead_s=0.0, async_checkpoint=False, cooldown_s=20.0,
                         clock=clock, on_event=events.append, subject="traj-x")
    p.note_work(5.0, action_done=True)
    assert p.maybe_checkpoint_async(1).result() is None
    assert p.stats.timed_out == 1
    cool = [e for e in events if e["kind"] == "checkpoint_cooldown"]
    assert cool and cool[0]["cooldown_s"] == 20.0 and cool[0]["subject"] == "traj-x"
    clock.t += 10.0
    p.note_work(5.0, action_done=True)
    assert p.maybe_checkpoint_async(2) is None  # still cooling down
    clock.t += 10.5
    calls = []
    p.checkpoint_fn = lambda b: calls.append(b) or "ck"
    assert p.maybe_checkpoint_async(3).result() == "ck" and calls == [3]
    decisions = [e for e in events if e["kind"] == "policy_decision"]
    assert len(decisions) == 3
    for e in decisions:
        assert {"t", "component", "subject", "kind", "reason"} <= set(e)
        assert e["component"] == "sandbox"
        assert {"failure_prob", "work_since_last_s", "est_checkpoint_s", "cooldown_left_s"} <= set(e["inputs"])
    assert "cooling down" in decisions[1]["reason"] and decisions[1]["take"] is False


def test_sandbox_death_during_checkpoint_does_not_cool_down():
    def ck(b):
        raise SandboxDead("gone")

    p = CheckpointPolicy(ck, failure_prob=1.0, async_checkpoint=False, cooldown_s=20.0, min_overhead_s=0.0)
    p.note_work(5.0, action_done=True)
    assert p.maybe_checkpoint_async(1).result() is None
    assert p.inputs(2).cooldown_left_s == 0.0 and isinstance(p.last_error, SandboxDead)


def test_failed_checkpoint_keeps_work_accounted_and_success_resets_it():
    p = CheckpointPolicy(lambda b: (_ for _ in ()).throw(CheckpointError("x")), failure_prob=1.0,
                         async_checkpoint=False, cooldown_s=0.0, min_overhead_s=0.0)
    p.note_work(4.0, action_done=True)
    p.maybe_checkpoint_async(1)
    assert p.work_since_last_s == pytest.approx(4.0)
    p.checkpoint_fn = lambda b: "ok"
    p.maybe_checkpoint_async(1)
    assert p.work_since_last_s == pytest.approx(0.0) and p.actions_since_last == 0


def test_async_checkpoint_overlaps_generation_and_wait_ready_measures_visible_wait():
    release = threading.Event()
    started = threading.Event()

    def ck(b):
        started.set()
        assert release.wait(10)
        return f"ck{b}"

    p = CheckpointPolicy(ck, failure_prob=1.0, min_overhead_s=0.0, async_checkpoint=True, cooldown_s=0.0)
    p.note_work(3.0, action_done=True)
    fut = p.maybe_checkpoint_async(1)
    assert fut is not None and started.wait(10)
    # The caller is free while the checkpoint runs (the next LLM generation would run here).
    assert not fut.done()
    assert p.maybe_checkpoint_async(1) is None  # one in flight
    assert p.wait_ready(timeout=0.05) >= 0.04  # bounded wait while it is still running
    release.set()
    p.wait_ready(timeout=10)
    assert fut.result() == "ck1" and p.stats.succeeded == 1
    assert p.wait_ready() == 0.0  # nothing in flight: no visible wait
    p.close()


async def test_future_is_awaitable_from_asyncio():
    p = CheckpointPolicy(lambda b: f"ck{b}", failure_prob=1.0, min_overhead_s=0.0, async_checkpoint=True)
    p.note_work(1.0, action_done=True)
    fut = p.maybe_checkpoint_async(7)
    assert await asyncio.wrap_future(fut) == "ck7"
    assert await p.wait_ready_async() == 0.0
    p.close()


def test_measured_visible_waits_raise_the_overhead_estimate_and_hidden_ones_lower_it():
    release = threading.Event()
    clock = FakeClock()

    def ck(b):
        assert release.wait(10)
        return "ck"

    p = CheckpointPolicy(ck, failure_prob=1.0, min_overhead_s=0.0, async_checkpoint=True, overhead_ema=0.5,
                         clock=clock)
    p.note_work(1.0, action_done=True)
    p.maybe_checkpoint_async(1)

    def finish_later():
        clock.t += 2.0  # the agent waits 2 s for this checkpoint
        release.set()

    threading.Timer(0.01, finish_later).start()
    p.wait_ready(timeout=10)
    assert p.measured_visible_s == pytest.approx(1.0)
    assert visible_overhead(p.inputs(2)) == pytest.approx(1.0)
    p.note_work(5.0, action_done=True)
    p.maybe_checkpoint_async(2).result(timeout=10)  # finishes before the agent needs the sandbox
    assert p.wait_ready() == 0.0
    assert p.measured_visible_s == pytest.approx(0.5)
    p.close()


def test_a_hidden_checkpoint_that_slows_the_generation_beside_it_is_not_free():
    # On shared CPUs a checkpoint overlapped with generation waits for nothing visible, yet the generation
    # beside it takes longer: that slowdown is its cost, and a saving below it is no reason to checkpoint.
    assert visible_overhead(inputs(async_checkpoint=True, est_checkpoint_s=1.0, est_generation_s=3.0,
                                   measured_slowdown_s=1.3)) == pytest.approx(1.3)
    d = decide(inputs(async_checkpoint=True, failure_prob=0.02, work_since_last_s=6.0, est_checkpoint_s=1.0,
                      est_generation_s=3.0, measured_slowdown_s=1.3))
    assert not d.take and d.visible_overhead_s == pytest.approx(1.3)


def test_generations_overlapped_by_a_checkpoint_are_measured_against_those_that_were_not():
    clock = FakeClock()
    release = threading.Event()
    p = CheckpointPolicy(lambda b: release.wait(10) and f"ck{b}", failure_prob=1.0, min_overhead_s=0.0,
                         async_checkpoint=True, overhead_ema=0.5, clock=clock)
    for _ in range(2):  # clean generations: 2 s each
        clock.t += 2.0
        p.note_work(2.0, action_done=True)
    assert p.est_clean_generation_s == pytest.approx(2.0) and p.measured_slowdown_s == 0.0
    fut = p.maybe_checkpoint_async(2)
    clock.t += 3.0  # the next generation runs beside it and takes 3 s
    p.note_work(3.0)
    release.set()
    fut.result(timeout=10)
    assert p.measured_slowdown_s == pytest.approx(0.5)  # EMA (0.5) of +1 s
    assert p.inputs(3).measured_slowdown_s == pytest.approx(0.5)
    assert visible_overhead(p.inputs(3)) == pytest.approx(0.5)  # nothing was waited for, yet not free
    clock.t += 10.0  # long after the checkpoint: a clean generation again, the slowdown estimate stays
    p.note_work(2.0)
    assert p.measured_slowdown_s == pytest.approx(0.5) and p.est_clean_generation_s == pytest.approx(2.0)
    # A checkpoint that did not slow its neighbour (here: a faster one) brings the estimate back down,
    # never below zero.
    release.clear()
    p.note_work(0.1, kind="action", action_done=True)
    fut = p.maybe_checkpoint_async(4)
    clock.t += 1.0
    p.note_work(1.0)
    release.set()
    fut.result(timeout=10)
    assert p.measured_slowdown_s == 0.0  # 0.5 * 0.5 + 0.5 * (1 - 2) < 0
    p.close()


def test_background_checkpoints_run_nicer_than_the_rollout_and_so_do_the_processes_they_start():
    import os
    import subprocess

    def ck(b):
        tid = threading.get_native_id()
        child = subprocess.run(["sh", "-c", "cut -d' ' -f19 /proc/$$/stat"], capture_output=True, text=True)
        return os.getpriority(os.PRIO_PROCESS, tid), int(child.stdout)

    base = os.getpriority(os.PRIO_PROCESS, 0)
    p = CheckpointPolicy(ck, failure_prob=1.0, min_overhead_s=0.0, async_checkpoint=True, cooldown_s=0.0, nice=7)
    p.note_work(10.0, action_done=True)
    fut = p.maybe_checkpoint_async(1)
    assert fut is not None
    assert fut.result(timeout=10) == (min(19, base + 7), min(19, base + 7))
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the caller's own priority is untouched
    p.close()
