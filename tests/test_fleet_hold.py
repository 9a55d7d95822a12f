"""No request is lost while the fleet can still recover (issue 47): a request that finds no serving engine while
the fleet brings one back waits for it with its committed tokens, bounded by its own deadline, not by
recovery.stall_timeout_s; only the floor or that deadline ends it, each with its own error and HTTP status.

One serving engine, no standby, real SIGKILLs; the restart is made slower than the stall timeout by its backoff
(restart.backoff_initial_s: the first restart of a window waits that long), as a cold SGLang restart is.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from belayer_plugin.config import ConfigError
from belayer_plugin.generation.resumable import (FleetBelowFloorRequestError, QueueFullError, RequestDeadlineError,
                                                 RequestFailedError)
from belayer_plugin.generation.sglang_http import generate
from tests.conftest import belayer_cfg
from tests.test_token_recovery import fleet_and_front

PROMPT = [54, 280, 487, 423, 442]
GREEDY = {"max_new_tokens": 200, "temperature": 0.0, "ignore_eos": True}
STALL = 1.5
# One engine, no standby (FAST), a restart budget, and a restart that takes longer than the stall timeout.
ONE = ["belayer.engines.num_engines=1", f"belayer.recovery.stall_timeout_s={STALL}"]


def slow_restart(backoff_s: float) -> list[str]:
    return ONE + [f"belayer.restart.backoff_initial_s={backoff_s}", f"belayer.restart.backoff_max_s={backoff_s}"]


def ev(kind, subject=None, to=None):
    return lambda e: e.kind == kind and (subject is None or e.subject == subject) and (to is None or e.to_state == to)


async def _golden(fm) -> list[int]:
    async with httpx.AsyncClient() as c:
        return (await generate(c, fm.slots["engine-0"].info.url, {"input_ids": PROMPT, "sampling_params": GREEDY},
                               60))["output_ids"]


def _kill_at(fm, rid: str, at: int, killed: dict):
    """An observer that SIGKILLs the engine serving `rid` once `at` of its tokens are committed."""

    def kill(clog, seg):
        if clog.rid == rid and not killed and clog.committed >= at:
            killed.update(url=seg.url, seen=clog.committed, t=time.time())
            os.kill(fm.slots[seg.engine].info.pid, signal.SIGKILL)

    return kill


async def _kill_idle_engine(fm) -> float:
    """SIGKILLs the only engine (no request on it) and returns once the fleet has fenced it (its recovery is
    under way: the restart's backoff follows)."""
    t0 = time.time()
    os.kill(fm.slots["engine-0"].info.pid, signal.SIGKILL)
    await fm.events.wait_for(ev("killed", "engine-0"), 30, since=t0)
    return t0


def test_bad_hold_settings_are_named_at_start_up():
    with pytest.raises(ConfigError) as ei:
        belayer_cfg("belayer.recovery.max_waiting=-1", "belayer.recovery.heartbeat_s=0",
                    "belayer.recovery.retry_after_s=0")
    msg = str(ei.value)
    for key in ("recovery.max_waiting", "recovery.heartbeat_s", "recovery.retry_after_s"):
        assert f"belayer.{key}:" in msg, msg


async def test_a_request_waits_through_a_restart_slower_than_the_stall_timeout_and_ends_as_the_fault_free_run(
        tmp_path, tiny_model):
    async with fleet_and_front(tmp_path, tiny_model, *slow_restart(6)) as (fm, gen, front):
        golden = await _golden(fm)
        killed: dict = {}
        async with asyncio.timeout(120):
            clog, resp = await gen.generate("held", PROMPT, GREEDY, on_progress=_kill_at(fm, "held", 50, killed))
        assert killed, "the kill never happened"
        assert resp["output_ids"] == golden  # greedy: identical to the fault-free run
        s0, s1 = clog.segments  # one cut, one resume: no attempt spent on waiting
        assert s0.url == killed["url"] and s1.url != killed["url"] and s1.engine == "engine-0"
        # The committed tokens were kept: the engine that came back went on from prompt + committed ids.
        assert s1.start == s0.end >= killed["seen"] >= 50 and s1.end == GREEDY["max_new_tokens"]
        held = fm.events.find(lambda e: e.kind == "waiting_for_engine" and e.subject == "held" and e.figures["held"])
        assert held and held[0].figures["committed"] == s0.end, [e.to_dict() for e in held]
        found = fm.events.find(ev("engine_found", "held"))
        # it waited longer than the stall timeout that used to drop it, for the restarted incarnation
        assert found and found[-1].figures["waited_s"] > STALL
        restarted = fm.events.find(ev("restarted", "engine-0"))
        assert restarted and restarted[-1].t - killed["t"] > STALL


async def test_below_the_floor_a_waiting_request_ends_at_once_with_the_floor_error(tmp_path, tiny_model):
    # No restart budget: the slot retires and the fleet falls below restart.min_healthy_engines=1. The stall and
    # request timeouts are long: the request must end on the floor, not on either of them.
    async with fleet_and_front(tmp_path, tiny_model, *ONE, "belayer.restart.max_restarts=0",
                               "belayer.recovery.stall_timeout_s=40", "belayer.recovery.request_timeout_s=90") \
            as (fm, gen, front):
        killed: dict = {}
        gen.observers.append(_kill_at(fm, "floor", 30, killed))
        async with httpx.AsyncClient() as c:
            r = await c.post(f"{front.url}/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY,
                                                             "rid": "floor"}, timeout=120)
        took = time.time() - killed["t"]
        body = r.json()
        assert r.status_code == 503 and body["error"]["reason"] == "fleet_below_floor", r.text
        assert "Retry-After" not in r.headers  # nothing will come back: no point retrying
        assert "min_healthy_engines=1" in body["error"]["message"] and "token(s) committed" in body["error"]["message"]
        assert fm.fatal is not None and took < 20, took
        with pytest.raises(FleetBelowFloorRequestError):  # and a new request is told so at once
            await gen.generate("after", PROMPT, GREEDY)


