"""Hang detection from token progress: the pure tracker (fake clock), then real fleets under SIGSTOP."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
import pytest_asyncio

from belayer_plugin.config import ProgressConfig
from belayer_plugin.events import EventLog
from belayer_plugin.fleet.manager import FleetManager
from belayer_plugin.fleet.progress import ProgressTracker
from belayer_plugin.generation.resumable import FleetSelector, ResumableGenerator, Target
from belayer_plugin.generation.sglang_http import generate
from tests.conftest import belayer_cfg

CFG = dict(enabled=True, floor_s=1.0, gap_multiplier=8.0, gap_window=32, min_gaps=4,
           prefill_s_per_1k_tokens=2.0, confirm_timeout_s=1.0, readiness_from_tokens=True)


def _tracker(**kw) -> ProgressTracker:
    t = ProgressTracker(ProgressConfig(**{**CFG, **kw}))
    t.watch("e0", 1)
    return t


def _stream(t: ProgressTracker, start: float, gap: float, n: int, rid: str = "r", prompt: int = 10) -> float:
    """One request streaming n tokens `gap` apart from `start`; returns the time of the last token."""
    t.started("e0", 1, rid, prompt, start)
    now = start
    for _ in range(n):
        now += gap
        t.tokens("e0", 1, rid, now)
    return now


def test_silence_past_the_floor_is_a_stall_reported_once_and_cleared_by_a_token():
    t = _tracker()
    last = _stream(t, 0.0, 0.01, 10)
    assert t.threshold("e0") == pytest.approx(1.0)  # 8 x 10 ms is under the floor
    assert t.stalled(last + 0.99) == []
    [st] = t.stalled(last + 1.0)
    assert (st.engine, st.incarnation, st.inflight) == ("e0", 1, 1) and "progress" in st.reason
    assert t.stalled(last + 5.0) == [], "one report per silence"
    t.tokens("e0", 1, "r", last + 5.1)  # alive after all: a silence it survived raises its own threshold
    assert t.threshold("e0") == pytest.approx(8 * 5.1)
    assert t.stalled(last + 45.0) == [] and len(t.stalled(last + 45.9)) == 1


def test_threshold_follows_the_engines_own_gaps_as_they_grow_under_load():
    t = _tracker()
    now = _stream(t, 0.0, 0.01, 10)
    for i in range(40):  # the engine slows down gradually (load): 10 ms -> 400 ms per token
        now += 0.01 * (i + 1)
        t.tokens("e0", 1, "r", now)
    th = t.threshold("e0")
    assert th == pytest.approx(8 * 0.39)  # p95 of the last 32 gaps (0.09 .. 0.40 s)
    assert t.stalled(now + th - 0.01) == [], "a merely slow engine is not a hang"
    assert len(t.stalled(now + th)) == 1


def test_not_armed_before_warm_up_idle_or_while_suspended_and_resume_counts_from_then():
    t = _tracker()
    t.started("e0", 1, "r", 10, 0.0)
    t.tokens("e0", 1, "r", 0.1)
    t.tokens("e0", 1, "r", 0.2)  # 1 gap < min_gaps: still warming up (compile, first batches)
    assert t.next_deadline() is None and t.stalled(100.0) == []
    last = _stream(t, 0.2, 0.01, 5, rid="r")
    assert t.next_deadline() == pytest.approx(last + 1.0)
    t.suspend()  # pause / memory release / refit
    assert t.next_deadline() is None and t.stalled(last + 100) == []
    t.resume(last + 100)  # silence counts from here, and it must warm up again
    assert t.stalled(last + 200) == []
    _stream(t, last + 200, 0.01, 4, rid="r2")
    t.ended("e0", 1, "r", last + 200.1)
    t.ended("e0", 1, "r2", last + 200.1)
    assert t.next_deadline() is None, "an idle engine is never a hang"


def test_prompt_awaiting_its_first_token_extends_the_threshold_by_its_length():
    t = _tracker()
    last = _stream(t, 0.0, 0.01, 10)
    t.started("e0", 1, "long", 6000, last)  # a 6k-token prefill now holds the engine's next step
    assert t.threshold("e0") == pytest.approx(1.0 + 12.0)
    assert t.stalled(last + 12.9) == []
    t.tokens("e0", 1, "long", last + 12.95)  # its first token: the allowance goes (its wait was no gap)
    assert t.threshold("e0") == pytest.approx(1.0)
    t.tokens("e0", 1, "r", last + 12.96)  # the step the prefill held: r's own long gap stays
    assert t.threshold("e0") == pytest.approx(8 * 12.96)


def test_a_saturated_batch_keeps_its_step_time_as_the_gap_though_its_tokens_arrive_together():
    # 30 requests decoded together: each step's 30 tokens arrive within ~90 ms of each other, and the steps
    # slow from 20 ms to 1.5 s as the batch saturates the engine. Engine-wide gaps would be 29 near-zeros per
    # step (their p95 ~0, the threshold at the 1 s floor, every slow step a stall); a request's gaps are
    # the step time.
    t = _tracker()
    rids = [f"r{i}" for i in range(30)]
    for r in rids:
        t.started("e0", 1, r, 10, 0.0)
    now, step, slowest = 0.0, 0.02, 0.0
    for k in range(60):
        if k >= 10:
            step = min(1.5, step * 1.15)
        now += step
        assert t.stalled(now) == [], f"step {k} ({step:.2f} s) taken for a hang"
        for i, r in enumerate(rids):
            t.tokens("e0", 1, r, now + 0.003 * i)
        now += 0.003 * (len(rids) - 1)
        slowest = max(slowest, step)
    spread = 0.003 * (len(rids) - 1)  # a request waits a whole step plus the previous step's spread
    assert slowest == 1.5 and t.threshold("e0") == pytest.approx(8 * (1.5 + spread))
    assert t.stalled(now + 8 * 1.5) == []
    assert len(t.stalled(now + 8 * (1.5 + spread) + 0.01)) == 1, "a hang of the saturated engine is still found"


def test_a_coalesced_read_of_several_chunks_counts_as_that_many_gaps():
    t = _tracker(floor_s=0.5)
    t.started("e0", 1, "r", 10, 0.0)
    t.tokens("e0", 1, "r", 0.1, chunks=5)  # one read, 5 chunks: 4 gaps, warm (min_gaps 4)
    assert t.threshold("e0") == pytest.approx(0.5)
    now = 0.1
    for _ in range(10):  # a read every 100 ms (the reader's window) of 5 chunks: the engine steps every 20 ms
        now += 0.1
        t.tokens("e0", 1, "r", now, chunks=5)
    assert t.threshold("e0") == pytest.approx(0.5), "8 x 20 ms is under the floor (8 x 100 ms is not)"
    assert t.stalled(now + 0.49) == [] and len(t.stalled(now + 0.5)) == 1


def test_an_answered_probe_doubles_the_threshold_and_other_incarnations_are_ignored():
    t = _tracker()
    last = _stream(t, 0.0, 0.01, 10)
    assert len(t.stalled(last + 1.0)) == 1
    t.answered("e0", 1, last + 1.5)  # alive after all (e.g. another client's prefill we cannot see)
    assert t.stalled(last + 3.4) == [] and len(t.stalled(last + 3.5)) == 1
    t.tokens("e0", 0, "r", last + 3.6)  # a late stream of the previous incarnation: no news
    t.watch("e0", 2)  # replaced: nothing carried over
    assert t.next_deadline() is None


def test_an_observer_stall_is_excused():
    t = _tracker()
    last = _stream(t, 0.0, 0.01, 10)
    t.excuse(3.0)
    assert t.stalled(last + 3.9) == [] and len(t.stalled(last + 4.0)) == 1


def test_recent_tokens_answer_readiness_only_until_the_silence_is_overdue_or_reported():
    t = _tracker()
    assert not t.served_within("e0", 1, 2.0, 0.0)  # never served
    last = _stream(t, 0.0, 0.01, 10)
    assert t.served_within("e0", 1, 2.0, last + 0.5)
    assert not t.served_within("e0", 2, 2.0, last + 0.5)  # another incarnation served nothing
    # within the window but past the silence deadline (floor 1 s): the real probe must go
    assert not t.served_within("e0", 1, 2.0, last + 1.5)
    assert len(t.stalled(last + 1.5)) == 1
    assert not t.served_within("e0", 1, 5.0, last + 1.6)  # reported: stays a real probe
    t.tokens("e0", 1, "r", last + 1.7)  # it streamed again
    assert t.served_within("e0", 1, 2.0, last + 1.8)
    t.suspend()
    assert not t.served_within("e0", 1, 2.0, last + 1.8)
    t.resume(last + 1.9)
    t.ended("e0", 1, "r", last + 2.0)  # idle after serving: recent tokens still count, until the window ends
    assert t.served_within("e0", 1, 2.0, last + 2.5) and not t.served_within("e0", 1, 2.0, last + 3.8)



def test_tokens_streamed_before_a_reported_fault_do_not_answer_readiness():
    # A killed engine's last tokens are recent: without this, readiness from tokens turned the SUSPECT that a
    # failed request raised back to HEALTHY before liveness saw the death.
    t = _tracker()
    last = _stream(t, 0.0, 0.01, 10)
    assert t.served_within("e0", 1, 2.0, last + 0.1)
    t.fault("e0", 2)  # another incarnation's fault changes nothing here
    assert t.served_within("e0", 1, 2.0, last + 0.1)
    t.fault("e0", 1)
    assert not t.served_within("e0", 1, 2.0, last + 0.1)
    t.tokens("e0", 1, "r", last + 0.2)  # a token after the fault: it serves
    assert t.served_within("e0", 1, 2.0, last + 0.3)

# ---------------------------------------------------------------- real fleets (CPU engines, Ray, signals)
PROMPT = [54, 280, 487, 423, 442]
STEP_MS = 20
PREFILL_MS_PER_1K = 1500  # the CPU engine's chaos switch: a 2000-token prefill holds every stream ~3 s
# The CPU engine's saturation switch: a step takes 40 ms more per running request beyond 4 (the other tests
# keep <= 4 on an engine), so 31 requests make a ~1.1 s step.
SATURATED_MS_PER_REQUEST, SATURATED_FREE_REQUESTS = 40, 4
# Probes so slow that only token progress can find a hang within seconds.
SLOW_PROBES = ["belayer.monitor.probe_interval_s=30", "belayer.monitor.probe_timeout_s=30",
               "belayer.monitor.failure_threshold=2"]


class _Pinned(FleetSelector):
    """A FleetSelector that sends a request's first segment to one chosen engine (resumes go anywhere)."""

    def __init__(self, fleet, engine: str):
        super().__init__(fleet)
        self.engine = engine

    async def pick(self, exclude: set[str], timeout: float) -> Target:
        s = self.fleet.slots[self.engine]
        if s.health.serving and s.info.url not in exclude:
            s.inflight += 1
            return Target(s.slot_id, s.info.url, s.health.incarnation)
        return await super().pick(exclude, timeout)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(ray_cluster, tmp_path_factory, tiny_model):
    run_dir = tmp_path_factory.mktemp("progress")
    cfg = belayer_cfg("belayer.use_fault_tolerance=true", "belayer.router.mode=direct",
                      "belayer.engines.num_engines=2", "belayer.shadow.num_standby=0",
                      f"belayer.engines.cpu_step_delay_ms={STEP_MS}", "belayer.restart.backoff_initial_s=0",
                      "belayer.engines.max_running_requests=48", *SLOW_PROBES)
    fm = FleetManager(cfg, run_dir, EventLog(run_dir / "events.jsonl"), model_path=tiny_model)
    # Test only: the CPU engines' slow-prefill and saturation chaos switches (the fleet passes no such
    # variables itself).
    fm.actor_options = lambda sid: {"runtime_env": {"env_vars": {
        "BELAYER_CHAOS_PREFILL_MS_PER_1K": str(PREFILL_MS_PER_1K),
        "BELAYER_CHAOS_STEP_MS_PER_REQUEST": str(SATURATED_MS_PER_REQUEST),
        "BELAYER_CHAOS_STEP_FREE_REQUESTS": str(SATURATED_FREE_REQUESTS)}}}
    await fm.start()
    yield fm
    await fm.shutdown()


