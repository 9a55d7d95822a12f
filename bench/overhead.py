"""Failure-free overhead of fault tolerance: steps per second of the main job with it on vs off.

Same recipe (demo, chaos off), same seeds; on: Ray liveness, readiness probes, a standby engine, token
commits through the resumable generator, sandbox checkpoints overlapped with generation; off: none of it.
Runs alternate on/off so drift hits both alike. Start-up (engines, standby) is excluded: steps only.
Usage: python bench/overhead.py [--quick] [--runs N] [--steps N]
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


def one(ft: bool, steps: int) -> float:
    d = tempfile.mkdtemp(prefix=f"belayer-bench-overhead-{'on' if ft else 'off'}-")
    cfg, raw = load_belayer_config("demo", [f"belayer.use_fault_tolerance={str(ft).lower()}",
                                            "belayer.chaos.enabled=false", f"belayer.run_dir={d}",
                                            f"loop.num_steps={steps}"])
    rep = asyncio.run(ReferenceLoop(cfg, raw, progress=False).run())
    if rep["status"] != "ok":
        raise RuntimeError(f"run failed: {rep['error']}")
    return sum(s["step_s"] for s in rep["steps"]) / len(rep["steps"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--runs", type=int, default=0)
    ap.add_argument("--steps", type=int, default=0)
    args = ap.parse_args()
    runs = args.runs or (1 if args.quick else 3)
    steps = args.steps or (2 if args.quick else 4)
    on, off = [], []
    for _ in range(runs):
        off.append(one(False, steps))
        on.append(one(True, steps))
    s_on, s_off = statistics.median(on), statistics.median(off)
    pct = (s_on - s_off) / s_off * 100
    print(f"seconds per step (median of {runs} run(s) x {steps} steps): fault tolerance off {s_off:.2f} s | "
          f"on {s_on:.2f} s | overhead {pct:+.1f}% (goal <= 1%)")
    print(f"RESULT step_s_off={s_off:.3f} step_s_on={s_on:.3f} overhead_pct={pct:.2f}")


if __name__ == "__main__":
    main()
