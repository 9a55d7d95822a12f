"""Fleet recovery with real Ray actors, real processes, real signals and the real sglang-router."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import httpx
import psutil
import pytest

from belayer_plugin.events import EventLog
from belayer_plugin.fleet.health import State
from belayer_plugin.fleet.manager import FleetManager, WeightVersionError
from belayer_plugin.fleet.policy import FleetBelowFloorError
from belayer_plugin.generation.sglang_http import generate, get_json
from tests.conftest import belayer_cfg

PROMPT = [54, 280, 487, 423, 442]
GREEDY = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
FAST = ["belayer.use_fault_tolerance=true", "belayer.shadow.num_standby=0", "belayer.monitor.probe_interval_s=0.2", "belayer.monitor.probe_timeout_s=0.5",
        "belayer.monitor.failure_threshold=2", "belayer.monitor.boot_grace_s=0",
        "belayer.monitor.liveness_timeout_s=1", "belayer.restart.backoff_initial_s=0",
        "belayer.restart.backoff_max_s=0", "belayer.router.membership_timeout_s=5"]


@contextlib.asynccontextmanager
async def running_fleet(tmp_path, tiny_model, *overrides):
    cfg = belayer_cfg(*FAST, *overrides)
    fm = FleetManager(cfg, tmp_path, EventLog(tmp_path / "events.jsonl"), model_path=tiny_model)
    try:
        await fm.start()
        yield fm
    finally:
        await fm.shutdown()


def ev(kind, subject=None, to=None):
    return lambda e: e.kind == kind and (subject is None or e.subject == subject) and (to is None or e.to_state == to)


async def _recovered(fm, sid, since, timeout=60):
    """Waits for the slot's new incarnation to be registered; returns the event list of the episode."""
    await fm.events.wait_for(ev("registered", sid), timeout, since=since)
    return [e for e in fm.events.events if e.t >= since and e.subject == sid]


def _order(events):
    return [e.kind if e.kind != "transition" else e.to_state for e in events]


async def _served_by(fm, url):
    async with httpx.AsyncClient() as c:
        return (await get_json(c, url, "/get_server_info", 5))["belayer_counters"]["requests"]


async def _assert_routable(fm, sid):
    """Every engine, the new incarnation included, gets traffic through the router and gives golden ids."""
    url = fm.slots[sid].info.url
    assert url in await fm.router.worker_urls()
    before = await _served_by(fm, url)
    async with httpx.AsyncClient() as c:
        outs = [await generate(c, fm.url, {"input_ids": PROMPT, "sampling_params": GREEDY}, 30) for _ in range(4)]
    assert len({tuple(o["output_ids"]) for o in outs}) == 1
    assert await _served_by(fm, url) > before


@pytest.mark.parametrize("target", ["server", "actor"])
async def test_sigkill_while_serving_is_detected_deregistered_replaced_stale_then_healthy(tmp_path, tiny_model, target):
    async with running_fleet(tmp_path, tiny_model) as fm:
        old = fm.slots["engine-0"].info
        t0 = time.time()
        os.kill(old.pid if target == "server" else old.actor_pid, signal.SIGKILL)
        det = await fm.events.wait_for(ev("detected", "engine-0"), 5, since=t0)
        assert det.t - t0 < 1.0, f"detection took {det.t - t0:.3f} s"
        episode = await _recovered(fm, "engine-0", t0)
        order = _order(episode)
        assert order.index("DEAD") < order.index("deregistered") < order.index("killed") \
            < order.index("RESTARTING") < order.index("STALE") < order.index("HEALTHY") < order.index("registered")
        new = fm.slots["engine-0"].info
        assert new.url != old.url and old.url not in await fm.router.worker_urls()
        assert fm.states() == {"engine-0": "HEALTHY", "engine-1": "HEALTHY"}
        await _assert_routable(fm, "engine-0")
        from prometheus_client import generate_latest

        text = generate_latest(fm.metrics.registry).decode()
        assert 'belayer_engine_transitions_total{to_state="DEAD"} 1.0' in text
        assert "belayer_engine_restarts_total 1.0" in text
        assert 'belayer_engine_state{engine="engine-0",state="HEALTHY"} 1.0' in text


