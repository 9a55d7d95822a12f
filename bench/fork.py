"""Sandbox fork: n branches from one committed checkpoint vs building n sandboxes and replaying the prefix.

A scripted trajectory of k actions runs in a real sandbox (the stated daemon holding in-memory state, plus,
in the python env, a Python process holding --hold-mb of memory). At boundary k we need n environments in
that state (a GRPO group sharing an environment state, or a tree rollout branching at an action):

(a) fork: one full checkpoint at k (timed) + `fork_sandboxes` of it into n containers;
(b) replay: n fresh sandboxes from the base image, set-up, and the k actions replayed in each (no LLM time
    counted: the actions are known, so this is the cheapest possible replay).

Both arms are checked to reach the same state (query of the in-memory daemon and files) before timing counts.

Last line: RESULT fork_s=.. replay_s=.. ratio=.. n=..
  fork_s: checkpoint + fork of n (wall clock); replay_s: n sandboxes built and replayed (same parallelism);
  ratio: replay_s / fork_s.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from belayer_plugin.envs.build import ensure_image
from belayer_plugin.envs.definitions import get_env
from belayer_plugin.sandbox.base import Sandbox, SandboxSpec
from belayer_plugin.sandbox.checkpoint import CheckpointStore, full_checkpoint
from belayer_plugin.sandbox.fork import fork_sandboxes
from belayer_plugin.sandbox.scripted import action, golden_state, query_state

sys.path.insert(0, str(Path(__file__).resolve().parent))
from env_recovery import make_setup  # noqa: E402  (the same set-up as the env recovery bench)


def build_and_replay(backend, spec: SandboxSpec, setup, k: int) -> Sandbox:
    sb = Sandbox.create(backend, spec)
    setup(sb)
    for i in range(1, k + 1):
        a = action(i)
        r = sb.exec(a["command"], timeout=a["timeout"])
        assert r.exit_code == 0, r
    return sb



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="n=4, k=4, one repeat")
    ap.add_argument("--backend", choices=["podman", "docker"], default="podman")
    ap.add_argument("--env", choices=["busybox", "python"], default="python")
    ap.add_argument("-n", type=int, default=None, help="branches (default 8)")
    ap.add_argument("-k", type=int, default=None, help="actions before the fork (default 8)")
    ap.add_argument("--hold-mb", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--workers", type=int, default=0, help="restores/builds at a time, both arms (0: two per core)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    n = args.n or (4 if args.quick else 8)
    k = args.k or (4 if args.quick else 8)
    repeats = args.repeats or (1 if args.quick else 3)
    workers = args.workers or 2 * (os.cpu_count() or 1)  # fork_sandboxes' own default

    daemon = None
    if args.backend == "docker":
        from belayer_plugin.sandbox.docker_backend import DockerBackend, DockerDaemon

        daemon = DockerDaemon().start()
        backend = DockerBackend(daemon.url)
    else:
        from belayer_plugin.sandbox.podman import PodmanBackend

        backend = PodmanBackend()
    work = Path(tempfile.mkdtemp(prefix="belayer-bench-fork-"))
    try:
        image = ensure_image(backend, args.env, Path(tempfile.gettempdir()) / "belayer-envs")
        spec = SandboxSpec(image=image, memory_mb=512, command=get_env(args.env).command)
        setup = make_setup(args.env, args.hold_mb)
        want = golden_state(k)
        print(f"{args.backend}, {args.env} env (hold {args.hold_mb} MB), fork into n={n} at k={k} actions, "
              f"{repeats} repeat(s), {workers} at a time")
        fork_t, ck_t, replay_t = [], [], []
        for r in range(repeats):
            parent = build_and_replay(backend, spec, setup, k)
            try:
                store = CheckpointStore(work / f"r{r}")
                t0 = time.monotonic()
                ck = full_checkpoint(parent, k, store, "parent", mode="full", timeout_s=120)
                t1 = time.monotonic()
                forks = fork_sandboxes(ck, backend, n, store=store, timeout_s=120, workers=workers)
                t2 = time.monotonic()
                try:
                    assert all(query_state(f) == want for f in forks), "a fork is not in the parent's state"
                finally:
                    for f in forks:
                        f.close()
            finally:
                parent.close()
            t3 = time.monotonic()
            with ThreadPoolExecutor(max_workers=workers) as pool:
                built = list(pool.map(lambda _: build_and_replay(backend, spec, setup, k), range(n)))
            t4 = time.monotonic()
            try:
                assert all(query_state(b) == want for b in built), "a replayed sandbox is not in the state"
            finally:
                for b in built:
                    b.close()
            ck_t.append(t1 - t0)
            fork_t.append(t2 - t0)
            replay_t.append(t4 - t3)
            print(f"  repeat {r}: checkpoint {t1 - t0:.2f}s + fork {t2 - t1:.2f}s = {t2 - t0:.2f}s   "
                  f"build+replay x{n}: {t4 - t3:.2f}s")
        f_s, r_s = statistics.median(fork_t), statistics.median(replay_t)
        print(f"\nmedian: fork (checkpoint {statistics.median(ck_t):.2f}s included) {f_s:.2f}s vs build+replay "
              f"{r_s:.2f}s; {n} forks ready {f_s - statistics.median(ck_t):.2f}s after the checkpoint")
        print(f"RESULT fork_s={f_s:.3f} replay_s={r_s:.3f} ratio={r_s / f_s:.2f} n={n}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if daemon is not None:
            daemon.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
