"""RETIRED is not forever in a run that lasts days (issue 47, item 3): a slot retired for its spent budget is
tried again after restart.retire_cooldown_s with a renewed budget; one retired while its node is excluded
waits for the exclusion to lift; a cooling-down slot is not usable (the floor check is unchanged). Real Ray
actors and real SIGKILLs of the engines' server processes."""

from __future__ import annotations

import asyncio
import os
import signal
import time

from tests.test_fleet_recovery import _assert_routable, running_fleet

COOLDOWN = 2.0
RETIRE_FAST = ["belayer.restart.max_restarts=1", f"belayer.restart.retire_cooldown_s={COOLDOWN:g}",
               "belayer.restart.min_healthy_engines=1"]


def ev(kind, subject=None, to=None):
    return lambda e: e.kind == kind and (subject is None or e.subject == subject) and (to is None or e.to_state == to)


async def _retire(fm, sid):
    """Spends the slot's budget of one restart with two real crashes; returns the RETIRED transition."""
    t0 = time.time()
    os.kill(fm.slots[sid].info.pid, signal.SIGKILL)
    await fm.events.wait_for(ev("registered", sid), 60, since=t0)
    t1 = time.time()
    os.kill(fm.slots[sid].info.pid, signal.SIGKILL)
    return await fm.events.wait_for(ev("transition", sid, "RETIRED"), 30, since=t1)


async def test_a_slot_retired_for_its_spent_budget_serves_again_after_the_cooldown_with_a_renewed_budget(
        tmp_path, tiny_model):
    async with running_fleet(tmp_path, tiny_model, *RETIRE_FAST) as fm:
        retired = await _retire(fm, "engine-0")
        assert fm.states()["engine-0"] == "RETIRED" and fm.fatal is None
        over = await fm.events.wait_for(ev("retire_cooldown_over", "engine-0"), COOLDOWN + 20, since=retired.t)
        assert over.t - retired.t >= COOLDOWN - 0.05, "tried again before the cool-down was over"
        retry = await fm.events.wait_for(ev("transition", "engine-0", "RESTARTING"), 5, since=retired.t)
        assert retry.from_state == "RETIRED" and retry.figures["signal"] == "retry"
        await fm.events.wait_for(ev("registered", "engine-0"), 60, since=over.t)
        assert fm.states() == {"engine-0": "HEALTHY", "engine-1": "HEALTHY"}
        # Renewed: only the retry itself is in the window, not the two restarts that retired it.
        assert fm.policy.restarts_in_window("engine-0", time.monotonic()) == 1
        await _assert_routable(fm, "engine-0")


async def test_a_retired_slot_cooling_down_is_not_usable_so_the_floor_still_fails_the_run(tmp_path, tiny_model):
    async with running_fleet(tmp_path, tiny_model, "belayer.restart.max_restarts=1",
                             "belayer.restart.retire_cooldown_s=1", "belayer.restart.min_healthy_engines=2") as fm:
        retired = await _retire(fm, "engine-0")
        floor = await fm.events.wait_for(ev("below_floor"), 10, since=retired.t)
        assert floor.figures["usable"] == 1 and fm.fatal is not None
        await asyncio.sleep(3.0)  # three cool-downs: a failed run's slot is not tried again
        assert not fm.events.find(ev("retire_cooldown_over"))
        assert fm.states()["engine-0"] == "RETIRED"


async def test_a_slot_retired_while_its_node_is_excluded_waits_for_the_exclusion_to_lift(tmp_path, tiny_model):
    async with running_fleet(tmp_path, tiny_model, *RETIRE_FAST, "belayer.restart.node_exclusion_decay_s=0") as fm:
        node = fm.slots["engine-0"].info.node_id
        t0 = time.time()
        os.kill(fm.slots["engine-0"].info.pid, signal.SIGKILL)
        await fm.events.wait_for(ev("registered", "engine-0"), 60, since=t0)
        # Node evidence as Ray gives it (the node reported dead), before the crash that retires the slot.
        fm._verdict(fm.nodes.node_dead(node, time.monotonic(), "Ray reports node dead (test)"))
        t1 = time.time()
        os.kill(fm.slots["engine-0"].info.pid, signal.SIGKILL)
        retired = await fm.events.wait_for(ev("transition", "engine-0", "RETIRED"), 30, since=t1)
        await fm.events.wait_for(ev("retire_cooldown_waits_for_node", "engine-0"), COOLDOWN + 20, since=retired.t)
        await asyncio.sleep(1.5)  # past the cool-down, still excluded: still retired
        assert not fm.events.find(ev("retire_cooldown_over")) and fm.states()["engine-0"] == "RETIRED"
        t2 = time.time()
        assert fm.readmit_node(node)
        over = await fm.events.wait_for(ev("retire_cooldown_over", "engine-0"), 10, since=retired.t)
        assert over.t >= t2
        await fm.events.wait_for(ev("registered", "engine-0"), 60, since=t2)
        assert fm.states() == {"engine-0": "HEALTHY", "engine-1": "HEALTHY"}


async def test_a_cooldown_of_zero_keeps_a_retired_slot_retired(tmp_path, tiny_model):
    async with running_fleet(tmp_path, tiny_model, "belayer.restart.max_restarts=1",
                             "belayer.restart.retire_cooldown_s=0",
                             "belayer.restart.min_healthy_engines=1") as fm:
        await _retire(fm, "engine-0")
        await asyncio.sleep(2.0)
        assert not fm.events.find(lambda e: e.kind.startswith("retire_cooldown"))
        assert fm.states()["engine-0"] == "RETIRED"
