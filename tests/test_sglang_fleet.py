"""Fleet recovery and token-level recovery against real SGLang 0.5.23 on CPU.

One FleetManager of two SGLang engines behind the real sglang-router serves the whole module (each
SGLang start costs ~25-45 s on two cores). One SIGKILL of an engine's process group, mid-generation,
covers both recovery paths:

1. token level: concurrent streaming and non-streaming greedy requests through the GenerationFront (and
   one through the in-process ResumableGenerator) complete once each, with the fault-free ids, their rids
   and without regenerating a committed token;
2. fleet level: the dead engine is detected, deregistered from the router before it is fenced, every
   process of it is gone, and its replacement is started at weight version "default", refit through
   /update_weights_from_disk to the fleet's "v1" (perturbed weights, so a version label alone would not
   pass), and only then HEALTHY, registered and served through the router.

Skipped only when .venv-sglang is absent (a broken venv fails).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import psutil
import pytest
import pytest_asyncio

from belayer_plugin.events import EventLog
from belayer_plugin.fleet.manager import FleetManager
from belayer_plugin.generation.front import GenerationFront
from belayer_plugin.generation.resumable import FleetSelector, ResumableGenerator
from belayer_plugin.generation.sglang_http import generate, generate_stream
from tests.conftest import belayer_cfg
from tests.test_sglang_engine import needs_sglang

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]

PROMPTS = [[54, 280, 487, 423, 442], [60, 61, 62], [100, 200, 300, 400], [7, 8, 9, 10, 11, 12], [33, 34, 35]]
N = 300
# Token of request s0 at which its engine is SIGKILLed. Early on purpose: SGLang batches the five requests
# and can run far ahead of what the front has committed; a late kill could land after s0 finished.
KILL_AT = 30
GREEDY = {"max_new_tokens": N, "temperature": 0.0, "ignore_eos": True}
SGLANG = [
    "belayer.engines.kind=sglang",
    "belayer.engines.startup_timeout_s=180",
    "belayer.use_fault_tolerance=true",
    "belayer.shadow.num_standby=0",
    "belayer.monitor.probe_interval_s=1",
    "belayer.monitor.probe_timeout_s=5",  # /health_generate takes >= 1 s on CPU, more while others start
    "belayer.monitor.failure_threshold=2",
    "belayer.monitor.boot_grace_s=5",
    "belayer.monitor.liveness_timeout_s=2",
    "belayer.restart.backoff_initial_s=0",
    "belayer.restart.backoff_max_s=0",
    "belayer.router.membership_timeout_s=10",
    "belayer.recovery.stall_timeout_s=60",
]


def _perturbed_copy(model: str, dest: Path) -> str:
    """The tiny model with other weights (same architecture and tokenizer): what a training step makes."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, dest)
    sd = load_file(str(dest / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    save_file({k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in sd.items()},
              str(dest / "model.safetensors"))
    return str(dest)


def _engine_processes(pid: int) -> list[psutil.Process]:
    """An SGLang server: its leader, every descendant (scheduler, detokenizer) and its process group."""
    procs: dict[int, psutil.Process] = {}
    try:
        leader = psutil.Process(pid)
        procs[pid] = leader
        for c in leader.children(recursive=True):
            procs[c.pid] = c
    except psutil.NoSuchProcess:
        pass
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pid:
                procs.setdefault(p.pid, p)
        except OSError:
            pass
    return list(procs.values())


def _running(procs: list[psutil.Process]) -> list[str]:
    """Those still running (a zombie runs nothing); is_running() also guards against pid reuse."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {p.name()} pgid={os.getpgid(p.pid)}")
        except (psutil.NoSuchProcess, OSError):
            pass
    return out


async def _until_gone(procs: list[psutil.Process], timeout: float) -> list[str]:
    """Waits (bounded) until none of `procs` runs; returns what still runs. Exits raise no event here."""
    deadline = time.monotonic() + timeout
    while (left := _running(procs)) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return left


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sg(ray_cluster, tmp_path_factory, tiny_model):
    run_dir = tmp_path_factory.mktemp("sglang-fleet")
    v1 = _perturbed_copy(tiny_model, run_dir / "weights-v1")
    cfg = belayer_cfg(*SGLANG)
    events = EventLog(run_dir / "events.jsonl")
    fm = FleetManager(cfg, run_dir, events, model_path=tiny_model)
    front = None
    incarnations: list[psutil.Process] = []  # every process of every engine incarnation the module saw
    events.subscribe(lambda e: e.kind == "transition" and e.to_state == "STALE"
                     and incarnations.extend(_engine_processes(fm.slots[e.subject].info.pid)))
    gen = ResumableGenerator(FleetSelector(fm), cfg.recovery, events)
    try:
        await fm.start()
        front = GenerationFront(gen, tiny_model, info_url=lambda: fm.pick_engine().info.url)
        await front.start()
        yield SimpleNamespace(fm=fm, gen=gen, front=front, events=events, v1=v1, model=tiny_model,
                              run_dir=run_dir, golden=None, base=None, killed={})
    finally:
        if front is not None:
            await front.stop()
        await gen.aclose()  # its stream session: unclosed, aiohttp warns when it is collected
        await fm.shutdown()
    left = await _until_gone(incarnations, 20)
    assert not left, f"SGLang processes outlived the fleet: {left}"


def ev(kind, subject=None, to=None):
    return lambda e: e.kind == kind and (subject is None or e.subject == subject) and (to is None or e.to_state == to)


async def _ids(url: str, prompt: list[int], sp: dict = GREEDY) -> dict:
    async with httpx.AsyncClient() as c:
        return await generate(c, url, {"input_ids": prompt, "sampling_params": sp}, 120)


async def _to_v1_with_golden(sg) -> None:
    """Refits the fleet to v1 (other weights) and computes the fault-free ids on it, once per module."""
    if sg.golden is not None:
        return
    e0 = sg.fm.slots["engine-0"].info.url
    sg.base = (await _ids(e0, PROMPTS[0]))["output_ids"]
    served = await sg.fm.refit(sg.v1, "v1")
    assert served == {"engine-0": "v1", "engine-1": "v1"}, _story(sg.events)
    outs = [await _ids(e0, p) for p in PROMPTS]  # one at a time: the fault-free run
    assert {o["meta_info"]["weight_version"] for o in outs} == {"v1"}
    sg.golden = [o["output_ids"] for o in outs]
    assert sg.golden[0] != sg.base, "the refit did not change the weights"
    assert all(len(g) == N for g in sg.golden) and len(set(sg.golden[0])) > 20  # not collapsed onto a token
    e1 = sg.fm.slots["engine-1"].info.url
    assert (await _ids(e1, PROMPTS[0]))["output_ids"] == sg.golden[0]


def _story(events: EventLog) -> str:
    """The fleet's events, one per line: a failed assertion says what the engines went through."""
    t0 = events.events[0].t if events.events else 0.0
    return "\n".join(f"{e.t - t0:8.2f} {e.subject} {e.kind} {e.from_state or ''}->{e.to_state or ''} "
                     f"{e.reason} {e.figures}"[:300] for e in events.events if e.component != "recovery")


def _kill_group(sg, slot_id: str, seen: int) -> None:
    """SIGKILLs the process group of `slot_id`'s SGLang server, recording what is needed to check it."""
    info = sg.fm.slots[slot_id].info
    procs = _engine_processes(info.pid)
    assert len(procs) >= 3, f"expected the server and its scheduler and detokenizer: {procs}"
    # The fleet fences with killpg: a child in another group would outlive a hung (SIGSTOPped) leader.
    groups = {p.pid: os.getpgid(p.pid) for p in procs}
    assert set(groups.values()) == {info.pid}, f"SGLang processes outside the server's process group: {groups}"
    sg.killed.update(slot=slot_id, url=info.url, pid=info.pid, procs=procs, seen=seen, t=time.time(),
                     info=info)
    os.killpg(info.pid, signal.SIGKILL)


@needs_sglang
async def test_sigkill_mid_generation_every_request_completes_with_golden_ids_nothing_regenerated(sg):
    await _to_v1_with_golden(sg)
    gen, front = sg.gen, sg.front

    def kill(clog, seg):  # at token KILL_AT of s0, as the generator commits it
        if clog.rid == "s0" and not sg.killed and clog.committed >= KILL_AT:
            _kill_group(sg, seg.engine, clog.committed)

    gen.observers.append(kill)
    try:
        async with httpx.AsyncClient() as c:
            async def streamed(i):
                chunks = []
                async for ch in generate_stream(c, front.url, {"input_ids": PROMPTS[i], "sampling_params": GREEDY,
                                                                "rid": f"s{i}", "return_logprob": True}, 120):
                    chunks.append(ch)
                return chunks[-1]

            async def plain(i):
                return await generate(c, front.url, {"input_ids": PROMPTS[i], "sampling_params": GREEDY,
                                                     "rid": f"p{i}", "return_logprob": True}, 300)

            async def in_process(i):
                clog, resp = await gen.generate(f"g{i}", PROMPTS[i], GREEDY, return_logprob=True)
                return resp

            outs = await asyncio.wait_for(
                asyncio.gather(streamed(0), streamed(1), plain(2), plain(3), in_process(4)), 300)
    finally:
        gen.observers.remove(kill)
    assert sg.killed, "the kill never happened"
    rids = ["s0", "s1", "p2", "p3", "g4"]
    for i, out in enumerate(outs):
        assert out["output_ids"] == sg.golden[i], f"request {rids[i]} differs from the fault-free run"
        meta = out["meta_info"]
        assert meta["id"] == rids[i]
        assert meta["finish_reason"] == {"type": "length", "length": N}
        assert [t[1] for t in meta["output_token_logprobs"]] == sg.golden[i]
        assert meta["weight_version"] == "v1"
        segs = meta["belayer"]["segments"]
        # Each token was committed once: the segments tile [0, N) without overlap or gap.
        assert segs[0]["start"] == 0 and segs[-1]["end"] == N
        assert all(a["end"] == b["start"] for a, b in zip(segs, segs[1:])), segs
        assert all(s["url"] != sg.killed["url"] for s in segs[1:]), "resumed on the dead engine"
    segs0 = outs[0]["meta_info"]["belayer"]["segments"]
    assert len(segs0) == 2 and segs0[0]["url"] == sg.killed["url"]
    assert segs0[0]["outcome"].startswith("failed")
    assert segs0[1]["start"] >= sg.killed["seen"], "tokens streamed before the kill were generated again"
    resumed = {e.subject for e in sg.events.find(ev("resumed"))}
    assert "s0" in resumed
    # Exactly the requests that were on the killed engine resumed (least-loaded placement put some there).
    on_killed = {rids[i] for i, o in enumerate(outs) if o["meta_info"]["belayer"]["segments"][0]["url"] == sg.killed["url"]}
    assert resumed == on_killed and len(on_killed) >= 2


@needs_sglang
async def test_killed_engine_is_detected_deregistered_fenced_replaced_refit_to_v1_and_routable(sg):
    fm, events = sg.fm, sg.events
    if not sg.killed:  # run on its own: same fault, outside any request
        await _to_v1_with_golden(sg)
        _kill_group(sg, "engine-0", 0)
    k = sg.killed
    sid, t0, old = k["slot"], k["t"], k["info"]

    det = await events.wait_for(ev("detected", sid), 10, since=t0)
    assert det.t - t0 < 2.0, f"detection took {det.t - t0:.3f} s"
    # Ray liveness (the server's exit) or refused probes, whichever lands first: both are immediate.
    assert det.figures["signal"] in ("liveness_lost", "probe_failed"), det
    left = await _until_gone(k["procs"], 15)
    assert not left, f"processes of the killed SGLang engine still run: {left}"

    await events.wait_for(ev("registered", sid), 240, since=t0)
    episode = [e for e in events.events if e.t >= t0 and e.subject == sid]
    order = [e.kind if e.kind != "transition" else e.to_state for e in episode]
    assert order.index("DEAD") < order.index("deregistered") < order.index("killed") \
        < order.index("RESTARTING") < order.index("STALE") < order.index("HEALTHY") < order.index("registered"), order
    assert order.count("RESTARTING") == 1 and "refit_failed" not in order and "weight_version_mismatch" not in order
    healthy = next(e for e in episode if e.kind == "transition" and e.to_state == "HEALTHY")
    assert "v1" in healthy.reason

    slot = fm.slots[sid]
    new = slot.info
    assert new.url != old.url and new.pid != old.pid
    assert new.weight_version == "default", "the replacement must start from the base weights"
    assert await slot.actor.weight_version.remote() == "v1"
    assert fm.states() == {"engine-0": "HEALTHY", "engine-1": "HEALTHY"}
    assert await fm.router.worker_urls() == {s.info.url for s in fm.slots.values()}
    assert await fm.verify_versions() == {"engine-0": "v1", "engine-1": "v1"}

    # Its weights are v1's, not just the label: the same ids as the fault-free v1 run, not the base model's.
    direct = await _ids(new.url, PROMPTS[0])
    assert direct["output_ids"] == sg.golden[0] != sg.base
    assert direct["meta_info"]["weight_version"] == "v1"

    # Routable: requests through the router reach it. Each prompt is new to every engine (distinct first
    # token, so no shared prefix); the engine that served one through the router has it in its radix
    # cache, and says so in cached_tokens when asked again.
    prompts = [[400 + j] + list(range(200 + 10 * j, 220 + 10 * j)) for j in range(4)]
    short = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    async with httpx.AsyncClient() as c:
        via = [await generate(c, fm.url, {"input_ids": p, "sampling_params": short, "rid": f"route-{j}"}, 60)
               for j, p in enumerate(prompts)]
        assert [v["meta_info"]["id"] for v in via] == [f"route-{j}" for j in range(4)]
        assert {v["meta_info"]["weight_version"] for v in via} == {"v1"}
        cached = {url: [(await generate(c, url, {"input_ids": p, "sampling_params": short}, 60))
                        ["meta_info"]["cached_tokens"] for p in prompts]
                  for url in (new.url, fm.slots[_other(sid)].info.url)}
    served_new = [j for j in range(4) if cached[new.url][j] > 0]
    served_other = [j for j in range(4) if cached[fm.slots[_other(sid)].info.url][j] > 0]
    assert served_new, f"the router sent nothing to the replacement (cached tokens: {cached})"
    assert sorted(served_new + served_other) == [0, 1, 2, 3], cached  # each request served exactly once


def _other(sid: str) -> str:
    return "engine-1" if sid == "engine-0" else "engine-0"



@needs_sglang
async def test_a_refit_that_meets_a_request_still_in_the_engine_waits_for_it_and_loads_without_a_restart(sg):
    """SGLang loads the weights but answers 400, keeping the old version label, while a request is still in
    its scheduler (one a client abandoned just before the refit, as after a partial rollout's abort). Here
    an in-place pause holds it there, so that the case is certain. The fleet waits for it to drain and loads
    again: every engine serves the new weights, none is fenced or restarted."""
    fm, events = sg.fm, sg.events
    await _to_v1_with_golden(sg)
    assert fm.states() == {"engine-0": "HEALTHY", "engine-1": "HEALTHY"}, _story(events)
    url = fm.slots["engine-0"].info.url
    long = {"max_new_tokens": 3000, "temperature": 0.0, "ignore_eos": True}
    streaming = asyncio.Event()

    async def stream(c: httpx.AsyncClient) -> None:
        n = 0
        async with c.stream("POST", f"{url}/generate", json={"input_ids": [5, 6, 7], "stream": True,
                                                              "sampling_params": long}) as r:
            async for _ in r.aiter_lines():
                n += 1
                if n == 20:
                    streaming.set()

    async with httpx.AsyncClient(timeout=120) as c:
        held = asyncio.create_task(stream(c))
        try:
            await asyncio.wait_for(streaming.wait(), 60)
            assert (await c.post(f"{url}/pause_generation", json={"mode": "in_place"})).status_code == 200
            t0 = time.time()
            # Version "v2": the base weights again, so what each engine then generates shows what it holds.
            refit = asyncio.create_task(fm.refit(sg.model, "v2"))
            refused = await events.wait_for(ev("refit_refused", "engine-0"), 60, since=t0)
            assert "cache was not flushed" in refused.reason, refused
        finally:
            held.cancel()  # the client goes away: SGLang aborts the request once it runs again
            await asyncio.gather(held, return_exceptions=True)
            assert (await c.post(f"{url}/continue_generation", json={})).status_code == 200
        served = await asyncio.wait_for(refit, 120)
    story = _story(events)
    assert served == {"engine-0": "v2", "engine-1": "v2"}, story
    episode = [e for e in events.events if e.t >= t0]
    assert [e.subject for e in episode if e.kind == "refit_refused"] == ["engine-0"], story
    assert not [e for e in episode if e.kind in ("weight_version_mismatch", "refit_failed", "killed")
                or e.to_state in ("DEAD", "RESTARTING")], story
    assert fm.states() == {"engine-0": "HEALTHY", "engine-1": "HEALTHY"}, story
    for s in fm.slots.values():
        out = await _ids(s.info.url, PROMPTS[0])
        assert out["meta_info"]["weight_version"] == "v2"
        assert out["output_ids"] == sg.base, f"{s.slot_id} does not serve the weights v2 names"
