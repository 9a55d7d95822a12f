"""Fault detection latency: Belayer's monitor vs a sequential probe loop with NeMo-RL's default knobs.

Belayer: Ray liveness (a pending call on every engine actor) for crashes, per-engine parallel
/health_generate probes for hangs, with the knobs of recipes/belayer/default.yaml.
Baseline: one loop that probes the engines one at a time with /health_generate (interval 60 s, timeout
60 s in NeMo-RL). Running that for real takes minutes per trial, so the baseline runs with both knobs
divided by --scale and its measured latencies are multiplied back by --scale (both figures printed).
Usage: python bench/detection.py [--quick] [--trials N] [--scale 20]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from belayer_plugin.config import load_belayer_config  # noqa: E402
from belayer_plugin.engines.launch import free_port, server_command  # noqa: E402
from belayer_plugin.events import EventLog  # noqa: E402
from belayer_plugin.fleet.launch import resolve_model_path  # noqa: E402
from belayer_plugin.fleet.manager import FleetManager  # noqa: E402
from belayer_plugin.ray_cluster import init_ray  # noqa: E402


async def belayer_trials(cfg, model: str, run_dir: Path, kind: str, trials: int) -> list[float]:
    fm = FleetManager(cfg, run_dir, EventLog(run_dir / f"events-{kind}.jsonl"), model_path=model)
    await fm.start()
    out = []
    try:
        for i in range(trials):
            sid = f"engine-{i % cfg.engines.num_engines}"
            await asyncio.sleep(random.uniform(0, cfg.monitor.probe_interval_s))  # a random probe phase
            t0 = time.time()
            os.kill(fm.slots[sid].info.pid, signal.SIGKILL if kind == "sigkill" else signal.SIGSTOP)
            det = await fm.events.wait_for(lambda e: e.kind == "detected" and e.subject == sid, 300, since=t0)
            out.append(det.t - t0)
            await fm.events.wait_for(lambda e: e.kind == "registered" and e.subject == sid, 300, since=t0)
    finally:
        await fm.shutdown()
    return out


class Baseline:
    """NeMo-RL-style monitor: every `interval`, probe engines one at a time, each bounded by `timeout`."""

    def __init__(self, urls: list[str], interval: float, timeout: float):
        self.urls, self.interval, self.timeout = urls, interval, timeout
        self.dead: dict[str, float] = {}

    async def run(self) -> None:
        async with httpx.AsyncClient() as c:
            while True:
                for u in self.urls:
                    if u in self.dead:
                        continue
                    try:
                        r = await c.get(f"{u}/health_generate", timeout=self.timeout)
                        ok = r.status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    if not ok:
                        self.dead[u] = time.time()
                await asyncio.sleep(self.interval)


def _spawn(cfg, model: str) -> tuple[object, str]:
    import subprocess

    port = free_port()
    argv, env = server_command(cfg.engines, model, "127.0.0.1", port)
    p = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    return p, f"http://127.0.0.1:{port}"


async def _ready(url: str) -> None:
    async with httpx.AsyncClient() as c:
        for _ in range(1200):
            try:
                if (await c.get(f"{url}/health", timeout=2)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.05)
    raise TimeoutError(url)


async def baseline_trials(cfg, model: str, kind: str, trials: int, interval: float, timeout: float) -> list[float]:
    procs = [_spawn(cfg, model) for _ in range(cfg.engines.num_engines)]
    await asyncio.gather(*(_ready(u) for _, u in procs))
    out = []
    try:
        for i in range(trials):
            b = Baseline([u for _, u in procs], interval, timeout)
            task = asyncio.create_task(b.run())
            await asyncio.sleep(random.uniform(0, interval))  # a random phase of the probe loop
            j = i % len(procs)
            proc, url = procs[j]
            t0 = time.time()
            os.kill(proc.pid, signal.SIGKILL if kind == "sigkill" else signal.SIGSTOP)
            while url not in b.dead:
                await asyncio.sleep(0.005)
            out.append(b.dead[url] - t0)
            task.cancel()
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            procs[j] = _spawn(cfg, model)
            await _ready(procs[j][1])
    finally:
        for p, _ in procs:
            os.killpg(p.pid, signal.SIGKILL)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--trials", type=int, default=0)
    ap.add_argument("--scale", type=float, default=20.0, help="divide NeMo-RL's 60 s/60 s knobs by this")
    args = ap.parse_args()
    trials = args.trials or (2 if args.quick else 5)
    cfg, _ = load_belayer_config("fleet_demo", ["belayer.use_fault_tolerance=true", "belayer.shadow.num_standby=0",
                                                "belayer.restart.backoff_initial_s=0", "belayer.restart.max_restarts=100",
                                                "belayer.monitor.boot_grace_s=0"])
    model = resolve_model_path(cfg)
    init_ray(cfg.ray)
    run_dir = Path(tempfile.mkdtemp(prefix="belayer-bench-detection-"))
    interval, timeout = 60.0 / args.scale, 60.0 / args.scale
    m = cfg.monitor
    print(f"Belayer knobs: probe_interval_s={m.probe_interval_s} probe_timeout_s={m.probe_timeout_s} "
          f"failure_threshold={m.failure_threshold}; baseline: sequential loop, interval {interval:g} s, "
          f"timeout {timeout:g} s (NeMo-RL's 60 s / 60 s divided by {args.scale:g}; figures x{args.scale:g} "
          f"to extrapolate), {cfg.engines.num_engines} CPU engines, {trials} trials each")
    loop = asyncio.new_event_loop()
    figures = []
    for kind in ("sigkill", "hang"):
        bel = loop.run_until_complete(belayer_trials(cfg, model, run_dir, kind, trials))
        base = loop.run_until_complete(baseline_trials(cfg, model, kind, trials, interval, timeout))
        bm, sm = statistics.median(bel), statistics.median(base)
        print(f"{kind:8s} belayer median {bm:7.3f} s  | baseline median {sm:6.2f} s scaled, "
              f"{sm * args.scale:7.1f} s at NeMo-RL defaults | ratio {sm * args.scale / bm:8.1f}x "
              f"(raw per-trial belayer {', '.join(f'{x:.3f}' for x in bel)})")
        figures.append(f"{kind}_belayer_s={bm:.3f} {kind}_baseline_s={sm * args.scale:.1f} "
                       f"{kind}_ratio={sm * args.scale / bm:.1f}")
    loop.close()
    print("RESULT " + " ".join(figures) + f" baseline_scale={args.scale:g}")


if __name__ == "__main__":
    main()