async def test_sigkill_while_paused_is_detected_and_replaced(tmp_path, tiny_model):
    async with running_fleet(tmp_path, tiny_model) as fm:
        await fm.pause()
        probes = fm.monitor.probes_sent
        t0 = time.time()
        os.kill(fm.slots["engine-1"].info.pid, signal.SIGKILL)
        det = await fm.events.wait_for(ev("detected", "engine-1"), 5, since=t0)
        assert det.figures["phase"] == "paused" and det.t - t0 < 1.0
        await _recovered(fm, "engine-1", t0)
        assert fm.monitor.probes_sent == probes, "/health_generate probes ran while paused"
        await fm.resume()
        await _assert_routable(fm, "engine-1")


async def test_sigkill_while_memory_released_replacement_joins_released_then_serves(tmp_path, tiny_model):
    async with running_fleet(tmp_path, tiny_model) as fm:
        await fm.pause(release_memory=True)
        t0 = time.time()
        os.kill(fm.slots["engine-0"].info.actor_pid, signal.SIGKILL)
        await fm.events.wait_for(ev("detected", "engine-0"), 5, since=t0)
        await _recovered(fm, "engine-0", t0)
        async with httpx.AsyncClient() as c:
            info = await get_json(c, fm.slots["engine-0"].info.url, "/get_server_info", 5)
        assert info["memory_released"] is True, "the replacement must join in the fleet's phase"
        # The step's refit resumes the weights only; resume() must then ask for the KV cache alone: asking
        # for weights again kills a real SGLang 0.5.23 scheduler (the CPU engine refuses it and counts it).
        assert set((await fm.refit(tiny_model, "v1")).values()) == {"v1"}
        await fm.resume()
        await _assert_routable(fm, "engine-0")
        async with httpx.AsyncClient() as c:
            for s in fm.slots.values():
                info = await get_json(c, s.info.url, "/get_server_info", 5)
                assert info["belayer_counters"]["resume_not_released"] == 0, (s.slot_id, info["belayer_counters"])
                assert info["memory_released"] is False
        assert not fm.events.find(lambda e: e.kind == "resume_failed")


async def test_a_replacement_suspect_while_it_joins_the_released_phase_is_registered_at_its_next_healthy(
        tmp_path, tiny_model):
    """CI found the replacement unregistered for good: a probe timed out while it released its memory to join
    the fleet's phase, and the probe after it made it HEALTHY with nobody left to register it."""
    async with running_fleet(tmp_path, tiny_model) as fm:
        await fm.pause(release_memory=True)
        # A probe failing during the join's release is now excused (monitor.control_call); one that failed
        # just before the release began still leaves the slot SUSPECT when it returns. Turning the excuse off
        # gives that order deterministically, with a real stopped server.
        fm.monitor._overlapped = lambda engine, then: False
        held: dict = {}

        def blip_while_joining(e):
            if e.subject != "engine-0" or e.kind != "transition":
                return
            if e.from_state == "STALE" and e.to_state == "HEALTHY" and "pid" not in held:
                # current weights: the release that matches the fleet's phase now waits on a stopped server, and
                # the next probe times out (SUSPECT)
                held["pid"] = fm.slots["engine-0"].info.pid
                os.kill(held["pid"], signal.SIGSTOP)
            elif e.to_state == "SUSPECT" and "pid" in held and "cont" not in held:
                # CI's order: the release returns while SUSPECT (probes held back here until it has returned)
                held["cont"] = True
                fm.monitor.unwatch("engine-0")
                os.kill(held["pid"], signal.SIGCONT)

        fm.events.subscribe(blip_while_joining)
        t0 = time.time()
        os.kill(fm.slots["engine-0"].info.actor_pid, signal.SIGKILL)
        await fm.events.wait_for(ev("transition", "engine-0", "SUSPECT"), 60, since=t0)
        s = fm.slots["engine-0"]
        await asyncio.wait_for(asyncio.shield(s.recovery), 30)  # the restart has returned
        assert s.health.state is State.SUSPECT and not s.registered
        fm.monitor.watch("engine-0", s.health.incarnation, s.actor, s.info.url)  # probes again: HEALTHY
        episode = await _recovered(fm, "engine-0", t0, timeout=30)
        kinds = _order(episode)
        assert kinds.index("SUSPECT") < kinds.index("registered") and kinds[-1] != "SUSPECT", kinds
        assert fm.states()["engine-0"] == "HEALTHY"
        async with httpx.AsyncClient() as c:
            info = await get_json(c, s.info.url, "/get_server_info", 5)
        assert info["memory_released"] is True, "the replacement must join in the fleet's phase"
        await fm.resume()
        await _assert_routable(fm, "engine-0")


