"""Soak: randomized fail-stop trials of a scripted trajectory; reports every violation (goal: zero).

Each trial kills containers at random moments (during actions, checkpoints and restores), sometimes
corrupts a published checkpoint, recovers through the TrajectoryRecorder and checks the golden final
state (memory and files, each action exactly once), the rolled-back LLM context, that no corrupt
checkpoint was restored, and that nothing of any container it created is left running.

Last line: RESULT trials=.. violations=..
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from belayer_plugin.envs.build import ensure_image
from belayer_plugin.sandbox.scripted import run_trial


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=None, help="default 1000 (20 with --quick)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--backend", choices=["podman", "docker", "both"], default="both")
    ap.add_argument("--actions", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0, help="first seed")
    ap.add_argument("--mode", choices=["full", "fs_only"], default="full")
    args = ap.parse_args(argv)
    trials = args.trials or (20 if args.quick else 1000)
    logging.basicConfig(level=logging.ERROR)

    backends = []
    daemon = None
    if args.backend in ("podman", "both"):
        from belayer_plugin.sandbox.podman import PodmanBackend

        backends.append(PodmanBackend())
    if args.backend in ("docker", "both"):
        from belayer_plugin.sandbox.docker_backend import DockerBackend, DockerDaemon

        daemon = DockerDaemon().start()
        backends.append(DockerBackend(daemon.url))
    work = Path(tempfile.mkdtemp(prefix="belayer-soak-"))
    violations = 0
    bad_seeds = []
    stats: Counter = Counter()
    t0 = time.monotonic()
    try:
        images = {b.name: ensure_image(b, "busybox") for b in backends}
        for i in range(trials):
            be = backends[i % len(backends)]
            seed = args.seed + i
            d = work / str(seed)
            try:
                r = run_trial(be, images[be.name], seed, d, n_actions=args.actions, mode=args.mode)
                v = r.violations
                stats["recoveries"] += r.recoveries
                stats["faults_fired"] += r.faults_fired
                for ph in r.fired_phases:
                    stats[f"killed_during_{ph}"] += 1
                stats["corrupted"] += int(r.corrupted is not None)
                stats["corrupt_detected"] += int(any(e.get("kind") == "checkpoint_corrupt" for e in r.events))
                stats["restore_failures"] += sum(1 for e in r.events if e.get("kind") == "restore_failed")
                stats["checkpoint_failures"] += sum(1 for e in r.events if e.get("kind") == "checkpoint_failed")
            except Exception as e:  # a crash of the harness is a violation too
                v = [f"trial raised {type(e).__name__}: {e}"]
            shutil.rmtree(d, ignore_errors=True)
            if v:
                violations += len(v)
                bad_seeds.append((be.name, seed))
                print(f"VIOLATION backend={be.name} seed={seed}: {v}", flush=True)
            if (i + 1) % 10 == 0 or i + 1 == trials:
                el = time.monotonic() - t0
                print(f"[{i + 1}/{trials}] {el:.0f}s elapsed, violations={violations}, "
                      + ", ".join(f"{k}={n}" for k, n in sorted(stats.items())), flush=True)
    finally:
        if daemon is not None:
            daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
    if bad_seeds:
        print("failing (backend, seed):", bad_seeds)
    print(f"RESULT trials={trials} violations={violations}")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
