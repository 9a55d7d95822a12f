"""Failure-free overhead of fault tolerance: seconds per step of the main job with it on vs off.

Same recipe (demo, chaos off), same seeds, same engines and sglang-router. On: Ray liveness, readiness
probes, a standby engine, token commits through the resumable generator straight to the chosen engine, and
the adaptive checkpoint policy (on the demo's short trajectories it takes no checkpoint: the bench prints how
many it took per step, `checkpoints_per_step`). Off: a plain client (belayer_plugin.generation.plain: one
non-streaming POST per request through sglang-router, no Belayer code in the request path), no monitor, no
standby, no checkpoints. Runs are interleaved and their order alternates (off/on, on/off, ...) so drift
hits both arms alike. Start-up (engines, standby) is excluded: steps only, the first step of each run
included (what a trainer pays). Beside the wall time it prints each phase (generation; pause..resume)
and the CPU each step cost the whole host and the driver, per arm, to say where a difference comes from.
--quick keeps these definitions with fewer runs and steps.

--concurrent runs each pair's two arms at the same time instead, each in its own process (its own Ray cluster,
engines and router) pinned to one core of its own, the cores swapped from pair to pair. This machine's drift
(the same work costs 3.4-6.7 CPU-s per step from one minute to the next) then hits both arms of a pair alike,
so the pair's difference is what fault tolerance adds on one core. The whole host's CPU holds both arms there,
so the CPU is reported by role only, and fault tolerance's own share as a part of the arm's core time.
Sandbox containers are pinned too where the runtime keeps the affinity it is started with (runc may reset it).
--campaigns K runs K campaigns of --runs pairs one after the other and pools them: each campaign's overhead
and interval, then the pooled one over all pairs (the figure a replication is judged by).
The goal: overhead <= 0.5% (GOAL_PCT). `goal_met=yes` only when the 95% interval's upper bound is within it;
a median within it and an interval that is not prints `goal_met=no`.
Usage: python bench/overhead.py [--quick] [--runs N] [--steps N] [--campaigns K] [--concurrent]
       [--on-override KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bootstrap  # noqa: E402  (bench/, the script's own directory)
from belayer_plugin.config import load_belayer_config  # noqa: E402
from belayer_plugin.loop import ReferenceLoop  # noqa: E402

GOAL_PCT = 0.5  # issue #13, goal 3: fault tolerance costs at most 0.5% of a failure-free step
_FIELDS = ("step_s", "gen_s", "barrier_s", "pause_s", "train_s", "refit_s", "resume_s", "cpu_host_s", "cpu_driver_s")
# One trajectory's wall time by part (means over the run's trajectories, which run four at a time): the
# sandbox's creation, the model's turns (client side: request to last token), the actions' execs, the final
# state and close, and what is left (the checkpoint policy, observations' tokenizing, the event loop's waits).
_TRAJ = ("wall_s", "setup_s", "gen_s", "env_s", "finish_s")
# Where the host's CPU goes during the steps, by role: the trainer's driver (Belayer's client, monitor and
# fleet manager run in it), the commands it ran and waited for (podman exec, checkpoint, restore: the
# sandboxes' CLI work, CRIU included), the serving engines (server and Ray actor), the standbys, sglang-router, and the
# rest of the host (sandboxes, Podman, CRIU, Ray's own processes, the learner, the kernel).
_ROLES = ("driver", "commands", "engines", "standby", "router", "rest")


def _tree_cpu(pid: int) -> float:
    import psutil

    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _role_cpu(loop: ReferenceLoop) -> dict[str, float]:
    """Cumulative CPU seconds of each role but the rest, and the monitor's probe counters, now."""
    import psutil

    fm = loop.fleet
    me = psutil.Process().cpu_times()
    # an engine's Ray actor and its server (a child of the actor) and anything the server started
    eng = [s.info.actor_pid for s in fm.slots.values() if s.info]
    sby = [sh.info.actor_pid for sh in (fm.shadows.ready if fm.shadows else [])]
    return {"driver": me.user + me.system, "commands": me.children_user + me.children_system,
            "engines": sum(_tree_cpu(p) for p in eng), "standby": sum(_tree_cpu(p) for p in sby),
            "router": _tree_cpu(fm.router.proc.pid) if fm.router and fm.router.proc else 0.0,
            # /health_generate probes: each makes an engine generate a token (engines' CPU, not the driver's)
            "probes": float(fm.monitor.probes_sent), "probes_skipped": float(fm.monitor.probes_skipped),
            **_core_times()}