async def test_paused_engines_with_released_memory_are_never_killed(tmp_path, tiny_model):
    async with running_fleet(tmp_path, tiny_model) as fm:
        await fm.pause(release_memory=True)  # /health_generate now answers 503 on every engine
        t0 = time.time()
        # A negative claim needs elapsed time: ten probe periods plus the whole failure bound.
        await asyncio.sleep(10 * 0.2 + 2 * 0.5)
        assert not fm.events.find(lambda e: e.t >= t0 and e.kind in ("detected", "killed"))
        assert fm.states() == {"engine-0": "HEALTHY", "engine-1": "HEALTHY"}
        await fm.resume()
        await _assert_routable(fm, "engine-0")


async def _on_engine(url: str) -> list[str]:
    async with httpx.AsyncClient() as c:
        return (await get_json(c, url, "/get_server_info", 5))["running_rids"]


async def test_a_release_waits_out_a_health_probe_on_the_engine_and_aborts_what_is_left_never_stranding_it(
        tmp_path, tiny_model):
    """SGLang asserts its scheduler is idle on a memory release (the server dies otherwise). CI found a NeMo-RL
    refit stuck: a /health_generate probe in flight at the pause stayed on the released engine, and every
    /flush_cache of the refit was refused for 60 s. Each engine step here takes 0.4 s, so a probe and a
    client's request are still on the engine when the trainer's pause comes."""
    async with running_fleet(tmp_path, tiny_model, "belayer.engines.cpu_step_delay_ms=400",
                             "belayer.monitor.probe_timeout_s=3", "belayer.monitor.probe_interval_s=0.1",
                             "belayer.monitor.progress.enabled=false") as fm:
        url0, url1 = fm.slots["engine-0"].info.url, fm.slots["engine-1"].info.url
        async with httpx.AsyncClient() as c:
            straggler = asyncio.create_task(generate(c, url1, {"input_ids": PROMPT, "sampling_params": {
                "max_new_tokens": 200, "temperature": 0.0, "ignore_eos": True}}, 120))
            deadline = time.monotonic() + 30  # the engines' own lists of what runs on them, read until both hold one
            while not (any(r.startswith("health-") for r in await _on_engine(url0)) and await _on_engine(url1)):
                assert time.monotonic() < deadline, "no probe reached engine-0 within 30 s"
                await asyncio.sleep(0.05)  # the polling period of that read, not synchronisation
            t0 = time.time()
            await fm.pause(release_memory=True)
            out = await asyncio.wait_for(straggler, 30)
        assert out["meta_info"]["finish_reason"]["type"] == "abort"  # cut at its committed tokens
        assert [e.subject for e in fm.events.find(lambda e: e.t >= t0 and e.kind == "aborted_before_release")] \
            == ["engine-1"]  # engine-0's probe was waited for, not aborted
        async with httpx.AsyncClient() as c:
            for s in fm.slots.values():
                info = await get_json(c, s.info.url, "/get_server_info", 5)
                assert info["memory_released"] is True and info["running_rids"] == [], (s.slot_id, info)
                assert info["belayer_counters"]["release_not_idle"] == 0, (s.slot_id, info["belayer_counters"])
                assert (await c.get(f"{s.info.url}/flush_cache", timeout=5)).status_code == 200
        assert not fm.events.find(lambda e: e.t >= t0 and e.kind in ("release_failed", "detected"))
        await fm.resume()
        await _assert_routable(fm, "engine-0")


async def test_sigkill_mid_refit_restarts_onto_the_new_version(tmp_path, tiny_model):
    from transformers import AutoModelForCausalLM
    import torch

    m = AutoModelForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(1.1)
    m.save_pretrained(tmp_path / "v1")
    async with running_fleet(tmp_path, tiny_model) as fm:
        victim = fm.slots["engine-1"].info
        fm.events.subscribe(lambda e: e.kind == "refit_begin" and os.kill(victim.pid, signal.SIGKILL))
        t0 = time.time()
        served = await fm.refit(str(tmp_path / "v1"), "v1")
        assert served.get("engine-0") == "v1"
        await _recovered(fm, "engine-1", t0)
        for s in fm.slots.values():
            assert await s.actor.weight_version.remote() == "v1"
        async with httpx.AsyncClient() as c:
            outs = [await generate(c, fm.url, {"input_ids": PROMPT, "sampling_params": GREEDY}, 30) for _ in range(4)]
        assert {o["meta_info"]["weight_version"] for o in outs} == {"v1"}