async def test_the_request_deadline_ends_a_wait_for_an_engine_that_comes_back_too_late(tmp_path, tiny_model):
    async with fleet_and_front(tmp_path, tiny_model, *slow_restart(60), "belayer.recovery.request_timeout_s=8") \
            as (fm, gen, front):
        killed: dict = {}
        t0 = time.monotonic()
        with pytest.raises(RequestDeadlineError) as ei:
            await gen.generate("late", PROMPT, GREEDY, on_progress=_kill_at(fm, "late", 20, killed))
        took = time.monotonic() - t0
        err = ei.value
        assert err.status == 504 and err.kind == "request_deadline"
        assert "request_timeout_s=8" in str(err) and "for an engine" in str(err), str(err)
        assert isinstance(err, RequestFailedError)  # callers that catch the base class still do
        assert err.log.committed >= killed["seen"] >= 20  # its committed tokens are still there
        assert 8 - 0.5 <= took < 8 + 5, took  # ended by its own deadline, held past the stall timeout
        assert fm.events.find(lambda e: e.kind == "waiting_for_engine" and e.subject == "late" and e.figures["held"])


async def test_new_requests_beyond_max_waiting_get_503_with_retry_after_from_the_front(tmp_path, tiny_model):
    async with fleet_and_front(tmp_path, tiny_model, *slow_restart(60), "belayer.recovery.max_waiting=1",
                               "belayer.recovery.retry_after_s=7", "belayer.recovery.request_timeout_s=10") \
            as (fm, gen, front):
        t0 = await _kill_idle_engine(fm)
        async with httpx.AsyncClient() as c:
            body = {"input_ids": PROMPT, "sampling_params": GREEDY}
            first = asyncio.create_task(c.post(f"{front.url}/generate", json={**body, "rid": "first"}, timeout=60))
            await fm.events.wait_for(lambda e: e.kind == "waiting_for_engine" and e.subject == "first"
                                     and e.figures["held"], 30, since=t0)
            for stream in (False, True):  # a stream is refused before its headers go out: same answer
                r = await c.post(f"{front.url}/generate", json={**body, "rid": f"over-{stream}", "stream": stream},
                                 timeout=30)
                assert r.status_code == 503 and r.headers["Retry-After"] == "7", (r.status_code, r.headers, r.text)
                assert r.json()["error"]["reason"] == "queue_full" and "max_waiting=1" in r.json()["error"]["message"]
            # The one that waits ends on its own deadline, with its own status.
            r = await first
            assert r.status_code == 504 and r.json()["error"]["reason"] == "request_deadline", r.text
        assert gen.selector.n_waiting == 0
        with pytest.raises(QueueFullError):  # the queue is free again but max_waiting=0 takes no new request
            gen.cfg.max_waiting = 0
            await gen.generate("none-waits", PROMPT, GREEDY)