pytestmark_fleet = pytest.mark.asyncio(loop_scope="module")


def _alarms(fm, since: float) -> list:
    """Suspicions and deaths since `since` (a false alarm is any of them)."""
    return [e for e in fm.events.events if e.t >= since and
            (e.kind == "detected" or (e.kind == "transition" and e.to_state in ("SUSPECT", "DEAD")))]


async def _tokens(log_holder: dict, rid: str, n: int, timeout: float) -> None:
    """Waits (bounded) until request `rid` has committed n tokens (set by its on_progress callback)."""
    ev = log_holder.setdefault(f"{rid}>={n}", asyncio.Event())
    await asyncio.wait_for(ev.wait(), timeout)


def _progress_cb(holder: dict, rid: str):
    def cb(log, seg) -> None:
        for key, ev in list(holder.items()):
            name, _, n = key.partition(">=")
            if name == rid and log.committed >= int(n):
                ev.set()
    return cb


@pytestmark_fleet
async def test_a_long_prefill_holding_a_busy_engine_raises_no_hang_alarm(fleet):
    fm = fleet
    gen = ResumableGenerator(_Pinned(fm, "engine-0"), fm.cfg.recovery, fm.events)
    holder: dict = {}
    _tokens_wait = asyncio.ensure_future(_tokens(holder, "bg", 30, 30))
    t0 = time.time()
    bg = asyncio.create_task(gen.generate("bg", PROMPT, {"max_new_tokens": 160, "temperature": 0.0,
                                                         "ignore_eos": True}, on_progress=_progress_cb(holder, "bg")))
    await _tokens_wait  # warm: engine-0 has streamed more than progress.min_gaps gaps
    assert fm.monitor.progress.threshold("engine-0") is not None, "the progress check is armed"
    long_prompt = [(i * 7) % 400 + 20 for i in range(2000)]
    t_long = time.monotonic()
    log_long, _ = await gen.generate("long", long_prompt, {"max_new_tokens": 4, "temperature": 0.0,
                                                           "ignore_eos": True})
    held = time.monotonic() - t_long
    log_bg, _ = await asyncio.wait_for(bg, 60)
    assert held > 2.5, f"the chaos prefill held the engine only {held:.2f} s"
    assert _alarms(fm, t0) == [], [(e.kind, e.subject, e.reason) for e in _alarms(fm, t0)]
    assert [g.engine for g in log_bg.segments] == ["engine-0"] and log_bg.committed == 160
    assert [g.engine for g in log_long.segments] == ["engine-0"] and log_long.committed == 4


