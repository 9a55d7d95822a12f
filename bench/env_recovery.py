"""Environment recovery: full_restore vs regenerating from the base image, and checkpoint overhead visibility.

A scripted agent trajectory of N actions runs in a real sandbox (Podman or Docker, CRIU). Each action is
preceded by an LLM generation, simulated by a fixed amount of CPU work on every core (matrix products,
calibrated on the idle machine to take --gen-s): a checkpoint that competes for the CPU slows it down, as it
would slow a CPU engine, so its cost shows up in the rollout time (--gen-sleep: the old idle wait instead). The environment holds in-memory state (the scripted daemon plus, in the python
env, a process holding --hold-mb of memory).

1. Recovery at failure points k, drawn uniformly from 1..N (seeded; --points of them per repeat), so they
   fall anywhere between checkpoints, not on them, at two cadences: a checkpoint every 2 actions, and at the
   actions where the adaptive policy of part 2 checkpointed (its first rollout; what a user gets): (a) full_restore of the newest checkpoint at or before k, then
   regenerate the actions after it; (b) a fresh sandbox from the base image, set-up, then regenerate all
   k actions. Regenerating an action costs one generation (simulated) plus its real exec.
2. Overhead: the same rollout (i) without checkpoints, (ii) checkpointing synchronously after every action,
   (iii) with the adaptive policy overlapping checkpoints with the next generation. Visible overhead is the
   time the agent waited for checkpoints, as a share of the rollout.

3. Side effects: a checkpoint after every action of a rollout where 3 actions in 4 are read-only, with
   side-effect detection (sandbox.policy.skip_unchanged) off and on: checkpoints taken and their time.

Last line: RESULT restore_s=.. rebuild_s=.. ratio=.. restore_every2_s=.. rebuild_every2_s=.. ratio_every2=..
       adaptive_cadence=.. visible_overhead_pct=.. rollout_overhead_pct=.. adaptive_checkpoints=..
       [side_effect_checkpoints=.. ck_time_saved_pct=..]
  restore_s: mean recovery time through full_restore (restore + regenerating the actions after the checkpoint),
    at the adaptive policy's cadence (restore_every2_s: a checkpoint every 2 actions)
  rebuild_s: mean recovery time from the base image (fresh sandbox + set-up + regenerating all k actions)
  ratio: rebuild_s / restore_s at the adaptive cadence (goal >= 3.5); ratio_every2: the same every 2 actions; visible_overhead_pct: adaptive policy's visible wait / rollout
  rollout_overhead_pct: how much longer the adaptive rollout took than one without checkpoints (their CPU cost
  included: with CPU-bound generation a checkpoint hidden behind it still slows it)
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import sys
import tempfile
import random
import time
from pathlib import Path

import numpy as np

from belayer_plugin.envs.build import ensure_image
from belayer_plugin.envs.definitions import get_env
from belayer_plugin.sandbox.base import Sandbox, SandboxSpec
from belayer_plugin.sandbox.checkpoint import CheckpointStore, full_checkpoint, full_restore
from belayer_plugin.sandbox.policy import CheckpointPolicy
from belayer_plugin.sandbox.scripted import action, golden_state, messages, query_state, setup_stated, tokens
from belayer_plugin.sandbox.trajectory import TrajectoryRecorder


def make_setup(env: str, hold_mb: int):
    def setup(sb: Sandbox) -> None:
        setup_stated(sb)
        if env == "python" and hold_mb > 0:
            # a Python process holding memory and a counter: the kind of state a rebuild loses
            code = (f"import os,time\nx=bytearray(os.urandom(1<<20))*{hold_mb}\nn=0\n"
                    "open('/tmp/holder.ready','w').write('1')\nwhile True:\n    n+=1\n    time.sleep(0.5)\n")
            sb.write_file("/opt/holder.py", code)
            r = sb.exec("(python3 /opt/holder.py </dev/null >/dev/null 2>&1 &); "
                        "i=0; while [ ! -f /tmp/holder.ready ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done; "
                        "[ -f /tmp/holder.ready ]", timeout=60)
            assert r.exit_code == 0, r
    return setup


class Generation:
    """One simulated LLM generation: a fixed number of matrix products on every core (numpy's BLAS threads),
    calibrated so that it takes `gen_s` on the idle machine; `sleep=True`: an idle wait of gen_s instead."""

    def __init__(self, gen_s: float, sleep: bool = False):
        self.gen_s, self.sleep = gen_s, sleep
        self.a = np.random.default_rng(0).random((384, 384))
        self.units = 0
        if not sleep and gen_s > 0:
            self._unit()  # warm BLAS up before timing it
            t0, k = time.monotonic(), 0
            while time.monotonic() - t0 < 0.5:
                self._unit()
                k += 1
            self.units = max(1, round(gen_s * k / (time.monotonic() - t0)))

    def _unit(self) -> None:
        self.a = np.tanh(self.a @ self.a)

    def __call__(self) -> None:
        if self.sleep:
            time.sleep(self.gen_s)  # simulated idle generation, not synchronisation
            return
        for _ in range(self.units):
            self._unit()


def regenerate(sb: Sandbox, first: int, last: int, gen: Generation) -> float:
    """Regenerates actions first..last: one simulated generation + the real exec each; returns seconds."""
    t0 = time.monotonic()
    for i in range(first, last + 1):
        gen()  # the LLM regenerating action i
        r = sb.exec(action(i)["command"], timeout=30)
        assert r.exit_code == 0, r
    return time.monotonic() - t0


def rollout(backend, spec, setup, n: int, gen: Generation, store_root: Path, mode: str, policy_kind: str,
            failure_prob: float) -> dict:
    """One rollout of n actions; policy_kind: none | sync_every | adaptive. Returns timings."""
    sb = Sandbox.create(backend, spec, f"roll-{policy_kind}")
    setup(sb)
    rec = TrajectoryRecorder(f"roll-{policy_kind}-{time.time_ns()}", sb, CheckpointStore(store_root, keep=2),
                             checkpoint_mode=mode, checkpoint_timeout_s=60)
    rec.start(tokens(0), messages(0), checkpoint=False)
    pol = None
    if policy_kind != "none":
        pol = CheckpointPolicy(rec.checkpoint, failure_prob=failure_prob, min_overhead_s=0.05,
                               async_checkpoint=policy_kind == "adaptive", enabled=policy_kind == "adaptive",
                               every_n_actions=1 if policy_kind == "sync_every" else 0, cooldown_s=20.0,
                               initial_checkpoint_s=1.0)
    taken: list[int] = []  # the boundaries (actions) the policy checkpointed after
    t0 = time.monotonic()
    for i in range(1, n + 1):
        gt = time.monotonic()
        gen()  # the LLM generating action i (simulated); async checkpoints overlap this
        if pol:
            pol.note_work(time.monotonic() - gt, "generation")
            pol.wait_ready(timeout=120)  # the action needs the sandbox: wait only if the checkpoint still runs
        et = time.monotonic()
        rec.begin_action(action(i))
        r = rec.sandbox.exec(action(i)["command"], timeout=30)
        assert r.exit_code == 0, r
        rec.commit(tokens(i), messages(i))
        if pol:
            pol.note_work(time.monotonic() - et, "exec", action_done=True)
            if i < n:  # after the last action nothing is left to protect (and no generation to hide behind)
                if pol.maybe_checkpoint_async(rec.latest) is not None:
                    taken.append(i)
    if pol:
        pol.wait_ready(timeout=120)
    total = time.monotonic() - t0
    assert query_state(rec.sandbox) == golden_state(n)
    out = {"total_s": total, "visible_s": pol.stats.visible_wait_s if pol else 0.0,
           "checkpoint_s": pol.stats.checkpoint_s if pol else 0.0, "checkpoints": pol.stats.succeeded if pol else 0,
           "boundaries": taken}
    if pol:
        pol.close()
    rec.close()
    return out


READ_ONLY = ["cat /work/log", "ls -la /work", "wc -l /work/log", "grep -c a /work/log; true"]


def side_effects(backend, spec, setup, n: int, store_root: Path, mode: str) -> dict:
    """n actions, 3 in 4 of them read-only (Crab: most turns change nothing worth saving), a checkpoint
    after every action, with skip_unchanged off and on; then a restore at the end is checked."""
    out = {}
    for skip in (False, True):
        sb = Sandbox.create(backend, spec, "side-effects")
        setup(sb)
        rec = TrajectoryRecorder(f"se-{skip}", sb, CheckpointStore(store_root / str(skip), keep=2),
                                 checkpoint_mode=mode, checkpoint_timeout_s=120, skip_unchanged=skip)
        rec.start(tokens(0), messages(0), checkpoint=False)
        writes, ck_s = 0, 0.0
        for i in range(1, n + 1):
            if i % 4 == 1:
                writes += 1
                cmd = action(writes)["command"]
            else:
                cmd = READ_ONLY[i % len(READ_ONLY)]
            rec.execute(cmd, tokens(i), messages(i), run=lambda sb_, a: sb_.exec(a, timeout=30))
            t = time.monotonic()
            rec.checkpoint()
            ck_s += time.monotonic() - t
        rec.sandbox.kill()
        rb = rec.recover("bench: check the last boundary restores")
        assert rb.boundary == n and query_state(rb.sandbox) == golden_state(writes)
        out[skip] = {"ck_s": ck_s, "taken": n - rec.skipped_checkpoints}
        rec.close()
    saved = 100 * (1 - out[True]["ck_s"] / out[False]["ck_s"])
    print(f"\n[side effects] {n} actions, {n - (n + 3) // 4} read-only; a checkpoint after every action: "
          f"{out[False]['taken']} taken in {out[False]['ck_s']:.2f}s without detection, {out[True]['taken']} in "
          f"{out[True]['ck_s']:.2f}s with it ({saved:.0f}% of checkpoint time saved); both restore boundary {n}")
    return {"taken": out[True]["taken"], "boundaries": n, "saved_pct": saved}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="busybox env, fewer actions, shorter generations")
    ap.add_argument("--backend", choices=["podman", "docker"], default="podman")
    ap.add_argument("--env", choices=["busybox", "python"], default=None)
    ap.add_argument("--actions", type=int, default=None)
    ap.add_argument("--gen-s", type=float, default=None, help="simulated LLM generation time per action")
    ap.add_argument("--gen-sleep", action="store_true", help="generation as an idle wait (uses no CPU)")
    ap.add_argument("--points", type=int, default=None, help="failure points per repeat, uniform in 1..actions")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hold-mb", type=int, default=64)
    ap.add_argument("--failure-prob", type=float, default=0.02, help="per action (the recipe's default)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--mode", choices=["full", "fs_only", "auto"], default="full")
    ap.add_argument("--parts", default="recovery,overhead,side_effects",
                    help="comma list: recovery, overhead, side_effects")
    args = ap.parse_args(argv)
    env = args.env or ("busybox" if args.quick else "python")
    n = args.actions or (8 if args.quick else 16)
    gen_s = args.gen_s if args.gen_s is not None else (2.0 if args.quick else 3.0)
    repeats = args.repeats or (1 if args.quick else 3)
    n_points = args.points or (4 if args.quick else 6)
    rng = random.Random(args.seed)
    logging.basicConfig(level=logging.WARNING)

    daemon = None
    if args.backend == "docker":
        from belayer_plugin.sandbox.docker_backend import DockerBackend, DockerDaemon

        daemon = DockerDaemon().start()
        backend = DockerBackend(daemon.url)
    else:
        from belayer_plugin.sandbox.podman import PodmanBackend

        backend = PodmanBackend()
    work = Path(tempfile.mkdtemp(prefix="belayer-bench-env-"))
    try:
        image = ensure_image(backend, env)
        spec = SandboxSpec(image=image, memory_mb=1024, pids_limit=256, command=get_env(env).command)
        setup = make_setup(env, args.hold_mb)
        gen = Generation(gen_s, sleep=args.gen_sleep)
        print(f"env={env} backend={backend.name} actions={n} gen_s={gen_s} "
              f"({'idle wait' if args.gen_sleep else f'{gen.units} matrix products on every core'}) mode={args.mode} "
              f"repeats={repeats} failure points {n_points} per repeat, uniform in 1..{n} (seed {args.seed})")

        parts = set(args.parts.split(","))

        def recovery(boundaries: set[int], name: str) -> dict:
            """Part 1 with checkpoints after the actions in `boundaries`: failure points k, full_restore of the
            newest checkpoint at or before k (or the base image when there is none) against a rebuild."""
            out = {"restore_tot": [], "rebuild_tot": [], "ck_durations": [], "restore_only": []}
            print(f"\n[recovery, {name}] checkpoints after actions {sorted(boundaries)}; failure after action k")
            print(f"{'k':>4} {'ck_at':>6} {'restore_s':>10} {'regen_after_s':>14} {'full_restore_total_s':>21} "
                  f"{'rebuild_total_s':>16} {'ratio':>7}")
            for rep in range(repeats):
                sb = Sandbox.create(backend, spec, "bench")
                setup(sb)
                store = CheckpointStore(work / f"rec-{name.replace(' ', '')}-{rep}", keep=n + 1)
                cks = {}
                for i in range(1, n + 1):
                    r = sb.exec(action(i)["command"], timeout=30)
                    assert r.exit_code == 0
                    if i in boundaries:
                        t = time.monotonic()
                        cks[i] = full_checkpoint(sb, i, store, "bench", args.mode, 120)
                        out["ck_durations"].append(time.monotonic() - t)
                sb.close()
                for k in sorted(rng.randint(1, n) for _ in range(n_points)):
                    at = max([b for b in cks if b <= k], default=None)
                    t = time.monotonic()
                    if at is None:
                        rs = Sandbox.create(backend, spec, "bench-r")
                        setup(rs)
                        at = 0
                    else:
                        rs = full_restore(cks[at], backend, store, timeout_s=120)
                    restore_s = time.monotonic() - t
                    regen = regenerate(rs, at + 1, k, gen)
                    full_total = restore_s + regen
                    assert query_state(rs) == golden_state(k)
                    rs.close()
                    t = time.monotonic()
                    fresh = Sandbox.create(backend, spec, "bench-b")
                    setup(fresh)
                    regenerate(fresh, 1, k, gen)
                    rebuild = time.monotonic() - t
                    assert query_state(fresh) == golden_state(k)
                    fresh.close()
                    out["restore_tot"].append(full_total)
                    out["rebuild_tot"].append(rebuild)
                    out["restore_only"].append(restore_s)
                    print(f"{k:>4} {at:>6} {restore_s:>10.2f} {regen:>14.2f} {full_total:>21.2f} {rebuild:>16.2f} "
                          f"{rebuild / full_total:>6.1f}x")
            return out

        # -- 2. overhead: none vs synchronous every action vs adaptive async -------------------------
        print(f"\n[overhead] rollout of {n} actions, generation {gen_s}s each")
        res = {}
        adaptive_boundaries: list[int] = []  # where the adaptive policy checkpointed (its first rollout)
        for kind in (("none", "sync_every", "adaptive") if "overhead" in parts else ()):
            runs = [rollout(backend, spec, setup, n, gen, work / f"roll-{kind}-{r}", args.mode, kind,
                            args.failure_prob) for r in range(repeats)]
            if kind == "adaptive":
                adaptive_boundaries = runs[0]["boundaries"]
            res[kind] = {k: statistics.mean(r[k] for r in runs) for k in runs[0] if k != "boundaries"}
            v = res[kind]
            print(f"  {kind:>10}: rollout {v['total_s']:7.2f}s  checkpoints {v['checkpoints']:5.1f}  "
                  f"checkpoint time {v['checkpoint_s']:6.2f}s  visible wait {v['visible_s']:6.3f}s "
                  f"({100 * v['visible_s'] / v['total_s']:.2f}% of rollout)")
        nan = {"total_s": float("nan"), "visible_s": float("nan"), "checkpoint_s": 0.0, "checkpoints": 0}
        base = res.get("none", nan)["total_s"]
        ad = res.get("adaptive", nan)
        sync = res.get("sync_every", nan)
        hidden_pct = 100 * (1 - ad["visible_s"] / ad["checkpoint_s"]) if ad["checkpoint_s"] else 100.0
        print(f"  sync_every slows the rollout by {100 * (sync['total_s'] - base) / base:.1f}%; adaptive by "
              f"{100 * (ad['total_s'] - base) / base:.1f}%; adaptive hides {hidden_pct:.0f}% of its checkpoint time")

        # -- 1. recovery at several failure points, at two cadences: a checkpoint every 2 actions, and where the
        # adaptive policy put them in its rollout above (what a user running the policy gets) ----------------
        if "recovery" in parts and "overhead" not in parts:
            adaptive_boundaries = rollout(backend, spec, setup, n, gen, work / "roll-cadence", args.mode, "adaptive",
                                          args.failure_prob)["boundaries"]
        cadences = {"every 2": set(range(2, n + 1, 2)), "adaptive": set(adaptive_boundaries)}
        rec_res = {name: recovery(b, name) for name, b in cadences.items()} if "recovery" in parts else {}

        # -- 3. side-effect-aware checkpoints: a checkpoint after every action, read-only turns skipped ---
        se = side_effects(backend, spec, setup, n, work / "side-effects", args.mode) if "side_effects" in parts else None

        def mean(xs: list) -> float:
            return statistics.mean(xs) if xs else float("nan")

        nanres = {"restore_tot": [], "rebuild_tot": [], "ck_durations": [], "restore_only": []}
        every2, adaptive = rec_res.get("every 2", nanres), rec_res.get("adaptive", nanres)
        restore_tot, rebuild_tot = adaptive["restore_tot"], adaptive["rebuild_tot"]
        ck_durations = every2["ck_durations"] + adaptive["ck_durations"]
        restore_only = adaptive["restore_only"]
        r_s, b_s = mean(restore_tot), mean(rebuild_tot)
        r2_s, b2_s = mean(every2["restore_tot"]), mean(every2["rebuild_tot"])
        vis_pct = 100 * ad["visible_s"] / ad["total_s"]
        # What the visible wait does not show: the CPU a "hidden" checkpoint takes from the generation beside it.
        roll_pct = 100 * (ad["total_s"] - base) / base
        print(f"\nrecovery ratio rebuild/full_restore with a checkpoint every 2 actions: {b2_s / r2_s:.1f}x; at the "
              f"adaptive policy's cadence ({len(adaptive_boundaries)} checkpoints in {n} actions): {b_s / r_s:.1f}x")
        print(f"checkpoint mean {mean(ck_durations):.2f}s, restore alone mean "
              f"{mean(restore_only):.2f}s; recovery ratio rebuild/full_restore = {b_s / r_s:.1f}x "
              f"(goal >= 3.5x); visible overhead {vis_pct:.2f}% (goal <= 1%); rollout slowed by {roll_pct:.1f}% "
              f"with the adaptive policy ({ad['checkpoints']:.1f} checkpoints)")
        extra = (f" side_effect_checkpoints={se['taken']}/{se['boundaries']} ck_time_saved_pct={se['saved_pct']:.1f}"
                 if se else "")
        print(f"RESULT restore_s={r_s:.3f} rebuild_s={b_s:.3f} ratio={b_s / r_s:.2f} restore_every2_s={r2_s:.3f} "
              f"rebuild_every2_s={b2_s:.3f} ratio_every2={b2_s / r2_s:.2f} "
              f"adaptive_cadence={'+'.join(map(str, sorted(adaptive_boundaries))) or 'none'} "
              f"visible_overhead_pct={vis_pct:.3f}"
              f" rollout_overhead_pct={roll_pct:.1f} adaptive_checkpoints={ad['checkpoints']:.1f}" + extra)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if daemon is not None:
            daemon.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
