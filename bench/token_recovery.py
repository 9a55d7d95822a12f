"""Token-level resume vs the router's request-level retry, and the front's failure-free overhead.

1. A long greedy request whose engine is SIGKILLed at 50% and at 90% of its tokens: Belayer's token-level
   resume (ResumableGenerator over the fleet) vs sglang-router with retries on (its default: it re-runs the
   request from token 0 on another worker). Timed as kill -> finish (what the fault costs: the figure a
   user feels) and submit -> finish, --repeats times each (medians and spread), the fault-free time
   printed. Both arms kill at the same point, read from the engine's own counter (generated_tokens reaching
   int(N * fraction)), not from the client's commits. Tokens regenerated are counted from the engines' own
   counters, the same way in both arms and never floored: the victim's count at the kill plus what the
   survivors generated for the request, minus the N tokens it needed. The killed engine is restarted cold in
   both arms (no standby), competing for the same cores.
2. Failure-free throughput of 16 concurrent requests through Belayer's /generate front vs straight to the
   router, in interleaved pairs of rounds (the order alternates): the median of the pairs' overheads.
   Twice: streaming clients (front_overhead_pct: the engines stream a chunk per token on both paths) and
   non-streaming clients (front_overhead_nonstream_pct: only the front path makes the engines stream, since
   the front commits tokens from the stream, so the engines' own per-chunk cost lands on that path).
   CPU seconds per generated token are read from /proc for the engines, the router and this process.
The CPU engine emulates a real model's per-step latency with --step-delay-ms (default 5 ms), since the
tiny model decodes in ~0.5 ms and would make any client look expensive.
Last line: RESULT ratio=.. (kill -> finish at a 90% kill, retry / resume) ... front_overhead_pct=..
front_overhead_nonstream_pct=..
Usage: python bench/token_recovery.py [--quick] [--tokens N] [--repeats R] [--step-delay-ms D] [--front-only]
       [--stream-interval K]   (K > 1: a chunk every K tokens; a kill may then regenerate up to K - 1 tokens)
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

import aiohttp
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bootstrap  # noqa: E402  (bench/, the script's own directory)
from belayer_plugin.config import load_belayer_config  # noqa: E402
from belayer_plugin.events import EventLog  # noqa: E402
from belayer_plugin.fleet.launch import resolve_model_path  # noqa: E402
from belayer_plugin.fleet.manager import FleetManager  # noqa: E402
from belayer_plugin.generation.front import GenerationFront  # noqa: E402
from belayer_plugin.generation.resumable import FleetSelector, ResumableGenerator  # noqa: E402
from belayer_plugin.generation.sglang_http import GenerateError, generate, generate_stream, get_json  # noqa: E402
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


async def counters(fm: FleetManager) -> dict[str, int]:
    """generated_tokens of every serving engine incarnation (keyed by URL: a restart starts from zero)."""
    out = {}
    async with httpx.AsyncClient() as c:
        for s in fm.serving_slots():
            try:
                info = await get_json(c, s.info.url, "/get_server_info", 5)
            except GenerateError:  # the engine just killed, not yet out of the serving set: nothing to count
                continue
            out[s.info.url] = int(info.get("belayer_counters", {}).get("generated_tokens", 0))
    return out


def generated_since(before: dict[str, int], after: dict[str, int], victim_url: str) -> int:
    """Tokens the engines other than the killed incarnation generated between two readings."""
    return sum(v - before.get(u, 0) for u, v in after.items() if u != victim_url)


class TrialMissed(RuntimeError):
    """The fault did not land where the trial needs it; the trial is run again."""


async def retrying(make, tries: int = 3):
    for i in range(tries):
        try:
            return await make()
        except TrialMissed as e:
            print(f"  (trial missed: {e}; again)")
            if i == tries - 1:
                raise


async def router_retry(fm: FleetManager, n: int, frac: float) -> tuple[float, float, int]:
    """The router re-runs the whole request elsewhere when its worker dies (retries enabled).
    Returns (submit -> finish, kill -> finish, tokens regenerated)."""
    sp = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
    before = await counters(fm)
    async with httpx.AsyncClient() as c:
        t0 = time.monotonic()
        rid = f"retry-{time.time()}"
        task = asyncio.create_task(generate(c, fm.url, {"input_ids": PROMPT, "sampling_params": sp, "rid": rid}, 600))
        slot = await _engine_running(c, fm, rid)
        victim, at_kill, t_kill, wall = await _kill_at_engine_count(c, fm, slot, before, n, frac, task)
        out = await task
        t_end = time.monotonic()
        # the fleet must have seen the death before the next trial waits for a full fleet
        await fm.events.wait_for(lambda e: e.kind == "detected" and e.subject == slot.slot_id, 60, since=wall)
    assert len(out["output_ids"]) == n
    return t_end - t0, t_end - t_kill, _regenerated(before, await counters(fm), victim, at_kill, n)


async def _kill_at_engine_count(c: httpx.AsyncClient, fm: FleetManager, slot, before: dict[str, int], n: int,
                                frac: float, task: asyncio.Task) -> tuple[str, int, float, float]:
    """SIGKILLs `slot`'s engine once its own generated_tokens counter shows int(n * frac) tokens of the one
    request it runs (the same kill point in both arms). Returns (its URL, its count at the kill, monotonic and
    wall time of the kill)."""
    want = before.get(slot.info.url, 0) + int(n * frac)
    count = before.get(slot.info.url, 0)
    while not task.done():
        info = await get_json(c, slot.info.url, "/get_server_info", 5)
        count = int(info.get("belayer_counters", {}).get("generated_tokens", 0))
        if count >= want:
            break
        await asyncio.sleep(0.002)  # a counter has no event to await; the request's end bounds this
    if task.done():
        raise TrialMissed("the request finished before the kill point")
    t_kill, wall = time.monotonic(), time.time()
    os.kill(slot.info.pid, signal.SIGKILL)
    return slot.info.url, count - before.get(slot.info.url, 0), t_kill, wall


def _regenerated(before: dict[str, int], after: dict[str, int], victim: str, at_kill: int, n: int) -> int:
    """Tokens generated more than once, from the engines' own counters: everything the engines generated for
    the request (the victim's count at the kill, a lower bound by the few tokens it may have decoded between
    that reading and the signal, plus the survivors') minus the n tokens it needed. Not floored: a negative
    value would say the counters and the request disagree."""
    return at_kill + generated_since(before, after, victim) - n


async def token_resume(fm: FleetManager, gen: ResumableGenerator, n: int, frac: float) -> tuple[float, float, int]:
    """Returns (submit -> finish, kill -> finish, tokens regenerated) of one request killed at `frac`, at the
    same kill point as the retry arm (the engine's own counter)."""
    sp = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
    first: asyncio.Future = asyncio.get_running_loop().create_future()

    def on_progress(clog, seg):
        if not first.done():
            first.set_result(seg.engine)

    before = await counters(fm)
    t0 = time.monotonic()
    task = asyncio.create_task(gen.generate(f"bench-{time.time()}", PROMPT, sp, on_progress=on_progress))
    async with httpx.AsyncClient() as c:
        engine = await asyncio.wait_for(asyncio.shield(first), 60)
        victim, at_kill, t_kill, _ = await _kill_at_engine_count(c, fm, fm.slots[engine], before, n, frac, task)
    clog, resp = await task
    t_end = time.monotonic()
    assert len(resp["output_ids"]) == n and len(clog.segments) > 1, "the request was not resumed"
    return t_end - t0, t_end - t_kill, _regenerated(before, await counters(fm), victim, at_kill, n)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds used so far by a process (its threads included); 0 once it is gone."""
    if pid == os.getpid():
        t = os.times()
        return t.user + t.system
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    except (OSError, IndexError, ValueError):
        return 0.0


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


async def stream_throughput(url: str, n_req: int, n: int, stream_interval: int) -> float:
    """Tokens per second of n_req concurrent streaming clients (each parses its newest chunk per read)."""
    sp = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
    if stream_interval > 1:
        sp["stream_interval"] = stream_interval  # the engines' work equal on both paths

    async def one(s: aiohttp.ClientSession, i: int) -> int:
        last: dict = {}
        async for last in generate_stream(s, url, {"input_ids": PROMPT + [i % 50], "sampling_params": sp}, 600):
            pass
        return len(last["output_ids"])

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        t0 = time.monotonic()
        outs = await asyncio.gather(*(one(s, i) for i in range(n_req)))
        return sum(outs) / (time.monotonic() - t0)


async def front_overhead(fm: FleetManager, front: GenerationFront, stream: bool, n_req: int, n: int, pairs: int,
                         stream_interval: int) -> tuple[float, float, float, list[float], dict, tuple[float, float]]:
    """Throughput straight to the router vs through the front, in interleaved pairs of rounds (the order
    alternates, so drift hits both alike); CPU seconds per component over each path's rounds."""
    via = {"router": [], "front": []}
    pids = {"engines": [s.info.pid for s in fm.serving_slots()], "router": [fm.router.proc.pid],
            "client+front": [os.getpid()]}
    cpu = {a: dict.fromkeys(pids, 0.0) for a in via}

    def sample() -> dict[str, float]:
        return {k: sum(map(cpu_seconds, v)) for k, v in pids.items()}

    for i in range(pairs):
        for arm in (("router", "front") if i % 2 == 0 else ("front", "router")):
            url = fm.url if arm == "router" else front.url
            c0 = sample()
            via[arm].append(await (stream_throughput(url, n_req, n, stream_interval) if stream
                                   else throughput(url, n_req, n, 1)))
            c1 = sample()
            for k in pids:
                cpu[arm][k] += c1[k] - c0[k]
    toks = pairs * n_req * n
    us = {a: {k: v / toks * 1e6 for k, v in d.items()} for a, d in cpu.items()}
    paired = sorted((a - b) / a * 100 for a, b in zip(via["router"], via["front"]))
    ci = bootstrap.interval(len(paired), lambda idx: statistics.median(paired[i] for i in idx))
    return (statistics.median(via["router"]), statistics.median(via["front"]), statistics.median(paired), paired, us,
            ci)


async def main_async(args) -> None:
    overrides = ["belayer.use_fault_tolerance=true", "belayer.shadow.num_standby=0",
                 f"belayer.engines.cpu_step_delay_ms={args.step_delay_ms}", "belayer.restart.backoff_initial_s=0",
                 "belayer.restart.max_restarts=100", "belayer.monitor.boot_grace_s=0",
                 "belayer.router.disable_retries=false", f"belayer.recovery.stream_interval={args.stream_interval}"]
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
        print(f"recovery.stream_interval={args.stream_interval}; "
              f"{n}-token greedy request, {args.step_delay_ms} ms emulated step latency; fault-free {t_ff:.2f} s; "
              f"{args.repeats} repeats per arm and kill point")
        ratio90 = float("nan")
        for frac in (() if args.front_only else (0.5, 0.9)):
            tok, ret = [], []
            for _ in range(args.repeats):  # interleaved: drift hits both arms alike
                await fm.wait_all_healthy(300)
                tok.append(await token_resume(fm, gen, n, frac))
                await fm.wait_all_healthy(300)
                ret.append(await retrying(lambda: router_retry(fm, n, frac)))
            med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
            spread = lambda xs, i: f"{min(x[i] for x in xs):.2f}..{max(x[i] for x in xs):.2f}"  # noqa: E731
            p = int(frac * 100)
            print(f"killed at {p}%: kill -> finish: token-level resume {med(tok, 1):.2f} s ({spread(tok, 1)}) | "
                  f"router retry {med(ret, 1):.2f} s ({spread(ret, 1)}) | {med(ret, 1) / med(tok, 1):.1f}x;  "
                  f"submit -> finish: {med(tok, 0):.2f} s vs {med(ret, 0):.2f} s;  tokens regenerated (engine "
                  f"counters): resume {max(x[2] for x in tok)} max, retry {med(ret, 2):.0f} (median)")
            figures.append(f"kill_finish{p}_resume_s={med(tok, 1):.2f} kill_finish{p}_retry_s={med(ret, 1):.2f} "
                           f"submit_finish{p}_resume_s={med(tok, 0):.2f} submit_finish{p}_retry_s={med(ret, 0):.2f} "
                           f"regenerated{p}_resume={max(x[2] for x in tok)}")
            if p == 90:
                ratio90 = med(ret, 1) / med(tok, 1)
        if not args.front_only:
            figures.insert(0, f"ratio={ratio90:.1f}")
        await fm.wait_all_healthy(300)
        n_req, tp_tokens = (16, 128) if args.quick else (16, 256)
        pairs = 6 if args.quick else 12
        for stream in (True, False):
            r, f, overhead, paired, us, ci = await front_overhead(fm, front, stream, n_req, tp_tokens, pairs,
                                                              args.stream_interval)
            kind = "streaming" if stream else "non-streaming"
            print("  CPU per generated token (us), router path | front path: " + "; ".join(
                f"{k} {us['router'][k]:.0f} | {us['front'][k]:.0f}" for k in us["router"]))
            print(f"failure-free throughput, {n_req} concurrent {kind} clients x {tp_tokens} tokens, {pairs} "
                  f"interleaved pairs of rounds: router {r:.0f} tok/s | front {f:.0f} tok/s | overhead "
                  f"{overhead:.2f}% (median of pairs; pairs {paired[0]:.1f}..{paired[-1]:.1f}%; 95% bootstrap interval "
                  f"{ci[0]:.2f}..{ci[1]:.2f}%)"
                  + (" (goal <= 2%)" if stream else ""))
            sfx = "" if stream else "_nonstream"
            figures.append(f"router_tok_s{sfx}={r:.0f} front_tok_s{sfx}={f:.0f} front_overhead{sfx}_pct={overhead:.2f} "
                           f"front_overhead{sfx}_ci95_lo_pct={ci[0]:.2f} front_overhead{sfx}_ci95_hi_pct={ci[1]:.2f} "
                           + " ".join(f"cpu_us_per_tok{sfx}_{k.replace('+', '_')}_{a}={us[a][k]:.0f}"
                                      for k in us["router"] for a in ("router", "front")))
        figures.append(f"front_pairs={pairs} stream_interval={args.stream_interval} fault_free_s={t_ff:.2f} "
                       f"repeats={args.repeats}")
    finally:
        await front.stop()
        await gen.aclose()
        await fm.shutdown()
    print("RESULT " + " ".join(figures))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tokens", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=0)
    ap.add_argument("--step-delay-ms", type=float, default=5.0)
    ap.add_argument("--front-only", action="store_true", help="only the front's failure-free overhead")
    ap.add_argument("--uvloop", action="store_true", help="run on uvloop's event loop (pip install uvloop)")
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="recovery.stream_interval: the engines send a chunk every k tokens (1: every token)")
    args = ap.parse_args()
    args.tokens = args.tokens or (400 if args.quick else 1500)
    args.repeats = args.repeats or (3 if args.quick else 5)
    if args.uvloop:  # the whole bench process (front and clients alike) on uvloop's event loop
        import uvloop

        uvloop.run(main_async(args))
    else:
        asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
