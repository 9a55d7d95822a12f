"""Planned drain vs waiting for an engine's requests to finish.

Two CPU engines behind the real sglang-router; --requests (16) greedy streaming requests of --tokens
tokens all start on engine A (the bench's selector places first attempts there), while engine B is idle.
Once the first of them has committed --cut-at tokens:
- wait arm: nothing is done; wait_s = that moment -> the last of A's requests finished, which is when A holds
  no request (what taking A out politely costs without a drain);
- drain arm (same requests, same moment): FleetManager.drain(A); moved_s = the drain call -> no request left
  on A (the same end point as wait_s: A can be taken out), drain_s = -> every moved request has committed
  its first token on B (the drain is complete for its clients), stop_s = -> A stopped and gone from the fleet.
The ratio compares the same end point in both arms: wait_s / moved_s. Each arm also reports finish_s, the cut
-> every request finished (on any engine), another common end point: what the drain costs the requests.
"One prefill" (prefill_s) is the time to first token of the same --requests requests started together on
an idle engine at the length they are resumed at. Ids are compared with the wait arm, and tokens
regenerated are counted from the engines' own counters (generated_tokens vs committed). A fresh engine
joins (scale_out) between repeats.
Last line: RESULT drain_s=.. wait_s=.. moved_s=.. ratio=wait_s/moved_s finish_wait_s=.. finish_drain_s=..
  prefill_s=.. goal_met=(drain_s <= prefill_s + 0.2)
Usage: python bench/drain.py [--quick] [--requests 16] [--tokens N] [--cut-at K] [--repeats R]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from belayer_plugin.config import load_belayer_config  # noqa: E402
from belayer_plugin.events import EventLog  # noqa: E402
from belayer_plugin.fleet.launch import resolve_model_path  # noqa: E402
from belayer_plugin.fleet.manager import FleetManager  # noqa: E402
from belayer_plugin.generation.resumable import FleetSelector, ResumableGenerator, Target  # noqa: E402
from belayer_plugin.ray_cluster import init_ray  # noqa: E402


class FirstOn(FleetSelector):
    """Places every first attempt on one engine (while it serves); resumed segments go anywhere else."""

    def __init__(self, fleet: FleetManager):
        super().__init__(fleet)
        self.first = ""

    async def pick(self, exclude: set[str], timeout: float) -> Target:
        s = self.fleet.slots.get(self.first)
        if not exclude and s is not None and s in self.fleet.serving_slots():
            s.inflight += 1
            return Target(s.slot_id, s.info.url, s.health.incarnation)
        return await super().pick(exclude, timeout)


def prompts(n: int) -> list[list[int]]:
    return [[54 + i, 280, 387 + 5 * i, 423, 442 - i] for i in range(n)]


def counters(url: str) -> dict:
    return httpx.get(f"{url}/get_server_info", timeout=10).json()["belayer_counters"]


async def arm(fm: FleetManager, gen: ResumableGenerator, sel: FirstOn, args, drain: bool) -> dict:
    """One run of the requests on engine A, drained or not at the cut."""
    victim = min(fm.serving_slots(), key=lambda s: int(s.slot_id.rsplit("-", 1)[1]))
    other = [s for s in fm.serving_slots() if s is not victim]
    sel.first = victim.slot_id
    sp = {"max_new_tokens": args.tokens, "temperature": 0.0, "ignore_eos": True}
    base = {s.slot_id: counters(s.info.url)["generated_tokens"] for s in [victim, *other]}
    marks: dict = {}
    first_after: dict[str, float] = {}

    def on_moved(e):  # the engine is still up at this event: read what it generated
        if e.kind == "requests_moved" and e.subject == victim.slot_id:
            marks["victim_generated"] = counters(victim.info.url)["generated_tokens"] - base[victim.slot_id]

    fm.events.subscribe(on_moved)

    def progress(log, seg):
        if "cut" not in marks and log.committed >= args.cut_at:
            marks["cut"] = time.monotonic()
            if drain:
                marks["task"] = asyncio.ensure_future(fm.drain(victim.slot_id))
        if seg.engine != victim.slot_id and log.rid not in first_after:
            first_after[log.rid] = time.monotonic()

    outs = await asyncio.gather(*(gen.generate(f"{'d' if drain else 'w'}{i}", p, sp, on_progress=progress)
                                  for i, p in enumerate(prompts(args.requests))))
    t_end = time.monotonic()
    res = {"ids": [log.output_ids for log, _ in outs], "finish_s": t_end - marks["cut"]}
    on = {}
    for log, _ in outs:
        for g in log.segments:
            on[g.engine] = on.get(g.engine, 0) + g.end - g.start
    if drain:
        r = await marks["task"]
        moved_ev = fm.events.find(lambda e: e.kind == "requests_moved" and e.subject == victim.slot_id)[-1]
        moved_rids = [log.rid for log, _ in outs if len(log.segments) > 1]
        res.update(moved=r["moved"], moved_s=moved_ev.figures["took_s"], stop_s=r["took_s"],
                   drain_s=max(first_after[rid] for rid in moved_rids) - marks["cut"],
                   regenerated=(marks["victim_generated"] - on.get(victim.slot_id, 0))
                   + sum(counters(s.info.url)["generated_tokens"] - base[s.slot_id] - on.get(s.slot_id, 0)
                         for s in other))
    else:
        res["wait_s"] = t_end - marks["cut"]
    return res


async def prefill(fm: FleetManager, gen: ResumableGenerator, sel: FirstOn, args) -> float:
    """Time to first token of `requests` requests started together on an idle engine, at the resumed length."""
    s = max(fm.serving_slots(), key=lambda s: int(s.slot_id.rsplit("-", 1)[1]))
    sel.first = s.slot_id
    sp = {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}
    t0 = time.monotonic()
    pad = list(range(100, 100 + args.cut_at))
    await asyncio.gather(*(gen.generate(f"p{i}-{t0}", p + pad, sp) for i, p in enumerate(prompts(args.requests))))
    return time.monotonic() - t0


async def main_async(args) -> None:
    overrides = ["belayer.use_fault_tolerance=true", "belayer.shadow.num_standby=0",
                 f"belayer.engines.cpu_step_delay_ms={args.step_delay_ms}",
                 f"belayer.engines.max_running_requests={max(16, args.requests)}",
                 "belayer.monitor.boot_grace_s=0", "belayer.recovery.stall_timeout_s=60",
                 # Measures the drain, not detection: generous probes, so a loaded machine's slow steps
                 # (16 requests decoded together) are not taken for a hang in either arm.
                 "belayer.monitor.probe_timeout_s=30", "belayer.monitor.failure_threshold=3",
                 "belayer.monitor.progress.enabled=false"]
    cfg, _ = load_belayer_config("fleet_demo", overrides)
    init_ray(cfg.ray)
    run_dir = Path(tempfile.mkdtemp(prefix="belayer-bench-drain-"))
    fm = FleetManager(cfg, run_dir, EventLog(run_dir / "events.jsonl"), model_path=resolve_model_path(cfg))
    await fm.start()
    sel = FirstOn(fm)
    gen = ResumableGenerator(sel, cfg.recovery, fm.events)
    rows = []
    try:
        pre = statistics.median([await prefill(fm, gen, sel, args) for _ in range(3)])
        print(f"{args.requests} requests x {args.tokens} tokens on one engine, cut at token {args.cut_at}, "
              f"{args.step_delay_ms} ms emulated step latency; one prefill of {args.requests} requests: {pre:.3f} s")
        for rep in range(args.repeats):
            w = await arm(fm, gen, sel, args, drain=False)
            d = await arm(fm, gen, sel, args, drain=True)
            same = d["ids"] == w["ids"]
            rows.append((d["drain_s"], w["wait_s"], d["moved_s"], d["stop_s"], d["regenerated"], same, d["moved"],
                         w["finish_s"], d["finish_s"]))
            print(f"repeat {rep + 1}: moved {d['moved']} request(s); engine free of requests: drained "
                  f"{d['moved_s']:.3f} s vs waiting {w['wait_s']:.3f} s (moved requests' first token on the other "
                  f"engine {d['drain_s']:.3f} s, engine stopped {d['stop_s']:.3f} s); every request finished: "
                  f"drained {d['finish_s']:.3f} s vs waiting {w['finish_s']:.3f} s; tokens regenerated "
                  f"{d['regenerated']}; ids identical: {same}")
            if rep + 1 < args.repeats:
                await fm.scale_out(1)
    finally:
        await gen.aclose()
        await fm.shutdown()
    med = lambda i: statistics.median(r[i] for r in rows)  # noqa: E731
    drain_s, wait_s, moved_s = med(0), med(1), med(2)
    # the ratio on one end point in both arms: the engine holds no request (before: drain_s, the moved requests'
    # first token, against wait_s, which grew with the request length by construction)
    print(f"RESULT drain_s={drain_s:.3f} wait_s={wait_s:.3f} moved_s={moved_s:.3f} ratio={wait_s / moved_s:.1f} "
          f"finish_wait_s={med(7):.3f} finish_drain_s={med(8):.3f} prefill_s={pre:.3f} "
          f"goal_met={drain_s <= pre + 0.2} stop_s={med(3):.3f} "
          f"regenerated={max(r[4] for r in rows)} ids_identical={all(r[5] for r in rows)} "
          f"moved={min(r[6] for r in rows)} repeats={len(rows)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=0)
    ap.add_argument("--cut-at", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=0)
    ap.add_argument("--step-delay-ms", type=float, default=5.0)
    args = ap.parse_args()
    args.tokens = args.tokens or (192 if args.quick else 512)
    args.repeats = args.repeats or (1 if args.quick else 3)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
