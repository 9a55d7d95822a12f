"""Shadow-engine handover with real Ray actors and real kills under load."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import psutil

from belayer_plugin.generation.resumable import FleetSelector, ResumableGenerator
from belayer_plugin.generation.sglang_http import generate, get_json
from tests.distinct_weights import greedy_ids, perturbed_copy
from tests.test_fleet_recovery import running_fleet

PROMPTS = [[54, 280, 487, 423, 442], [60, 61, 62], [100, 200, 300, 400]]
N = 200
GREEDY = {"max_new_tokens": N, "temperature": 0.0, "ignore_eos": True}
SHADOW = ["belayer.shadow.num_standby=1", "belayer.engines.cpu_step_delay_ms=2",
          "belayer.recovery.stall_timeout_s=5"]


def fleet(tmp_path, tiny_model, *overrides):
    return running_fleet(tmp_path, tiny_model, *SHADOW, *overrides)


def ev(kind, subject=None):
    return lambda e: e.kind == kind and (subject is None or e.subject == subject)


def server_nices(pid: int) -> set[int]:
    """The nice values of every thread of an engine server (nice is per thread on Linux)."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out.add(os.getpriority(os.PRIO_PROCESS, int(tid)))
        except OSError:  # the thread ended meanwhile
            pass
    return out


async def test_shadow_takes_over_within_a_second_under_load_and_is_replaced(tmp_path, tiny_model):
    async with fleet(tmp_path, tiny_model) as fm:
        assert len(fm.shadows.ready) == 1
        shadow = fm.shadows.ready[0]
        assert shadow.info.url not in await fm.router.worker_urls(), "a standby must not be routable"
        gen = ResumableGenerator(FleetSelector(fm), fm.cfg.recovery, fm.events)
        async with httpx.AsyncClient() as c:
            golden = [(await generate(c, fm.slots["engine-1"].info.url, {"input_ids": p, "sampling_params": GREEDY},
                                      60))["output_ids"] for p in PROMPTS]
        killed = []

        def kill(clog, seg):
            if not killed and seg.engine == "engine-0" and clog.committed >= 30:
                killed.append(time.time())
                os.kill(fm.slots["engine-0"].info.pid, signal.SIGKILL)

        gen.observers.append(kill)
        outs = await asyncio.gather(*(gen.generate(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)))
        assert killed
        assert [o[1]["output_ids"] for o in outs] == golden, "a request was lost or changed by the handover"
        ho = await fm.events.wait_for(ev("handover", "engine-0"), 10, since=killed[0])
        det = fm.events.find(lambda e: e.kind == "detected" and e.subject == "engine-0" and e.t >= killed[0])[0]
        reg = await fm.events.wait_for(ev("registered", "engine-0"), 10, since=killed[0])
        assert ho.figures["took_s"] <= 1.0
        assert reg.t - det.t <= 1.0, f"detected -> registered took {reg.t - det.t:.3f} s"
        assert fm.slots["engine-0"].info.url == shadow.info.url
        assert shadow.info.url in await fm.router.worker_urls()
        await fm.events.wait_for(lambda e: e.kind == "shadow_ready" and e.subject != shadow.sid, 60, since=killed[0])
        assert len(fm.shadows.ready) == 1 and fm.shadows.ready[0].sid != shadow.sid


async def test_stale_shadow_is_brought_to_the_current_version_before_it_is_registered(tmp_path, tiny_model):
    v1 = perturbed_copy(tiny_model, tmp_path / "weights-v1", seed=1)
    async with fleet(tmp_path, tiny_model, "belayer.shadow.keep_warm=on_handover") as fm:
        base_ids = await greedy_ids(fm.slots["engine-0"].info.url)
        await fm.refit(v1, "v1")
        v1_ids = await greedy_ids(fm.slots["engine-0"].info.url)
        assert v1_ids != base_ids, "v1's weights must compute other greedy ids than the base model's"
        sh = fm.shadows.ready[0]
        async with fm.shadows.awake(sh):  # parked, its actor is stopped (shadow.freeze_parked)
            assert await sh.actor.weight_version.remote() == "default"  # on_handover: left behind at refit
        t0 = time.time()
        os.kill(fm.slots["engine-1"].info.pid, signal.SIGKILL)
        reg = await fm.events.wait_for(ev("registered", "engine-1"), 20, since=t0)
        assert reg.figures["version"] == "v1"
        assert await sh.actor.weight_version.remote() == "v1"
        # Not just the label: the standby that took the slot computes with v1's weights, not the base model's.
        assert await greedy_ids(fm.slots["engine-1"].info.url) == v1_ids
        episode = [e for e in fm.events.events if e.t >= t0 and e.subject == "engine-1"]
        kinds = [e.to_state or e.kind for e in episode]
        assert kinds.index("HEALTHY") < kinds.index("registered")


