"""Failure-free overhead of fault tolerance: seconds per step of the main job with it on vs off.

Same recipe (demo, chaos off), same seeds, same engines and sglang-router. On: Ray liveness, readiness
probes, a standby engine, token commits through the resumable generator straight to the chosen engine,
sandbox checkpoints overlapped with generation. Off: a plain client (belayer_plugin.generation.plain: one
non-streaming POST per request through sglang-router, no Belayer code in the request path), no monitor, no
standby, no checkpoints. Runs are interleaved and their order alternates (off/on, on/off, ...) so drift
hits both arms alike. Start-up (engines, standby) is excluded: steps only, the first step of each run
included (what a trainer pays). --quick keeps these definitions with fewer runs and steps.
Usage: python bench/overhead.py [--quick] [--runs N] [--steps N] [--on-override KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from belayer_plugin.config import load_belayer_config  # noqa: E402
from belayer_plugin.loop import ReferenceLoop  # noqa: E402


def one(ft: bool, steps: int, on_overrides: list[str]) -> float:
    d = tempfile.mkdtemp(prefix=f"belayer-bench-overhead-{'on' if ft else 'off'}-")
    cfg, raw = load_belayer_config("demo", [f"belayer.use_fault_tolerance={str(ft).lower()}",
                                            "belayer.chaos.enabled=false", f"belayer.run_dir={d}",
                                            f"loop.num_steps={steps}"] + (on_overrides if ft else []))
    rep = asyncio.run(ReferenceLoop(cfg, raw, progress=False).run())
    if rep["status"] != "ok":
        raise RuntimeError(f"run failed: {rep['error']}")
    return sum(s["step_s"] for s in rep["steps"]) / len(rep["steps"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--runs", type=int, default=0)
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--on-override", action="append", default=[], metavar="KEY=VALUE",
                    help="a recipe override for the 'on' arm only, to attribute the overhead to a part "
                         "(e.g. belayer.shadow.num_standby=0, belayer.sandbox.policy.enabled=false)")
    args = ap.parse_args()
    runs = args.runs or (2 if args.quick else 3)
    steps = args.steps or (2 if args.quick else 4)
    on: list[float] = []
    off: list[float] = []
    for i in range(runs):
        for ft in ((False, True) if i % 2 == 0 else (True, False)):
            s = one(ft, steps, args.on_override)
            (on if ft else off).append(s)
            print(f"run {i + 1}/{runs} fault tolerance {'on ' if ft else 'off'}: {s:.3f} s/step", flush=True)
    s_on, s_off = statistics.median(on), statistics.median(off)
    pct = (s_on - s_off) / s_off * 100
    # spread: the per-run overheads of the paired runs, so one slow run of one arm shows up as spread
    pairs = [(a - b) / b * 100 for a, b in zip(on, off)]
    print(f"seconds per step (median of {runs} runs x {steps} steps): off (plain client through sglang-router) "
          f"{s_off:.3f} s [{min(off):.3f}-{max(off):.3f}] | on {s_on:.3f} s [{min(on):.3f}-{max(on):.3f}] | "
          f"overhead {pct:+.2f}% (paired runs {min(pairs):+.1f}% .. {max(pairs):+.1f}%; goal <= 0.5%)")
    if args.on_override:
        print(f"'on' arm with: {' '.join(args.on_override)}")
    print(f"RESULT step_s_off={s_off:.3f} step_s_on={s_on:.3f} overhead_pct={pct:.2f} "
          f"overhead_min_pct={min(pairs):.2f} overhead_max_pct={max(pairs):.2f} runs={runs} steps={steps}")


if __name__ == "__main__":
    main()