def _core_times() -> dict[str, float]:
    """Busy and steal seconds so far of the one core this process is pinned to (0 when not pinned to one).
    Busy is all CPU that core ran: pinned, an arm's every process (Ray's own, Podman's, the containers') is
    there, so it is the arm's whole CPU where the roles miss Ray's and Podman's daemons. Steal is the time the
    hypervisor ran something else while this vCPU wanted to run; it is per vCPU, so pinning cannot share it."""
    cores = os.sched_getaffinity(0)
    if len(cores) != 1:
        return {"core_busy": 0.0, "steal": 0.0}
    name = f"cpu{next(iter(cores))}"
    with open("/proc/stat") as f:
        for line in f:
            v = line.split()
            if v[0] == name:
                # user nice system idle iowait irq softirq steal ...
                busy = sum(int(x) for x in v[1:4]) + int(v[6]) + int(v[7])
                return {"core_busy": busy / os.sysconf("SC_CLK_TCK"), "steal": int(v[8]) / os.sysconf("SC_CLK_TCK")}
    return {"core_busy": 0.0, "steal": 0.0}


def one(ft: bool, steps: int, on_overrides: list[str]) -> dict[str, float]:
    """One run of the main job; per-step means of its figures (seconds; CPU seconds for cpu_*)."""
    run_dir = tempfile.mkdtemp(prefix=f"belayer-bench-overhead-{'on' if ft else 'off'}-")
    cfg, raw = load_belayer_config("demo", [f"belayer.use_fault_tolerance={str(ft).lower()}",
                                            "belayer.chaos.enabled=false", f"belayer.run_dir={run_dir}",
                                            f"loop.num_steps={steps}"] + (on_overrides if ft else []))
    marks: dict[str, dict[str, float]] = {}

    def on_step(loop: ReferenceLoop, step: int, edge: str) -> None:
        if (step, edge) in ((1, "start"), (steps, "end")):
            marks[edge] = _role_cpu(loop)

    rep = asyncio.run(ReferenceLoop(cfg, raw, progress=False, on_step=on_step).run())
    if rep["status"] != "ok":
        raise RuntimeError(f"run failed: {rep['error']}")
    out = {k: statistics.fmean(float(s[k] or 0.0) for s in rep["steps"]) for k in _FIELDS}
    out["steps_s"] = [float(s["step_s"]) for s in rep["steps"]]  # each step's, for --json readers
    out["checkpoints"] = sum(int(t.get("checkpoints") or 0) for t in rep["trajectories"]) / steps
    for k in _TRAJ:
        out[f"traj_{k}"] = statistics.fmean(t[k] for t in rep["trajectories"])
    out["traj_rest_s"] = out["traj_wall_s"] - sum(out[f"traj_{k}"] for k in _TRAJ[1:])
    for k in _ROLES[:-1]:
        out[f"role_{k}"] = (marks["end"][k] - marks["start"][k]) / steps
    for k in ("probes", "probes_skipped", "steal", "core_busy"):
        out[k] = (marks["end"][k] - marks["start"][k]) / steps
    # the rest: what the host's busy CPU (each step's cpu_host_s) holds beyond the named roles
    out["role_rest"] = out["cpu_host_s"] - sum(out[f"role_{k}"] for k in _ROLES[:-1])
    return out


def _pct(a: float, b: float) -> float:
    return (a - b) / b * 100 if b else 0.0


def bootstrap_interval(on: list[float], off: list[float], level: float = 0.95) -> tuple[float, float]:
    """Bootstrap interval of the overhead (median on vs median off, %), resampling whole pairs of runs."""
    return bootstrap.interval(len(on), lambda idx: _pct(statistics.median(on[i] for i in idx),
                                                        statistics.median(off[i] for i in idx)), level)


_CHILD = "CHILD "


