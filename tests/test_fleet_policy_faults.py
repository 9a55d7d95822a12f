"""Fleet policy under repeated faults, with real Ray actors, real processes and real signals: one slot's
crash loop is a budget matter (never a hardware verdict), the boot grace ends at HEALTHY, and a request
that crashes every engine it reaches is quarantined."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from belayer_plugin.generation.resumable import FleetSelector, RequestPoisonedError, ResumableGenerator
from belayer_plugin.generation.sglang_http import generate
from tests.test_fleet_recovery import running_fleet

PROMPT = [54, 280, 487, 423, 442]
GREEDY = {"max_new_tokens": 120, "temperature": 0.0, "ignore_eos": True}
SHADOW = ["belayer.shadow.num_standby=1", "belayer.engines.cpu_step_delay_ms=2", "belayer.recovery.stall_timeout_s=5"]
POISON = 7  # a token id the chaos switch makes CPU engines die on


def ev(kind, subject=None, to=None):
    return lambda e: e.kind == kind and (subject is None or e.subject == subject) and (to is None or e.to_state == to)


async def test_two_kills_of_one_slot_neither_retire_it_nor_exclude_its_node_and_standbys_keep_coming(
        tmp_path, tiny_model):
    async with running_fleet(tmp_path, tiny_model, *SHADOW, "belayer.shadow.fault_window_s=60",
                             "belayer.restart.backoff_initial_s=0.2", "belayer.restart.backoff_max_s=1") as fm:
        node = fm.slots["engine-0"].info.node_id
        first = fm.shadows.ready[0].sid
        t0 = time.time()
        os.kill(fm.slots["engine-0"].info.pid, signal.SIGKILL)
        await fm.events.wait_for(ev("handover", "engine-0"), 10, since=t0)
        await fm.events.wait_for(lambda e: e.kind == "shadow_ready" and e.subject != first, 120, since=t0)
        t1 = time.time()
        os.kill(fm.slots["engine-0"].info.pid, signal.SIGKILL)  # the shadow that took over, well within the window
        # The second death follows the budget: a backoff, then the new standby takes over; no verdict.
        backoff = await fm.events.wait_for(ev("backoff", "engine-0"), 10, since=t1)
        assert backoff.figures["delay_s"] > 0
        await fm.events.wait_for(ev("registered", "engine-0"), 30, since=t1)
        assert fm.states() == {"engine-0": "HEALTHY", "engine-1": "HEALTHY"}
        assert not fm.events.find(lambda e: e.kind in ("node_excluded", "node_exclusion_refused"))
        assert node not in fm.excluded_nodes
        assert fm.policy.restarts_in_window("engine-0", time.monotonic()) == 2
        # Standbys are still placed on the (only) node.
        await fm.events.wait_for(ev("shadow_ready"), 120, since=t1)
        assert not fm.events.find(ev("shadow_failed"))
        async with httpx.AsyncClient() as c:
            out = await generate(c, fm.url, {"input_ids": PROMPT, "sampling_params": GREEDY}, 30)
        assert len(out["output_ids"]) == GREEDY["max_new_tokens"]


async def test_a_restarted_engine_that_hangs_once_healthy_is_detected_within_readiness_bounds(tmp_path, tiny_model):
    async with running_fleet(tmp_path, tiny_model, "belayer.monitor.boot_grace_s=120") as fm:
        t0 = time.time()
        os.kill(fm.slots["engine-0"].info.pid, signal.SIGKILL)
        await fm.events.wait_for(ev("registered", "engine-0"), 60, since=t0)
        pid = fm.slots["engine-0"].info.pid
        t1 = time.time()
        os.killpg(pid, signal.SIGSTOP)
        try:
            det = await fm.events.wait_for(ev("detected", "engine-0"), 10, since=t1)
        finally:
            try:
                os.killpg(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        m = fm.cfg.monitor
        bound = m.probe_interval_s + m.failure_threshold * m.probe_timeout_s
        assert det.t - t1 < bound + 2.0, f"hang detected after {det.t - t1:.2f} s (grace {m.boot_grace_s:g} s)"
        assert "timed out" in det.reason


async def test_a_request_that_crashes_every_engine_is_quarantined_and_costs_no_budget(tmp_path, tiny_model):
    async with running_fleet(tmp_path, tiny_model, *SHADOW, "belayer.chaos.enabled=true",
                             f"belayer.chaos.poison_token_id={POISON}") as fm:
        async with httpx.AsyncClient() as c:
            golden = (await generate(c, fm.slots["engine-1"].info.url,
                                     {"input_ids": PROMPT, "sampling_params": GREEDY}, 60))["output_ids"]
        gen = ResumableGenerator(FleetSelector(fm), fm.cfg.recovery, fm.events)
        t0 = time.time()
        innocent = asyncio.create_task(gen.generate("innocent", PROMPT, GREEDY))
        with pytest.raises(RequestPoisonedError) as ei:
            await gen.generate("poison-1", [54, POISON, 280], GREEDY)
        assert ei.value.rid == "poison-1" and ei.value.status == 422
        assert "poison-1" in str(ei.value) and len(ei.value.engines) == fm.cfg.recovery.poison_max_deaths == 2
        clog, resp = await innocent
        assert resp["output_ids"] == golden, "an innocent request was lost or changed"
        q = await fm.events.wait_for(ev("poison_request", "poison-1"), 5, since=t0)
        await fm.wait_all_healthy(60)
        deaths = fm.events.find(lambda e: e.kind == "detected" and e.t >= t0)
        assert len(deaths) == 2, "the poison request walked on after its quarantine"
        assert not fm.events.find(lambda e: e.t >= t0 and e.kind == "resumed" and e.subject == "poison-1"
                                  and e.figures.get("committed", 0) > 0)
        # Its deaths cost neither restart budget nor node health.
        assert len(q.figures["deaths"]) == 2  # (slot, incarnation) of each engine it took down
        now = time.monotonic()
        assert all(fm.policy.restarts_in_window(sid, now) == 0 for sid in fm.slots)
        await asyncio.sleep(0)  # let node-health bookkeeping tasks run
        assert not fm.nodes.deaths and not fm.excluded_nodes
        assert not fm.events.find(ev("node_excluded"))


async def test_probe_failures_during_a_memory_release_call_are_excused_but_a_hang_after_it_is_found(
        tmp_path, tiny_model):
    """CI found a healthy engine declared dead: its release held the server past two 0.5 s probes on a loaded
    machine. Failed probes that overlap a release or resume call say nothing and are discarded; once the
    call is over, the same silence is a hang again."""
    async with running_fleet(tmp_path, tiny_model) as fm:
        await fm.pause(release_memory=True)
        pid = fm.slots["engine-1"].info.pid
        t0 = time.time()
        with fm.monitor.control_call("engine-1"):  # a release call, its server held (here: stopped)
            os.kill(pid, signal.SIGSTOP)
            try:
                # The fault's length, not synchronisation: well past the detection bound of
                # failure_threshold x probe_timeout_s + probe_interval_s = 1.2 s.
                await asyncio.sleep(3.0)
            finally:
                os.kill(pid, signal.SIGCONT)
        assert fm.monitor.probes_excused >= 2
        assert not fm.events.find(lambda e: e.kind == "detected" and e.t >= t0)
        assert fm.slots["engine-1"].info.pid == pid
        t1 = time.time()
        os.kill(pid, signal.SIGSTOP)  # no call in flight now
        try:
            det = await fm.events.wait_for(ev("detected", "engine-1"), 10, since=t1)
            assert "/get_model_info" in det.reason
        finally:
            os.kill(pid, signal.SIGKILL)
