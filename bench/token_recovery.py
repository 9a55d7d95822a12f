"""Token-level resume vs the router's request-level retry, and the front's failure-free overhead.

1. A long greedy request whose engine is SIGKILLed at 50% and at 90% of its tokens: time to finish with
   Belayer's token-level resume (ResumableGenerator over the fleet) vs sglang-router with retries on
   (it re-runs the request from token 0 on another worker). Fault-free time printed for reference.
2. Failure-free throughput of concurrent requests through Belayer's /generate front vs straight to the
   router: the overhead ratio.
The CPU engine emulates a real model's per-step latency with --step-delay-ms (default 5 ms), since the
tiny model decodes in ~0.5 ms and would make any client look expensive.
Usage: python bench/token_recovery.py [--quick] [--tokens N] [--step-delay-ms D]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
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
from belayer_plugin.generation.front import GenerationFront  # noqa: E402
from belayer_plugin.generation.resumable import FleetSelector, ResumableGenerator  # noqa: E402
from belayer_plugin.generation.sglang_http import generate, get_json  # noqa: E402
from belayer_plugin.ray_cluster import init_ray  # noqa: E402

PROMPT = [54, 280, 487, 423, 442]


async def _engine_running(c: httpx.AsyncClient, fm: FleetManager, rid: str) -> object:
    """The engine the router sent request `rid` to (bounded wait)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for s in fm.serving_slots():
            info = await get_json(c, s.info.url, "/get_server_info", 5)
            if rid in info.get("running_rids", []):
                return s
        await asyncio.sleep(0.002)
    raise TimeoutError(f"request {rid} never started")


async def router_retry(fm: FleetManager, n: int, frac: float, t_ff: float) -> float:
    """The router re-runs the whole request elsewhere when its worker dies (retries enabled)."""
    sp = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
    async with httpx.AsyncClient() as c:
        t0 = time.monotonic()
        rid = f"retry-{time.time()}"
        task = asyncio.create_task(generate(c, fm.url, {"input_ids": PROMPT, "sampling_params": sp, "rid": rid}, 600))
        slot = await _engine_running(c, fm, rid)
        await asyncio.sleep(max(0.0, t_ff * frac - (time.monotonic() - t0)))  # the kill point, by time
        os.kill(slot.info.pid, signal.SIGKILL)
        out = await task
        assert len(out["output_ids"]) == n
        return time.monotonic() - t0


async def token_resume(fm: FleetManager, gen: ResumableGenerator, n: int, frac: float) -> float:
    sp = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
    killed = []

    def kill(clog, seg):
        if not killed and clog.committed >= int(n * frac):
            killed.append(clog.committed)
            os.kill(fm.slots[seg.engine].info.pid, signal.SIGKILL)

    t0 = time.monotonic()
    clog, resp = await gen.generate(f"bench-{time.time()}", PROMPT, sp, on_progress=kill)
    assert len(resp["output_ids"]) == n and killed
    return time.monotonic() - t0


async def throughput(url: str, n_req: int, n: int, rounds: int) -> float:
    sp = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
    rates = []
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=200)) as c:
        for _ in range(rounds):
            t0 = time.monotonic()
            outs = await asyncio.gather(*(generate(c, url, {"input_ids": PROMPT + [i % 50], "sampling_params": sp}, 600)
                                          for i in range(n_req)))
            rates.append(sum(len(o["output_ids"]) for o in outs) / (time.monotonic() - t0))
    return statistics.median(rates)


async def main_async(args) -> None:
    overrides = ["belayer.use_fault_tolerance=true", "belayer.shadow.num_standby=0",
                 f"belayer.engines.cpu_step_delay_ms={args.step_delay_ms}", "belayer.restart.backoff_initial_s=0",
                 "belayer.restart.max_restarts=100", "belayer.monitor.boot_grace_s=0",
                 "belayer.router.disable_retries=false"]
    cfg, _ = load_belayer_config("fleet_demo", overrides)
    init_ray(cfg.ray)
    run_dir = Path(tempfile.mkdtemp(prefix="belayer-bench-tokens-"))
    fm = FleetManager(cfg, run_dir, EventLog(run_dir / "events.jsonl"), model_path=resolve_model_path(cfg))
    await fm.start()
    gen = ResumableGenerator(FleetSelector(fm), cfg.recovery, fm.events)
    front = GenerationFront(gen, fm.model_path)
    await front.start()
    n = args.tokens
    figures = []
    try:
        async with httpx.AsyncClient() as c:
            t0 = time.monotonic()
            await generate(c, fm.url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": n, "temperature": 0.0,
                                                                              "ignore_eos": True}}, 600)
            t_ff = time.monotonic() - t0
        print(f"{n}-token greedy request, {args.step_delay_ms} ms emulated step latency; fault-free {t_ff:.2f} s")
        for frac in (0.5, 0.9):
            tok, ret = [], []
            for _ in range(args.repeats):
                await fm.wait_all_healthy(300)
                tok.append(await token_resume(fm, gen, n, frac))
                await fm.wait_all_healthy(300)
                ret.append(await router_retry(fm, n, frac, t_ff))
            tm, rm = statistics.median(tok), statistics.median(ret)
            print(f"killed at {int(frac * 100)}%: token-level resume {tm:.2f} s | router retry from token 0 {rm:.2f} s "
                  f"| {rm / tm:.2f}x faster")
            figures.append(f"resume{int(frac * 100)}_s={tm:.2f} retry{int(frac * 100)}_s={rm:.2f} "
                           f"speedup{int(frac * 100)}={rm / tm:.2f}")
        await fm.wait_all_healthy(300)
        n_req, tp_tokens = (8, 128) if args.quick else (16, 256)
        rounds = 3 if args.quick else 5
        via_router, via_front = [], []
        for _ in range(2):  # interleaved, so drift hits both paths alike
            via_router.append(await throughput(fm.url, n_req, tp_tokens, rounds))
            via_front.append(await throughput(front.url, n_req, tp_tokens, rounds))
        r, f = statistics.median(via_router), statistics.median(via_front)
        overhead = (r - f) / r * 100
        print(f"failure-free throughput, {n_req} concurrent x {tp_tokens} tokens: router {r:.0f} tok/s | "
              f"front {f:.0f} tok/s | overhead {overhead:.2f}% (goal <= 2%)")
        figures.append(f"router_tok_s={r:.0f} front_tok_s={f:.0f} front_overhead_pct={overhead:.2f}")
    finally:
        await front.stop()
        await fm.shutdown()
    print("RESULT " + " ".join(figures))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tokens", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=0)
    ap.add_argument("--step-delay-ms", type=float, default=5.0)
    args = ap.parse_args()
    args.tokens = args.tokens or (400 if args.quick else 1500)
    args.repeats = args.repeats or (1 if args.quick else 3)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