@pytestmark_fleet
async def test_a_saturated_engine_slower_than_the_floor_raises_no_hang_alarm(fleet):
    # 30 requests join engine-1 three at a time, one batch per step: its step grows from 20 ms to ~1.1 s, past
    # the 0.8 s floor. It is merely slow: the threshold follows its requests' own gaps and nothing is suspected.
    fm = fleet
    floor = fm.cfg.monitor.progress.floor_s
    gen = ResumableGenerator(_Pinned(fm, "engine-1"), fm.cfg.recovery, fm.events)
    holder: dict = {}
    reads: list[float] = []
    feed = _progress_cb(holder, "bg")

    def cb(log, seg) -> None:
        reads.append(time.monotonic())
        feed(log, seg)

    sp = {"temperature": 0.0, "ignore_eos": True}
    warm = asyncio.ensure_future(_tokens(holder, "bg", 30, 30))
    t0 = time.time()
    bg = asyncio.create_task(gen.generate("bg", PROMPT, {**sp, "max_new_tokens": 64}, on_progress=cb))
    await warm
    joined = []
    for k in range(10):
        await _tokens(holder, "bg", 31 + k, 30)  # one more step: three more requests (read lazily, coalesced)
        joined += [asyncio.create_task(gen.generate(f"load-{k}-{j}", PROMPT, {**sp, "max_new_tokens": 16}))
                   for j in range(3)]
    await _tokens(holder, "bg", 43, 60)  # every one of them is decoding now: the engine at its slowest
    peak = fm.monitor.progress.threshold("engine-1")
    logs = [(await asyncio.wait_for(t, 120))[0] for t in [bg, *joined]]
    slowest = max(b - a for a, b in zip(reads, reads[1:]))
    assert slowest > floor + 0.1, f"not saturated: bg's longest gap {slowest:.2f} s"
    assert _alarms(fm, t0) == [], [(e.kind, e.subject, e.reason) for e in _alarms(fm, t0)]
    assert peak is not None and peak > slowest, f"threshold {peak} did not follow the steps ({slowest:.2f} s)"
    for log in logs:
        assert [g.engine for g in log.segments] == ["engine-1"] and log.committed == log.max_new_tokens