async def test_keep_warm_refit_updates_standbys_off_the_refit_barrier_and_a_handover_waits_for_it(tmp_path, tiny_model):
    w = {v: perturbed_copy(tiny_model, tmp_path / f"weights-{v}", seed=int(v[1:])) for v in ("v6", "v7", "v8", "v9")}
    async with fleet(tmp_path, tiny_model, "belayer.shadow.keep_warm=refit") as fm:
        ids = {"base": await greedy_ids(fm.slots["engine-0"].info.url)}
        # A standby that cannot answer (SIGSTOPped) does not hold the trainer's refit: it returns once the
        # serving engines hold v7, and the standby catches up when it runs again.
        sh = fm.shadows.ready[0]
        # Parked in the background (shadow.standby_nice, 10 by default): every thread of its server runs 10
        # nicer than the serving engines, so its refits yield the CPU to them.
        base = os.getpriority(os.PRIO_PROCESS, fm.slots["engine-0"].info.pid)
        assert server_nices(fm.slots["engine-0"].info.pid) == {base}
        assert sh.nice == 10 and server_nices(sh.info.pid) == {min(19, base + 10)}
        assert server_nices(sh.info.actor_pid) == {min(19, base + 10)}  # its actor too (woken for each refit)
        # In the trainer's phase (paused, memory released) a refit leaves the standby alone: it loads the
        # version once serving resumes, beside neither the serving engines' refit nor their resume.
        await fm.pause(release_memory=True)
        before = sh.refit_task
        assert set((await fm.refit(w["v6"], "v6")).values()) == {"v6"}
        assert sh.refit_task is before and sh.version != "v6"
        t0 = time.time()
        await fm.resume()
        assert sh.refit_task is not before
        done = await fm.events.wait_for(lambda e: e.kind == "shadow_refit", 30, since=t0)
        assert done.figures["version"] == "v6" and sh.version == "v6"
        ids["v6"] = await greedy_ids(fm.slots["engine-0"].info.url)
        assert ids["v6"] != ids["base"], "v6's weights must compute other greedy ids than the base model's"
        os.kill(sh.info.pid, signal.SIGSTOP)
        try:
            t0 = time.time()
            served = await asyncio.wait_for(fm.refit(w["v7"], "v7"), 20)
            assert set(served.values()) == {"v7"}
            assert not fm.events.find(lambda e: e.t >= t0 and e.kind == "shadow_refit")
            ids["v7"] = await greedy_ids(fm.slots["engine-0"].info.url)
            assert ids["v7"] != ids["v6"], "v7's weights must compute other greedy ids than v6's"
        finally:
            os.kill(sh.info.pid, signal.SIGCONT)
        done = await fm.events.wait_for(lambda e: e.kind == "shadow_refit", 30, since=t0)
        assert done.figures["version"] == "v7" and done.subject == sh.sid
        async with fm.shadows.awake(sh):
            assert [await s.actor.weight_version.remote() for s in fm.shadows.ready] == ["v7"]
        # Two refits back to back, then at once a death: the standby takes the slot at the newest version,
        # its own refits having finished in order (never two updates of it at once).
        t1 = time.time()
        await fm.refit(w["v8"], "v8")
        ids["v8"] = await greedy_ids(fm.slots["engine-1"].info.url)
        await fm.refit(w["v9"], "v9")
        ids["v9"] = await greedy_ids(fm.slots["engine-1"].info.url)
        assert ids["v8"] != ids["v7"] and ids["v9"] != ids["v8"], "each version's weights must differ from the last"
        os.kill(fm.slots["engine-0"].info.pid, signal.SIGKILL)
        reg = await fm.events.wait_for(ev("registered", "engine-0"), 30, since=t1)
        assert reg.figures["version"] == "v9" and fm.slots["engine-0"].info.url == sh.info.url
        assert await sh.actor.weight_version.remote() == "v9"
        # Its last refit loaded v9's weights, not only the label: it computes v9's ids.
        assert await greedy_ids(sh.info.url) == ids["v9"]
        # Its refits ran in the background (threads they started inherit the nice); serving, it is back to normal.
        assert sh.nice == 0 and server_nices(sh.info.pid) == {base} and server_nices(sh.info.actor_pid) == {base}
        assert fm.events.find(lambda e: e.t >= t1 and e.kind == "handover" and e.subject == "engine-0")
        assert not fm.events.find(lambda e: e.t >= t1 and e.kind in ("handover_failed", "shadow_lost"))


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the command name (state first)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def proc_state(pid: int) -> str:
    """The kernel's one-letter state of a process (T: stopped by a signal)."""
    return _stat(pid)[0]