async def test_a_streaming_client_gets_heartbeats_while_its_request_waits_then_the_rest_of_its_tokens(
        tmp_path, tiny_model):
    async with fleet_and_front(tmp_path, tiny_model, *slow_restart(4), "belayer.recovery.heartbeat_s=0.3") \
            as (fm, gen, front):
        golden = await _golden(fm)
        lines: list[str] = []
        async with httpx.AsyncClient() as c:
            async with asyncio.timeout(120):
                async with c.stream("POST", f"{front.url}/generate", json={
                        "input_ids": PROMPT, "sampling_params": GREEDY, "stream": True, "rid": "hb"},
                        timeout=httpx.Timeout(60, read=2)) as r:  # a read timeout well under the restart
                    assert r.status_code == 200
                    data = 0
                    async for line in r.aiter_lines():
                        lines.append(line)
                        if line.startswith("data:"):
                            data += 1
                            if data == 10:
                                chunk = json.loads(line[5:])
                                os.kill(fm.slots[chunk["meta_info"]["belayer"]["engine"]].info.pid, signal.SIGKILL)
        beats = [i for i, ln in enumerate(lines) if ln == ": waiting for an engine"]
        datas = [i for i, ln in enumerate(lines) if ln.startswith("data:")]
        assert len(beats) >= 3, lines[:40]
        assert datas[9] < beats[0] and beats[-1] < datas[-1]  # between the tokens before the kill and after it
        assert lines[datas[-1]] == "data: [DONE]"
        final = json.loads(lines[datas[-2]][5:])
        assert final["output_ids"] == golden and len(final["meta_info"]["belayer"]["segments"]) == 2


async def test_a_wait_for_an_engine_is_woken_by_the_fleets_state_changes_not_by_polling(tmp_path, tiny_model):
    """While it waits, a pick wakes only when the fleet notifies a change: a handful of times over a restart,
    not once per interval."""
    async with fleet_and_front(tmp_path, tiny_model, *slow_restart(3)) as (fm, gen, front):
        golden = await _golden(fm)
        wakes = []
        real = fm.wait_changed

        async def counted(timeout):
            await real(timeout)
            wakes.append(time.monotonic())

        fm.wait_changed = counted
        t0 = await _kill_idle_engine(fm)
        async with asyncio.timeout(120):
            clog, resp = await gen.generate("woken", PROMPT, GREEDY)
        assert resp["output_ids"] == golden and len(clog.segments) == 1
        # DEAD (a 3 s backoff) -> RESTARTING -> STALE -> HEALTHY: at most a wake per transition, none in between
        transitions = fm.events.find(lambda e: e.kind == "transition" and e.subject == "engine-0" and e.t >= t0)
        assert 1 <= len(wakes) <= len(transitions), (len(wakes), [e.to_state for e in transitions])
        assert not gen.waiting and gen.selector.n_waiting == 0