@pytestmark_fleet
async def test_a_paused_fleet_with_requests_held_in_flight_raises_no_hang_alarm(fleet):
    fm = fleet
    gen = ResumableGenerator(_Pinned(fm, "engine-1"), fm.cfg.recovery, fm.events)
    holder: dict = {}
    warm = asyncio.ensure_future(_tokens(holder, "p", 30, 30))
    t0 = time.time()
    req = asyncio.create_task(gen.generate("p", PROMPT, {"max_new_tokens": 120, "temperature": 0.0,
                                                          "ignore_eos": True}, on_progress=_progress_cb(holder, "p")))
    await warm
    assert fm.monitor.progress.threshold("engine-1") is not None
    await fm.pause()  # the trainer's phase change, then it holds the engine's scheduler
    url = fm.slots["engine-1"].info.url
    async with httpx.AsyncClient() as c:
        assert (await c.post(f"{url}/pause_generation", timeout=10)).status_code == 200
        probes = fm.monitor.probes_sent
        # The engine is silent with a request in flight for well past floor + confirmation (1.8 s): nothing
        # may happen. An alarm would be an event: wait for one, bounded.
        with pytest.raises(asyncio.TimeoutError):
            await fm.events.wait_for(lambda e: e.kind == "transition" and e.subject == "engine-1", 4.0, since=t0)
        assert fm.monitor.probes_sent == probes, "/health_generate sent while paused"
        assert (await c.post(f"{url}/continue_generation", timeout=10)).status_code == 200
    await fm.resume()
    log, _ = await asyncio.wait_for(req, 60)
    assert _alarms(fm, t0) == [], [(e.kind, e.subject, e.reason) for e in _alarms(fm, t0)]
    assert [g.engine for g in log.segments] == ["engine-1"] and log.committed == 120