async def test_sigstop_hang_is_detected_within_bound_killed_and_replaced(tmp_path, tiny_model):
    async with running_fleet(tmp_path, tiny_model) as fm:
        old = fm.slots["engine-0"].info
        t0 = time.time()
        os.kill(old.pid, signal.SIGSTOP)
        try:
            det = await fm.events.wait_for(ev("detected", "engine-0"), 10, since=t0)
            bound = 0.2 + 2 * 0.5  # probe_interval_s + failure_threshold x probe_timeout_s
            assert det.t - t0 <= bound + 0.5, f"hang detected after {det.t - t0:.2f} s, bound {bound} s"
            episode = await _recovered(fm, "engine-0", t0)
            assert _order(episode).index("deregistered") < _order(episode).index("killed")
            psutil.wait_procs([psutil.Process(old.pid)], timeout=5) if psutil.pid_exists(old.pid) else None
            assert not psutil.pid_exists(old.pid) or psutil.Process(old.pid).status() == psutil.STATUS_ZOMBIE
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(old.pid, signal.SIGKILL)
        await _assert_routable(fm, "engine-0")


async def test_engine_dying_after_every_restart_is_retired_and_the_run_continues(tmp_path, tiny_model):
    async with running_fleet(tmp_path, tiny_model, "belayer.restart.max_restarts=2",
                             "belayer.restart.min_healthy_engines=1") as fm:
        # A flaky slot: every new incarnation is SIGKILLed as soon as it has started.
        def flaky(e):
            if e.kind == "transition" and e.subject == "engine-0" and e.to_state == "STALE":
                os.kill(fm.slots["engine-0"].info.pid, signal.SIGKILL)
        fm.events.subscribe(flaky)
        t0 = time.time()
        os.kill(fm.slots["engine-0"].info.pid, signal.SIGKILL)
        # Two engine starts lie between the kill and RETIRED: 40 s alone, 81 s seen with CI's other half
        # running beside it on 2 cores; 180 s bounds it with room.
        await fm.events.wait_for(ev("transition", "engine-0", "RETIRED"), 180, since=t0)
        assert len(fm.events.find(lambda e: e.t >= t0 and e.kind == "restarted" and e.subject == "engine-0")) <= 2
        assert len(fm.events.find(lambda e: e.t >= t0 and e.to_state == "RESTARTING" and e.subject == "engine-0")) == 2
        assert fm.fatal is None
        assert fm.states() == {"engine-0": "RETIRED", "engine-1": "HEALTHY"}
        assert await fm.router.worker_urls() == {fm.slots["engine-1"].info.url}
        await _assert_routable(fm, "engine-1")


async def test_below_the_floor_the_run_fails_fast_with_a_typed_readable_error(tmp_path, tiny_model):
    async with running_fleet(tmp_path, tiny_model, "belayer.restart.max_restarts=0",
                             "belayer.restart.min_healthy_engines=2") as fm:
        t0 = time.time()
        os.kill(fm.slots["engine-1"].info.pid, signal.SIGKILL)
        # a bound, not a figure: seen past 10 s with the other CI half and more beside it on 2 cores
        await fm.events.wait_for(ev("below_floor"), 60, since=t0)
        with pytest.raises(FleetBelowFloorError) as ei:
            await fm.wait_all_healthy(5)
        msg = str(ei.value)
        assert "min_healthy_engines=2" in msg and "engine-1: RETIRED" in msg and "engine-0: HEALTHY" in msg
        assert "liveness_lost" in msg  # the history says why
        with pytest.raises(FleetBelowFloorError):
            fm.pick_engine()
        with pytest.raises(FleetBelowFloorError):
            await fm.refit("unused", "v9")


async def test_refit_when_nothing_died_leaves_every_engine_on_the_new_version(tmp_path, tiny_model):
    """Regression: recovery on every refit reset state and the next weight send went nowhere."""
    async with running_fleet(tmp_path, tiny_model) as fm:
        for step in (1, 2, 3):
            t0 = time.time()
            assert await fm.recover_dead(5) == 0
            assert not fm.events.find(lambda e: e.t >= t0), "recovery must be a no-op when nothing died"
            served = await fm.refit(tiny_model, f"v{step}")
            assert served == {"engine-0": f"v{step}", "engine-1": f"v{step}"}
            for s in fm.slots.values():
                assert await s.actor.weight_version.remote() == f"v{step}"
        async with httpx.AsyncClient() as c:
            outs = [await generate(c, fm.url, {"input_ids": PROMPT, "sampling_params": GREEDY}, 30) for _ in range(4)]
        assert {o["meta_info"]["weight_version"] for o in outs} == {"v3"}


