"""Soak: randomized fail-stop trials of a scripted trajectory; reports every violation (goal: zero).

A thin caller of `belayer soak envs` (belayer_plugin.soak.run_env_campaign): each trial kills containers at
random moments (during actions, checkpoints and restores), sometimes corrupts a published checkpoint,
recovers through the TrajectoryRecorder and checks the golden final state (memory and files, each action
exactly once), the rolled-back LLM context, that no corrupt checkpoint was restored, and that nothing of
any container it created is left running.

Last line: RESULT trials=.. violations=..
"""

from __future__ import annotations

import argparse
import json
import sys

from belayer_plugin.soak import run_env_campaign


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=None, help="default 1000 (20 with --quick)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--backend", choices=["podman", "docker", "both"], default="both")
    ap.add_argument("--actions", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0, help="first seed")
    ap.add_argument("--mode", choices=["full", "fs_only"], default="full")
    args = ap.parse_args(argv)
    s = run_env_campaign(args.trials or (20 if args.quick else 1000), args.seed, backend=args.backend,
                         n_actions=args.actions, mode=args.mode)
    for f in s["failures"]:
        print(f"VIOLATION backend={f['backend']} seed={f['seed']}: {f['violations']}", flush=True)
    print(json.dumps({k: s[k] for k in ("backends", "stats", "trial_s", "duration_s")}))
    print(f"RESULT trials={s['trials']} violations={s['violations']}")
    return 1 if s["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
