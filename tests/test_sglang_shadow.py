"""Shadow handover with real SGLang 0.5.23 on CPU: a parked standby whose Ray actor is stopped.

The CPU-engine tests (tests/test_shadow.py) cover the pool's logic; this one checks what only a real SGLang
standby can show: its server (leader, scheduler, detokenizer) keeps running while its actor is stopped, a
refit wakes the actor, loads the new weights through SGLang's /update_weights_from_disk and stops it again,
and at a SIGKILL of the serving engine's process group mid-request the standby takes the slot at the new
version and the request ends with the fault-free ids, nothing committed generated again.

Skipped only when .venv-sglang is absent (a broken venv fails).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import psutil
import pytest

from belayer_plugin.events import EventLog
from belayer_plugin.fleet.manager import FleetManager
from belayer_plugin.generation.resumable import FleetSelector, ResumableGenerator
from tests.conftest import belayer_cfg
from tests.test_sglang_engine import needs_sglang
from tests.test_sglang_fleet import SGLANG, _engine_processes, _ids, _perturbed_copy, _until_gone
from tests.test_shadow import proc_state, stopped_state

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(600)]

PROMPT = [54, 280, 487, 423, 442]
N = 200
KILL_AT = 30
GREEDY = {"max_new_tokens": N, "temperature": 0.0, "ignore_eos": True}
SGLANG_SHADOW = [o for o in SGLANG if not o.startswith("belayer.shadow.num_standby=")] + [
    "belayer.engines.num_engines=1",
    "belayer.shadow.num_standby=1",
    "belayer.shadow.freeze_parked=true",
    "belayer.shadow.handover_timeout_s=30",
    "belayer.restart.min_healthy_engines=0",  # one engine: its death must not end the test's fleet
]


def _stopped(procs: list[psutil.Process]) -> list[str]:
    return [f"{p.pid} {p.name()}" for p in procs if p.status() == psutil.STATUS_STOPPED]


@needs_sglang
async def test_a_stopped_sglang_standby_is_refit_while_parked_and_takes_over_a_killed_engine_mid_request(
        ray_cluster, tmp_path, tiny_model):
    v1 = _perturbed_copy(tiny_model, tmp_path / "weights-v1")
    cfg = belayer_cfg(*SGLANG_SHADOW)
    events = EventLog(tmp_path / "events.jsonl")
    fm = FleetManager(cfg, tmp_path, events, model_path=tiny_model)
    gen = ResumableGenerator(FleetSelector(fm), cfg.recovery, events)
    seen: list[psutil.Process] = []  # every SGLang process the fleet ran, checked gone at the end
    killed: dict = {}
    try:
        await fm.start()
        sh = fm.shadows.ready[0]
        seen += _engine_processes(sh.info.pid) + _engine_processes(fm.slots["engine-0"].info.pid)
        # Parked: its actor stopped, its SGLang server (every process of it) running and answering.
        assert sh.frozen and await stopped_state(sh.info.actor_pid) == "T"
        server = _engine_processes(sh.info.pid)
        assert len(server) >= 3 and not _stopped(server), server
        async with httpx.AsyncClient() as c:
            assert (await c.get(f"{sh.info.url}/health", timeout=10)).status_code == 200

        # The base model's ids, before any refit: v1 must compute other ones (a refit is judged by weights,
        # not by its label).
        base0 = (await _ids(fm.slots["engine-0"].info.url, PROMPT, GREEDY))["output_ids"]
        # A refit wakes it to load v1 through SGLang's own update, off the trainer's barrier, then stops it.
        t0 = time.time()
        assert await fm.refit(v1, "v1") == {"engine-0": "v1"}
        done = await events.wait_for(lambda e: e.kind == "shadow_refit" and e.subject == sh.sid, 120, since=t0)
        assert done.figures["version"] == "v1" and sh.version == "v1"
        assert sh.frozen and await stopped_state(sh.info.actor_pid) == "T"
        base = await _ids(sh.info.url, PROMPT, GREEDY)
        golden = (await _ids(fm.slots["engine-0"].info.url, PROMPT, GREEDY))["output_ids"]
        # Not just the label: the standby computes with v1's weights (the same ids as the serving engine).
        assert base["output_ids"] == golden and base["meta_info"]["weight_version"] == "v1"
        assert golden != base0, "v1's weights compute the base model's ids: the refit proved nothing"

        def kill(clog, seg):  # at token KILL_AT, as the generator commits it
            if not killed and clog.committed >= KILL_AT:
                info = fm.slots[seg.engine].info
                killed.update(url=info.url, t=time.time(), seen=clog.committed, procs=_engine_processes(info.pid))
                os.killpg(info.pid, signal.SIGKILL)

        gen.observers.append(kill)
        clog, out = await asyncio.wait_for(gen.generate("r0", PROMPT, GREEDY), 300)
        assert killed, "the kill never happened"
        assert out["output_ids"] == golden, "the request was lost or changed by the handover"
        segs = out["meta_info"]["belayer"]["segments"]
        assert len(segs) == 2 and segs[0]["url"] == killed["url"] and segs[1]["url"] == sh.info.url, segs
        assert segs[1]["start"] >= killed["seen"], "tokens streamed before the kill were generated again"

        ho = await events.wait_for(lambda e: e.kind == "handover" and e.subject == "engine-0", 60,
                                   since=killed["t"])
        assert ho.figures["version"] == "v1" and ho.figures["took_s"] <= 5.0, ho
        restarts = events.find(lambda e: e.kind == "transition" and e.to_state == "RESTARTING" and e.t >= killed["t"])
        assert [e.reason for e in restarts] == [f"handover to {sh.sid}"], "a cold restart instead of the standby"
        # The standby now serves for good: actor running, at v1, registered with the router.
        assert fm.slots["engine-0"].info.url == sh.info.url and not sh.frozen
        assert proc_state(sh.info.actor_pid) != "T"
        assert await asyncio.wait_for(sh.actor.weight_version.remote(), 10) == "v1"
        await events.wait_for(lambda e: e.kind == "registered" and e.subject == "engine-0", 30, since=killed["t"])
        assert sh.info.url in await fm.router.worker_urls()
        assert not await _until_gone(killed["procs"], 15), "processes of the killed SGLang engine still run"
        # Its replacement is built in the background and parked the same way.
        new = await events.wait_for(lambda e: e.kind == "shadow_ready" and e.subject != sh.sid, 300,
                                    since=killed["t"])
        assert new.figures["version"] == "v1" and new.figures["frozen"] is True
    finally:
        await gen.aclose()
        for s in fm.shadows.ready if fm.shadows is not None else []:
            seen += _engine_processes(s.info.pid)  # a replacement standby that came up meanwhile
        await fm.shutdown()
    left = await _until_gone(seen, 20)
    assert not left, f"SGLang processes outlived the fleet: {left}"