async def stopped_state(pid: int, timeout: float = 10.0) -> str:
    """The process's state once it shows as stopped, or the last state seen within `timeout`. A SIGSTOP is
    acted on when the process next runs, which on loaded cores can be a while after the signal was sent;
    nothing announces it to a non-parent, so /proc is read every 20 ms until the deadline."""
    deadline = time.monotonic() + timeout
    while (state := proc_state(pid)) != "T" and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return state


def cpu_ticks(pid: int) -> int:
    fields = _stat(pid)
    return int(fields[11]) + int(fields[12])  # utime + stime


async def test_a_dead_standby_is_replaced_in_the_background(tmp_path, tiny_model):
    async with fleet(tmp_path, tiny_model) as fm:
        # Its server killed while its actor is stopped (nothing in the actor can see it): the pool's own
        # pidfd watch reports it at once, not the next refit or handover.
        sh = fm.shadows.ready[0]
        assert sh.frozen and await stopped_state(sh.info.actor_pid) == "T"
        t0 = time.time()
        os.kill(sh.info.pid, signal.SIGKILL)
        lost = await fm.events.wait_for(ev("shadow_lost", sh.sid), 10, since=t0)
        assert lost.t - t0 < 2.0 and "seen by the pool" in lost.reason, lost.reason
        ready_ev = await fm.events.wait_for(lambda e: e.kind == "shadow_ready" and e.subject != sh.sid, 60, since=t0)
        ready = [s.sid for s in fm.shadows.ready]
        assert len(ready) == fm.cfg.shadow.num_standby and sh.sid not in ready  # replaced, not just gone
        # The stopped actor itself killed: Ray reports its death (the raylet sees its socket close).
        sh2 = fm.shadows.ready[0]
        assert sh2.sid == ready_ev.subject and sh2.frozen and await stopped_state(sh2.info.actor_pid) == "T"
        t1 = time.time()
        os.kill(sh2.info.actor_pid, signal.SIGKILL)
        lost2 = await fm.events.wait_for(ev("shadow_lost", sh2.sid), 10, since=t1)
        assert "actor died" in lost2.reason or "exited" in lost2.reason, lost2.reason
        await fm.events.wait_for(lambda e: e.kind == "shadow_ready" and e.subject not in (sh.sid, sh2.sid), 60,
                                 since=t1)
        assert len(fm.shadows.ready) == fm.cfg.shadow.num_standby


async def test_a_parked_standbys_actor_is_stopped_between_refits_and_runs_for_good_at_handover(tmp_path, tiny_model):
    async with fleet(tmp_path, tiny_model) as fm:
        sh = fm.shadows.ready[0]
        # Stopped: its Ray actor spends nothing while it stands by (an idle Ray actor costs ~5-9 ms/s).
        assert sh.frozen and await stopped_state(sh.info.actor_pid) == "T"
        ticks = cpu_ticks(sh.info.actor_pid)
        await asyncio.sleep(1.0)  # a span to measure over, not a synchronisation
        assert cpu_ticks(sh.info.actor_pid) == ticks
        # Its refit goes straight to its server: the actor is not woken for it (not one tick of CPU) and the
        # server reports the new version.
        v2 = perturbed_copy(tiny_model, tmp_path / "weights-v2", seed=2)
        base_ids = await greedy_ids(fm.slots["engine-0"].info.url)
        t0 = time.time()
        await fm.refit(v2, "v2")
        done = await fm.events.wait_for(lambda e: e.kind == "shadow_refit", 30, since=t0)
        assert done.figures["version"] == "v2" and sh.version == "v2" and done.figures["direct"] is True
        v2_ids = await greedy_ids(fm.slots["engine-0"].info.url)
        assert v2_ids != base_ids, "v2's weights must compute other greedy ids than the base model's"
        assert sh.frozen and await stopped_state(sh.info.actor_pid) == "T"
        assert cpu_ticks(sh.info.actor_pid) == ticks
        async with httpx.AsyncClient() as c:
            assert (await get_json(c, sh.info.url, "/get_model_info", 10))["weight_version"] == "v2"
        # At handover it runs for good and serves at the current version, as fast as an awake standby.
        t1 = time.time()
        os.kill(fm.slots["engine-1"].info.pid, signal.SIGKILL)
        ho = await fm.events.wait_for(ev("handover", "engine-1"), 20, since=t1)
        assert ho.figures["took_s"] <= 1.0 and ho.figures["version"] == "v2"
        assert fm.slots["engine-1"].info.url == sh.info.url and not sh.frozen
        assert proc_state(sh.info.actor_pid) != "T"
        assert await asyncio.wait_for(sh.actor.weight_version.remote(), 10) == "v2"
        async with httpx.AsyncClient() as c:
            out = await generate(c, sh.info.url, {"input_ids": PROMPTS[0], "sampling_params": GREEDY}, 60)
        assert len(out["output_ids"]) == N
        assert await greedy_ids(sh.info.url) == v2_ids, "the standby took over with other weights than v2's"