async def test_an_engine_serving_another_version_is_fenced_never_silently_used(tmp_path, tiny_model):
    async with running_fleet(tmp_path, tiny_model) as fm:
        await fm.refit(tiny_model, "v1")
        rogue = fm.slots["engine-0"].info
        async with httpx.AsyncClient() as c:
            r = await c.post(f"{rogue.url}/update_weight_version", json={"new_version": "v0-stale"})
            assert r.status_code == 200
        t0 = time.time()
        await fm.verify_versions()
        mism = await fm.events.wait_for(ev("weight_version_mismatch", "engine-0"), 5, since=t0)
        assert mism.level == "error"
        assert rogue.url not in await fm.router.worker_urls()
        await _recovered(fm, "engine-0", t0)
        assert await fm.slots["engine-0"].actor.weight_version.remote() == "v1"
        with pytest.raises(WeightVersionError, match="no engine could load"):
            await fm.refit(str(tmp_path / "does-not-exist"), "v2")


async def test_a_hung_engine_is_found_while_paused_without_generate_probes(tmp_path, tiny_model):
    async with running_fleet(tmp_path, tiny_model) as fm:
        await fm.pause(release_memory=True)
        gen_probes = fm.monitor.probes_sent
        old = fm.slots["engine-1"].info
        t0 = time.time()
        os.kill(old.pid, signal.SIGSTOP)
        try:
            det = await fm.events.wait_for(ev("detected", "engine-1"), 10, since=t0)
            assert det.figures["phase"] == "released" and "/get_model_info" in det.reason
            await _recovered(fm, "engine-1", t0)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(old.pid, signal.SIGKILL)
        assert fm.monitor.probes_sent == gen_probes, "/health_generate probes ran while paused"
        await fm.resume()
        await _assert_routable(fm, "engine-1")


async def test_an_engine_streaming_tokens_gets_no_generate_probe_while_an_idle_one_does(tmp_path, tiny_model):
    # monitor.progress.readiness_from_tokens: the tokens a busy engine streams answer readiness, so it is not
    # also asked to generate a probe token every interval. Counted by the engines themselves (health_tokens).
    from belayer_plugin.generation.resumable import ResumableGenerator
    from tests.test_fleet_progress import _Pinned, _progress_cb, _tokens

    async with running_fleet(tmp_path, tiny_model, "belayer.engines.num_engines=2",
                             "belayer.engines.cpu_step_delay_ms=20") as fm:
        urls = {sid: fm.slots[sid].info.url for sid in ("engine-0", "engine-1")}

        async def health_tokens() -> dict:
            async with httpx.AsyncClient() as c:
                return {sid: (await get_json(c, u, "/get_server_info", 5))["belayer_counters"]["health_tokens"]
                        for sid, u in urls.items()}

        gen = ResumableGenerator(_Pinned(fm, "engine-0"), fm.cfg.recovery, fm.events)
        holder: dict = {}
        started = asyncio.ensure_future(_tokens(holder, "busy", 5, 30))
        req = asyncio.create_task(gen.generate("busy", PROMPT, {"max_new_tokens": 150, "temperature": 0.0,
                                                                "ignore_eos": True},
                                               on_progress=_progress_cb(holder, "busy")))
        await started
        before, skipped = await health_tokens(), fm.monitor.probes_skipped
        t0 = time.monotonic()
        log, _ = await asyncio.wait_for(req, 60)
        streamed_s = time.monotonic() - t0
        after = await health_tokens()
        assert streamed_s > 1.5 and [g.engine for g in log.segments] == ["engine-0"] and log.committed == 150
        # at most one probe already in flight when the stream began; the idle engine: one per 0.2 s interval
        assert after["engine-0"] - before["engine-0"] <= 1, (before, after)
        assert after["engine-1"] - before["engine-1"] >= streamed_s / 0.2 / 3, (before, after, streamed_s)
        assert fm.monitor.probes_skipped - skipped >= streamed_s / 0.2 / 3
        assert [e for e in fm.events.events if e.kind == "transition" and e.to_state in ("SUSPECT", "DEAD")] == []
