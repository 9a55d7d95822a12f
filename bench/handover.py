"""Shadow handover vs cold restart of the same engine kind, and what a standby costs in memory.

For each engine kind (CPU engine; SGLang on CPU when .venv-sglang exists) the serving engine is SIGKILLed
repeatedly; the figures are the time from detection (DEAD) to the slot HEALTHY with current weights
(serving through Belayer's front or direct mode) and to its registration with sglang-router confirmed,
with one standby (handover) and with none (cold restart). Memory: the
unique resident memory (USS) of a standby's server process, with and without the shared-memory weights
holder, for a model of --mem-hidden x --mem-layers (default ~85 MB of weights).
Usage: python bench/handover.py [--quick] [--trials N] [--kinds cpu,sglang]
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
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from belayer_plugin.config import load_belayer_config  # noqa: E402
from belayer_plugin.events import EventLog  # noqa: E402
from belayer_plugin.fleet.launch import resolve_model_path  # noqa: E402
from belayer_plugin.fleet.manager import FleetManager  # noqa: E402
from belayer_plugin.ray_cluster import init_ray  # noqa: E402

BASE = ["belayer.use_fault_tolerance=true", "belayer.engines.num_engines=1", "belayer.restart.min_healthy_engines=0",
        "belayer.restart.max_restarts=1000", "belayer.restart.backoff_initial_s=0", "belayer.monitor.boot_grace_s=2",
        "belayer.shadow.fault_window_s=0"]
SGLANG = ["belayer.engines.kind=sglang", "belayer.engines.startup_timeout_s=300", "belayer.monitor.probe_timeout_s=10",
          "belayer.shadow.handover_timeout_s=30"]


async def recoveries(kind: str, standby: int, trials: int, model: str) -> list[float]:
    extra = SGLANG if kind == "sglang" else []
    cfg, _ = load_belayer_config("fleet_demo", [*BASE, *extra, f"belayer.shadow.num_standby={standby}"])
    run_dir = Path(tempfile.mkdtemp(prefix=f"belayer-bench-handover-{kind}-"))
    fm = FleetManager(cfg, run_dir, EventLog(run_dir / "events.jsonl"), model_path=model)
    await fm.start()
    out = []
    try:
        for _ in range(trials):
            if standby:
                while len(fm.shadows.ready) < standby:  # the next trial needs a standby ready again
                    await fm.events.wait_for(lambda e: e.kind == "shadow_ready", 600, since=time.time())
            t0 = time.time()
            slot = fm.slots["engine-0"]
            os.killpg(slot.info.pid, signal.SIGKILL)
            det = await fm.events.wait_for(lambda e: e.kind == "detected", 60, since=t0)
            ok = await fm.events.wait_for(lambda e: e.kind == "transition" and e.to_state == "HEALTHY", 900, since=t0)
            reg = await fm.events.wait_for(lambda e: e.kind == "registered", 900, since=t0)
            out.append((reg.t - det.t, ok.t - det.t))
    finally:
        await fm.shutdown()
    return out


async def standby_uss(model: str, shared: bool) -> tuple[float, float]:
    cfg, _ = load_belayer_config("fleet_demo", [*BASE, "belayer.shadow.num_standby=1",
                                                f"belayer.shadow.shared_weights={str(shared).lower()}"])
    run_dir = Path(tempfile.mkdtemp(prefix="belayer-bench-mem-"))
    fm = FleetManager(cfg, run_dir, EventLog(run_dir / "events.jsonl"), model_path=model)
    await fm.start()
    try:
        sh = fm.shadows.ready[0]
        main_pid = fm.slots["engine-0"].info.pid
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        async with httpx.AsyncClient() as c:  # touch every weight page in both (an idle model is not resident)
            for url in (sh.info.url, fm.slots["engine-0"].info.url):
                (await c.post(f"{url}/generate", json=body, timeout=60)).raise_for_status()
        return (psutil.Process(sh.info.pid).memory_full_info().uss / 2**20,
                psutil.Process(main_pid).memory_full_info().rss / 2**20)
    finally:
        await fm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--trials", type=int, default=0)
    ap.add_argument("--kinds", default="cpu,sglang")
    ap.add_argument("--mem-hidden", type=int, default=512)
    ap.add_argument("--mem-layers", type=int, default=8)
    args = ap.parse_args()
    trials = args.trials or (2 if args.quick else 5)
    cfg, _ = load_belayer_config("fleet_demo")
    init_ray(cfg.ray)
    model = resolve_model_path(cfg)
    figures = []
    loop = asyncio.new_event_loop()
    for kind in args.kinds.split(","):
        if kind not in ("cpu", "sglang"):
            continue
        if kind == "sglang":
            from belayer_plugin.engines.sglang import sglang_available

            kcfg, _ = load_belayer_config("fleet_demo", SGLANG)
            if not sglang_available(kcfg.engines):
                print("sglang: .venv-sglang not built (bash .ci/setup.sh --sglang); skipped")
                continue
        ho = loop.run_until_complete(recoveries(kind, 1, trials, model))
        cold = loop.run_until_complete(recoveries(kind, 0, trials, model))
        h, c = statistics.median(x[0] for x in ho), statistics.median(x[0] for x in cold)
        hh, ch = statistics.median(x[1] for x in ho), statistics.median(x[1] for x in cold)
        print(f"{kind:7s} detected -> registered with the router: handover median {h:.3f} s | cold restart median "
              f"{c:.2f} s | {c / h:.1f}x faster  (handover {', '.join(f'{x[0]:.3f}' for x in ho)}; "
              f"cold {', '.join(f'{x[0]:.2f}' for x in cold)})")
        print(f"{kind:7s} detected -> HEALTHY (serving through Belayer's front / direct mode): handover {hh:.3f} s | "
              f"cold {ch:.2f} s | {ch / hh:.1f}x faster")
        figures.append(f"{kind}_handover_s={h:.3f} {kind}_cold_s={c:.2f} {kind}_ratio={c / h:.1f} "
                       f"{kind}_handover_healthy_s={hh:.3f} {kind}_healthy_ratio={ch / hh:.1f}")
    from belayer_plugin.engines.tiny_model import make_tiny

    mdir = Path(os.environ.get("BELAYER_CACHE_DIR", Path.home() / ".cache" / "belayer")) / \
        f"bench-model-{args.mem_hidden}x{args.mem_layers}"
    if not (mdir / "model.safetensors").exists():
        make_tiny(mdir, hidden_size=args.mem_hidden, num_layers=args.mem_layers, num_heads=args.mem_hidden // 32)
    wmb = (mdir / "model.safetensors").stat().st_size / 2**20
    shared, main_rss = loop.run_until_complete(standby_uss(str(mdir), True))
    private, _ = loop.run_until_complete(standby_uss(str(mdir), False))
    loop.close()
    print(f"standby memory (CPU engine, {wmb:.0f} MB of weights, after one generation): unique {shared:.0f} MB with "
          f"the shared-memory holder vs {private:.0f} MB loading the same files itself ({private - shared:+.0f} MB); "
          f"a main engine's RSS is {main_rss:.0f} MB")
    figures.append(f"standby_uss_shared_mb={shared:.0f} standby_uss_private_mb={private:.0f} weights_mb={wmb:.0f}")
    print("RESULT " + " ".join(figures))


if __name__ == "__main__":
    main()