async def test_standbys_stay_awake_when_freezing_is_off(tmp_path, tiny_model):
    async with fleet(tmp_path, tiny_model, "belayer.shadow.freeze_parked=false") as fm:
        sh = fm.shadows.ready[0]
        assert not sh.frozen and proc_state(sh.info.actor_pid) != "T"
        assert await asyncio.wait_for(sh.actor.ping.remote(), 10) == sh.sid
        # awake, its refits go through its actor
        v2 = perturbed_copy(tiny_model, tmp_path / "weights-v2", seed=2)
        base_ids = await greedy_ids(sh.info.url)
        t0 = time.time()
        await fm.refit(v2, "v2")
        done = await fm.events.wait_for(lambda e: e.kind == "shadow_refit", 30, since=t0)
        assert done.figures["version"] == "v2" and done.figures["direct"] is False
        assert await asyncio.wait_for(sh.actor.weight_version.remote(), 10) == "v2"
        v2_ids = await greedy_ids(fm.slots["engine-0"].info.url)
        assert v2_ids != base_ids and await greedy_ids(sh.info.url) == v2_ids, \
            "the awake standby's refit must load v2's weights (other ids than the base model's)"


async def test_cpu_engines_map_one_shared_memory_copy_of_the_weights(tmp_path, tiny_model):
    async with fleet(tmp_path, tiny_model) as fm:
        shm = Path(fm.engine_model_path)
        assert str(shm).startswith("/dev/shm/") and (shm / "weights.bin").exists()
        async with httpx.AsyncClient() as c:
            for s in [*fm.slots.values()]:
                await get_json(c, s.info.url, "/get_server_info", 5)
                maps = Path(f"/proc/{s.info.pid}/maps").read_text()
                assert str(shm / "weights.bin") in maps, "engine did not map the shared weights"
            sh = fm.shadows.ready[0]
            assert str(shm / "weights.bin") in Path(f"/proc/{sh.info.pid}/maps").read_text()
    assert not shm.exists(), "the holder must remove its shared memory at shutdown"


def _servers_logging_to(log: Path) -> list[psutil.Process]:
    """Running processes whose stdout is `log` (an engine server writes its log there from its start)."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.readlink(f"/proc/{p.pid}/fd/1") == str(log) and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (OSError, psutil.Error):
            pass
    return out


async def test_a_standby_still_starting_when_the_fleet_shuts_down_leaves_no_server_behind(tmp_path, tiny_model):
    async with fleet(tmp_path, tiny_model) as fm:
        sh = fm.shadows.ready[0]
        t0 = time.time()
        os.kill(sh.info.pid, signal.SIGKILL)
        await fm.events.wait_for(ev("shadow_lost", sh.sid), 10, since=t0)
        log = tmp_path / "engines" / "shadow-1.log"
        # Its replacement's server is spawned but not yet healthy (~2 s): nothing announces the spawn to
        # this process, so /proc is read every 20 ms, bounded.
        deadline = time.monotonic() + 30
        while not (servers := _servers_logging_to(log)) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert servers and not fm.shadows.ready, "the replacement was not caught mid-start"
    # The fleet is shut down: the replacement's server went with it (not whenever Ray collects its actor).
    gone, alive = await asyncio.to_thread(psutil.wait_procs, servers, timeout=10)
    assert not alive, f"a starting standby's server outlived the fleet: {alive}"