def concurrent_pair(i: int, steps: int, on_overrides: list[str], timeout_s: float) -> tuple[dict, dict]:
    """Both arms at once, each in a process pinned to a core of its own (swapped on odd pairs); (on, off)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("--concurrent needs two cores")
    core = {False: cores[i % 2], True: cores[(i + 1) % 2]}
    procs = {}
    for ft in (False, True):
        argv = [sys.executable, __file__, "--child", "on" if ft else "off", "--core", str(core[ft]),
                "--steps", str(steps)] + [f"--on-override={o}" for o in on_overrides]
        procs[ft] = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = {}
    try:
        for ft, p in procs.items():
            text, _ = p.communicate(timeout=timeout_s)
            lines = [ln for ln in text.splitlines() if ln.startswith(_CHILD)]
            if p.returncode != 0 or not lines:
                raise RuntimeError(f"arm {'on' if ft else 'off'} failed (exit {p.returncode}):\n{text[-3000:]}")
            out[ft] = json.loads(lines[-1][len(_CHILD):]) | {"core": core[ft]}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    return out[True], out[False]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--runs", type=int, default=0, help="pairs of runs per campaign")
    ap.add_argument("--campaigns", type=int, default=1, help="campaigns of --runs pairs, pooled at the end")
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--on-override", action="append", default=[], metavar="KEY=VALUE",
                    help="a recipe override for the 'on' arm only, to attribute the overhead to a part "
                         "(e.g. belayer.shadow.num_standby=0, belayer.sandbox.policy.enabled=false)")
    ap.add_argument("--concurrent", action="store_true",
                    help="run each pair's arms at the same time, each pinned to a core of its own")
    ap.add_argument("--json", metavar="PATH", help="also write every run's figures to PATH")
    ap.add_argument("--child", choices=("on", "off"), help=argparse.SUPPRESS)
    ap.add_argument("--core", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    runs = args.runs or (2 if args.quick else 3)
    steps = args.steps or (2 if args.quick else 4)
    if args.child:  # one arm of a concurrent pair: pinned before Ray starts, so every process it starts inherits
        os.sched_setaffinity(0, {args.core})
        print(_CHILD + json.dumps(one(args.child == "on", steps, args.on_override)), flush=True)
        return
    on: list[dict[str, float]] = []
    off: list[dict[str, float]] = []
    campaign_of: list[int] = []  # each pair's campaign
    for i in range(runs * args.campaigns):
        campaign_of.append(i // runs)
        if args.concurrent:
            a, b = concurrent_pair(i, steps, args.on_override, timeout_s=600 + 120 * steps)
            on.append(a)
            off.append(b)
            print(f"pair {i + 1}/{runs * args.campaigns} at once: off {b['step_s']:.3f} s/step (core {b['core']}), "
                  f"on {a['step_s']:.3f} s/step (core {a['core']}): {_pct(a['step_s'], b['step_s']):+.2f}% "
                  f"(generation {_pct(a['gen_s'], b['gen_s']):+.2f}%, pause..resume "
                  f"{_pct(a['barrier_s'], b['barrier_s']):+.2f}%; steal per step off {b['steal']:.3f} s, "
                  f"on {a['steal']:.3f} s)", flush=True)
            continue
        for ft in ((False, True) if i % 2 == 0 else (True, False)):
            r = one(ft, steps, args.on_override)
            (on if ft else off).append(r)
            print(f"run {i + 1}/{runs * args.campaigns} fault tolerance {'on ' if ft else 'off'}: {r['step_s']:.3f} s/step "
                  f"(generation {r['gen_s']:.3f} s, pause..resume {r['barrier_s']:.3f} s; CPU per step: host "
                  f"{r['cpu_host_s']:.2f} s, driver {r['cpu_driver_s']:.2f} s)", flush=True)

    def med(arm: list[dict[str, float]], k: str) -> float:
        return statistics.median(r[k] for r in arm)

    if args.campaigns > 1:  # each campaign alone, then the pool below
        for c in range(args.campaigns):
            con = [r for r, k in zip(on, campaign_of) if k == c]
            coff = [r for r, k in zip(off, campaign_of) if k == c]
            cci = bootstrap_interval([r["step_s"] for r in con], [r["step_s"] for r in coff])
            print(f"campaign {c + 1}/{args.campaigns} ({len(con)} pairs): off {med(coff, 'step_s'):.3f} s, on "
                  f"{med(con, 'step_s'):.3f} s per step: {_pct(med(con, 'step_s'), med(coff, 'step_s')):+.2f}% "
                  f"(95% bootstrap interval {cci[0]:+.2f}% .. {cci[1]:+.2f}%)")
    s_on, s_off = med(on, "step_s"), med(off, "step_s")
    pct = _pct(s_on, s_off)
    # spread: the per-run overheads of the paired runs, so one slow run of one arm shows up as spread
    pairs = [_pct(a["step_s"], b["step_s"]) for a, b in zip(on, off)]
    ci = bootstrap_interval([r["step_s"] for r in on], [r["step_s"] for r in off])
    met = ci[1] <= GOAL_PCT  # the interval's upper bound, not the median
    how = "pairs run at once, one core each" if args.concurrent else "interleaved runs"
    pooled = f"{len(on)} pairs pooled from {args.campaigns} campaigns" if args.campaigns > 1 else f"{len(on)} runs"
    print(f"seconds per step (median of {pooled} x {steps} steps, {how}): off (plain client through sglang-router) "
          f"{s_off:.3f} s [{min(r['step_s'] for r in off):.3f}-{max(r['step_s'] for r in off):.3f}] | on {s_on:.3f} s "
          f"[{min(r['step_s'] for r in on):.3f}-{max(r['step_s'] for r in on):.3f}] | overhead {pct:+.2f}% "
          f"(paired runs {min(pairs):+.1f}% .. {max(pairs):+.1f}%, median {statistics.median(pairs):+.2f}%; "
          f"95% bootstrap interval {ci[0]:+.2f}% .. {ci[1]:+.2f}%; goal <= {GOAL_PCT}%: "
          f"{'met (the upper bound is within it)' if met else 'not met (the upper bound is above it)'})")
    # Where the time and the CPU go: wall time per phase, and CPU per step of the whole host (every process:
    # engines, router, sandboxes, standby, this driver) and of the driver alone (the trainer's process, where
    # Belayer's client and monitor run). CPU is what an arm adds to 2 shared cores whatever their contention.
    # Run at once, the host's CPU holds both arms: only the roles, each arm's own processes, are read.
    rows = []
    phases = [("gen_s", "generation (s)"), ("barrier_s", "pause..resume (s)")]
    phases += [] if args.concurrent else [("cpu_host_s", "host CPU (s)")]
    for k, name in phases + [("cpu_driver_s", "driver CPU (s)")]:
        p = [_pct(a[k], b[k]) for a, b in zip(on, off)]
        rows.append((k, med(off, k), med(on, k), _pct(med(on, k), med(off, k)), min(p), max(p)))
        print(f"  {name:<18} off {rows[-1][1]:7.3f}  on {rows[-1][2]:7.3f}  {rows[-1][3]:+6.2f}% "
              f"(paired {min(p):+.1f}% .. {max(p):+.1f}%)")
    # The wall time by part, so a difference the CPU does not explain has a place: the barrier's parts, and a
    # trajectory's (a sum over one trajectory; four run at a time, so they overlap and do not add up to a step).
    def parts(title: str, keys: list[tuple[str, str]]) -> None:
        print(f"  {title} (s, mean per run): off / on / on - off median (paired min .. max; pairs above zero)")
        for k, name in keys:
            d = [x[k] - y[k] for x, y in zip(on, off)]
            print(f"    {name:<9} {med(off, k):7.3f} / {med(on, k):7.3f} / {statistics.median(d):+7.4f} "
                  f"({min(d):+.4f} .. {max(d):+.4f}; {sum(v > 0 for v in d)} of {len(d)})")

    parts("pause..resume by part", [(k, k[:-2]) for k in ("pause_s", "train_s", "refit_s", "resume_s")])
    parts("one trajectory's wall time by part", [(f"traj_{k}", k[:-2]) for k in _TRAJ + ("rest_s",)])
    # CPU by role (seconds per step, medians). Fault tolerance's own parts (the driver's extra work, the
    # standby, the router it bypasses) measure steadily run to run; the engines' and the sandbox commands'
    # share of the same work varies by tenths of a second between runs of either arm, so their difference is
    # printed with its spread and kept apart.
    roles = _ROLES[:-1] if args.concurrent else _ROLES
    diffs: dict[str, list[float]] = {}
    print("  CPU per step by role (s): off / on / on - off median (paired min .. max)")
    for k in roles:
        diffs[k] = [x[f"role_{k}"] - y[f"role_{k}"] for x, y in zip(on, off)]
        print(f"    {k:<9} {med(off, f'role_{k}'):7.3f} / {med(on, f'role_{k}'):7.3f} / "
              f"{statistics.median(diffs[k]):+7.3f} ({min(diffs[k]):+.3f} .. {max(diffs[k]):+.3f})")
    if args.concurrent:
        # All the CPU the arm's core ran per step: its roles plus Ray's and Podman's daemons, the containers and
        # the kernel's work for them. Pinned, nothing of the other arm is in it.
        d = [x["core_busy"] - y["core_busy"] for x, y in zip(on, off)]
        print(f"    the core  {med(off, 'core_busy'):7.3f} / {med(on, 'core_busy'):7.3f} / "
              f"{statistics.median(d):+7.3f} ({min(d):+.3f} .. {max(d):+.3f}; {sum(v > 0 for v in d)} of {len(on)} "
              f"pairs above zero) = {statistics.median(d) / s_off * 100:+.2f}% of the arm's core time "
              f"(busy {med(off, 'core_busy') / s_off * 100:.0f}% / {med(on, 'core_busy') / s_on * 100:.0f}%)")
    if args.json:
        Path(args.json).write_text(json.dumps({"on": on, "off": off}, indent=1))
    # The base of the CPU shares: the host's CPU per step, or at once the one core an arm had per step.
    base, of = (s_off, "of the arm's core time") if args.concurrent else (med(off, "cpu_host_s"), "of the host's CPU")
    steady = sum(statistics.median(diffs[k]) for k in ("driver", "standby", "router"))
    shared = sum(statistics.median(diffs[k]) for k in ("engines", "commands"))
    spread = (sum(min(diffs[k]) for k in ("engines", "commands")), sum(max(diffs[k]) for k in ("engines", "commands")))
    # one slow run of either arm decides min and max; the sign count says whether the rest agree
    above = sum(e + c > 0 for e, c in zip(diffs["engines"], diffs["commands"]))
    steady_pct, shared_pct = steady / base * 100, shared / base * 100
    print(f"  CPU fault tolerance adds per step: driver + standby + router {steady:+.3f} s = {steady_pct:+.2f}% {of} "
          f"per step; engines + commands {shared:+.3f} s = {shared_pct:+.2f}% "
          f"(paired {spread[0]:+.3f} .. {spread[1]:+.3f} s; {above} of {len(on)} pairs above zero)")
    print(f"  readiness probes (/health_generate) per step, on arm: {med(on, 'probes'):.1f} sent, "
          f"{med(on, 'probes_skipped'):.1f} skipped (the engine streamed tokens within the probe interval)")
    print(f"  sandbox checkpoints per step, on arm: {med(on, 'checkpoints'):.2f} (the adaptive policy's choice)")
    if args.on_override:
        print(f"'on' arm with: {' '.join(args.on_override)}")
    fig = {k: v for k, _, _, v, _, _ in rows}
    host = "" if args.concurrent else f"host_cpu_overhead_pct={fig['cpu_host_s']:.2f} "
    print(f"RESULT step_s_off={s_off:.3f} step_s_on={s_on:.3f} overhead_pct={pct:.2f} "
          f"overhead_min_pct={min(pairs):.2f} overhead_max_pct={max(pairs):.2f} "
          f"overhead_pairs_median_pct={statistics.median(pairs):.2f} "
          f"overhead_ci95_lo_pct={ci[0]:.2f} overhead_ci95_hi_pct={ci[1]:.2f} "
          f"gen_overhead_pct={fig['gen_s']:.2f} barrier_overhead_pct={fig['barrier_s']:.2f} "
          f"{host}driver_cpu_overhead_pct={fig['cpu_driver_s']:.2f} "
          f"steady_cpu_pct={steady_pct:.2f} shared_cpu_pct={shared_pct:.2f} shared_pairs_above_zero={above} "
          f"probes_per_step={med(on, 'probes'):.1f} checkpoints_per_step={med(on, 'checkpoints'):.2f} "
          f"mode={'concurrent' if args.concurrent else 'interleaved'} runs={runs} campaigns={args.campaigns} "
          f"pairs={len(on)} steps={steps} goal_pct={GOAL_PCT} goal_met={'yes' if met else 'no'} "
          f"ratio={s_on / s_off:.4f}")


if __name__ == "__main__":
    main()