@pytestmark_fleet
async def test_sigstop_under_streaming_load_is_found_by_progress_long_before_any_probe_and_resumed_elsewhere(fleet):
    fm = fleet
    sp = {"max_new_tokens": 120, "temperature": 0.0, "ignore_eos": True}
    async with httpx.AsyncClient() as c:
        golden = (await generate(c, fm.slots["engine-1"].info.url, {"input_ids": PROMPT, "sampling_params": sp},
                                 60))["output_ids"]
    holder: dict = {}
    gens = {e: ResumableGenerator(_Pinned(fm, e), fm.cfg.recovery, fm.events) for e in ("engine-0", "engine-1")}
    rids = [f"{e}-{k}" for e in gens for k in range(2)]
    warm = [asyncio.ensure_future(_tokens(holder, rid, 30, 30)) for rid in rids]
    reqs = {rid: asyncio.create_task(gens[rid.rsplit("-", 1)[0]].generate(rid, PROMPT, sp,
                                                                           on_progress=_progress_cb(holder, rid)))
            for rid in rids}
    await asyncio.gather(*warm)
    victim = fm.slots["engine-0"].info
    t0 = time.time()
    for pid in (victim.actor_pid, victim.pid):
        os.kill(pid, signal.SIGSTOP)
    try:
        det = await fm.events.wait_for(lambda e: e.kind == "detected" and e.subject == "engine-0", 20, since=t0)
        assert det.figures["signal"] == "progress_hung" and det.reason.startswith("progress:"), det.reason
        # Probes every 30 s with a 30 s timeout could not have said anything yet.
        assert det.t - t0 < 4.0, f"detected after {det.t - t0:.2f} s"
        suspect = [e for e in fm.events.events if e.t >= t0 and e.kind == "transition" and e.subject == "engine-0"]
        assert [(e.to_state, e.figures["signal"]) for e in suspect[:2]] == [("SUSPECT", "progress_stalled"),
                                                                            ("DEAD", "progress_hung")]
        await fm.events.wait_for(lambda e: e.kind == "killed" and e.subject == "engine-0", 10, since=t0)  # fenced
        logs = {rid: (await asyncio.wait_for(t, 60))[0] for rid, t in reqs.items()}
    finally:
        for pid in (victim.actor_pid, victim.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for rid, log in logs.items():
        assert log.output_ids == golden, rid
        if rid.startswith("engine-0"):
            assert [g.engine for g in log.segments] == ["engine-0", "engine-1"] and log.segments[0].end > 0
        else:
            assert [g.engine for g in log.segments] == ["engine-1"]
    assert not [e for e in _alarms(fm, t0) if e.subject == "engine-1"], "the healthy engine was suspected"
