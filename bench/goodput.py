"""Goodput under a fault rate: the fraction of a training job's time that is useful, with Belayer and without.

The reference loop (`belayer run`'s main job: 4 CPU engines behind sglang-router, multi-turn rollouts in Podman
sandboxes, a learner with checkpoints) does a fixed amount of work (--steps training steps) under a seeded
Poisson schedule of mixed real faults at a mean time between faults (--mtbf-s; several values give the curve).
Arms, each with the same schedule (fault times on the arm's own clock, from its first step):

- fault-free: the job with fault tolerance off and no fault (the reference time for the work);
- on: Belayer on, the demo recipe's defaults (a standby, token-level resume, sandbox restore, learner restart);
- restart: no in-run recovery (fault tolerance off): a fault ends the job (by its own path: a failed request,
  a failed trajectory, a dead learner, or for a hang the step timeout --hang-timeout-s; a job still running
  that long plus 60 s after a fault, e.g. a refit waiting on a stopped engine, is cut); the bench's supervisor
  restarts it from the learner's newest complete checkpoint (ReferenceLoop's `resume_from`): engines
  cold-start, sandboxes from scratch. Ray stays up between restarts (a real restart pays Ray's start too:
  the arm is measured in its favour).

Every arm runs under the same supervisor: a Belayer run that failed would be restarted the same way, and
counted. Faults (each delivered by belayer_plugin/chaos/injector.py's own delivery functions, to a target
verified live, recorded as an `inject` event): engine server SIGKILL, engine hang (SIGSTOP), engine Ray actor
SIGKILL, sandbox container kill before an action, learner SIGKILL. Each is delivered at the first moment after
its due time at which its kind has a target: engine faults while rollouts are generating, a sandbox kill at the
next action, a learner kill at the next step's update. A fault not delivered by the end of the arm's work
fails the run, unless it fell due after the arm's last generation phase (nothing of its kind left to hit:
listed as outside the run). A sandbox kill *during a checkpoint* is not in the mix: with the recipe's adaptive
checkpoint policy the demo's short trajectories take no checkpoint, so it has no target.

Goodput = fault-free time for the work / the arm's time for the same work, each from the arm's first training
step to the end of its last (the first start-up, which every arm pays once, is left out; every restart's is
in). This shared 2-core VM drifts by +-20% between runs of the same work, so the bench also prints goodput at
each arm's own pace (the fault-free time rescaled by the arm's median undisturbed step over the fault-free
run's; Belayer's own failure-free overhead, measured by bench/overhead.py, is then left out of it). Each
repetition runs the arms with a new schedule seed; the figure is the mean over repetitions with a
percentile bootstrap interval over them (bench/bootstrap.py). Also: wasted tokens (generated and thrown
away) and sandbox actions, from the run's events and the steps it redid; time below full strength (an engine
slot not HEALTHY on the on arm; no job at all between a fault and the restarted job's first step on the
restart arm); where the on arm's lost time goes (each step's excess over the same fault-free step, by the
fault kinds delivered in it); each arm's trained outcome (every step completed; batches and losses equal to
the fault-free run's, required where the recipe is greedy).

Goal (issue 45): goodput_on >= 0.95 at one fault per minute and >= 1.5x the restart arm; `met` only when the
interval's lower bound meets both.
Usage: python bench/goodput.py [--quick] [--steps N] [--reps R] [--mtbf-s S [S ...]] [--hang-timeout-s T]
       [--seed K] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bootstrap  # noqa: E402  (bench/, the script's own directory)
from belayer_plugin.config import load_belayer_config  # noqa: E402
from belayer_plugin.loop import ReferenceLoop  # noqa: E402
from goodput_faults import KINDS, FaultDriver, make_schedule  # noqa: E402  (the schedule and its delivery)

GOAL_ON, GOAL_RATIO = 0.95, 1.5  # issue 45
ARMS = ("on", "restart")
# The demo recipe, with 4 engines and 4 prompts a step (8 trajectories of 3 turns: every engine has work)
BASE = ["belayer.engines.num_engines=4", "belayer.chaos.enabled=false", "loop.prompts_per_step=4"]


def _overrides(arm: str, steps: int, hang_timeout_s: float) -> list[str]:
    ft = "true" if arm == "on" else "false"
    return BASE + [f"belayer.use_fault_tolerance={ft}", f"loop.num_steps={steps}",
                   f"loop.step_timeout_s={hang_timeout_s:g}"]


async def run_arm(arm: str, schedule: list[tuple[float, str]], seed: int, steps: int, hang_timeout_s: float,
                  cap_s: float, workdir: Path) -> dict:
    """One arm under the supervisor: runs the job, restarts it from its newest checkpoint when it ends early,
    until every step is done or the arm has run `cap_s` seconds; returns its figures and outcome."""
    driver = FaultDriver(schedule, seed)
    segs: list[dict] = []
    by_step: dict[int, dict] = {}  # step -> the run of it that counted (the latest)
    redone: list[dict] = []  # completed steps thrown away by a restart (re-run later)
    events: list[Any] = []
    prev: Optional[Path] = None
    capped = False
    tpt = None
    unrecorded: set[int] = set()
    while True:
        run_dir = workdir / f"{arm}-{len(segs)}"
        cfg, raw = load_belayer_config("demo", _overrides(arm, steps, hang_timeout_s) + [f"belayer.run_dir={run_dir}"])
        tpt = raw.loop.tokens_per_turn
        loop = ReferenceLoop(cfg, raw, progress=False, on_step=driver.on_step, resume_from=prev)
        for k in [k for k in by_step if k > loop.resumed_step]:  # done, but after the checkpoint resumed from
            redone.append(by_step.pop(k))
        # trained and checkpointed, but the job was cut before the step's end was recorded (in its refit)
        unrecorded |= {k for k in range(1, loop.resumed_step + 1) if k not in by_step}
        driver.attach(loop, len(segs))
        t_seg = time.monotonic()
        task = asyncio.ensure_future(loop.run())
        pump = asyncio.ensure_future(driver.pump())
        cut = ""
        left = cap_s - (time.monotonic() - (driver.t0 or t_seg))
        if not cfg.use_fault_tolerance:
            # A fault ends the job by its own path; a hang would outlast anything but a watchdog's timeout
            hit = asyncio.ensure_future(driver.hit.wait())
            await asyncio.wait({task, hit}, timeout=max(1.0, left), return_when=asyncio.FIRST_COMPLETED)
            if hit.done() and not task.done():
                await asyncio.wait({task}, timeout=hang_timeout_s + 60)
                cut = "" if task.done() else "watchdog"
            hit.cancel()
        else:
            await asyncio.wait({task}, timeout=max(1.0, left))
        if not task.done():
            cut = cut or "cap"
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        pump.cancel()
        await asyncio.gather(pump, return_exceptions=True)
        rep = task.result() if not task.cancelled() and task.exception() is None else None
        status = rep["status"] if rep else cut
        t_end_seg = time.monotonic()
        for s in loop.steps:
            s = dict(s, traj=sorted((t["id"], t["digest"]) for t in loop.trajectories if t["step"] == s["step"]),
                     actions=sum(t["actions"] for t in loop.trajectories if t["step"] == s["step"]), segment=len(segs))
            by_step[s["step"]] = s
        events.extend(loop.events.events)
        segs.append({"run_dir": str(run_dir), "status": status, "resumed_after": loop.resumed_step,
                     "steps_done": [s["step"] for s in loop.steps], "wall_s": round(t_end_seg - t_seg, 2),
                     "end_s": round(t_end_seg - (driver.t0 or t_seg), 2),
                     "error": ": ".join(str(v) for v in ((rep or {}).get("error") or {}).values()
                                        if isinstance(v, str) and "Traceback" not in v)[:300]})
        print(f"  [{arm}] run {len(segs)}: {status}, steps {segs[-1]['steps_done'] or '-'} (resumed after "
              f"{loop.resumed_step}), {segs[-1]['wall_s']:.1f} s" + (f": {segs[-1]['error'][:160]}" if segs[-1]['error'] else ""),
              flush=True)
        if sorted(set(by_step) | unrecorded) == list(range(1, steps + 1)):  # the work is done
            break
        if cut == "cap" or (driver.t0 is not None and time.monotonic() - driver.t0 > cap_s):
            capped = True
            break
        prev = run_dir
    t_work = (driver.last_end - driver.t0) if driver.t0 and driver.last_end and not capped else None
    missed, outside = driver.undelivered(t_work if t_work is not None else driver.now())
    return {"arm": arm, "t_work_s": t_work, "capped": capped, "segments": segs, "steps": by_step, "redone": redone,
            "unrecorded": sorted(unrecorded - set(by_step)),
            "faults": [f.__dict__ for f in driver.faults if f.delivered_s is not None], "undelivered": [f.__dict__ for f in missed],
            "outside": [f.__dict__ for f in outside], "events": events, "t0_wall": driver.t0_wall,
            "t0": driver.t0, "step_start": driver.step_start, "tokens_per_turn": tpt,
            "turns": raw.loop.turns, "temperature": float(raw.loop.temperature)}


def waste(a: dict) -> dict:
    """Tokens and sandbox actions generated and thrown away, and seconds below full strength, from the
    arm's events and the steps it redid (a failed step's own partial work is not in a run's records: the
    restart arm's figures are lower bounds)."""
    tpt, turns = a["tokens_per_turn"], a["turns"]
    tok = act = 0
    for e in a["events"]:
        if e.component == "rollout" and e.kind == "rolled_back":  # the failed turn and the discarded ones
            tok += (int(e.figures.get("discarded", 0)) + 1) * tpt
            act += int(e.figures.get("discarded", 0))
        elif e.component == "sandbox" and e.kind == "rollback":
            act += int(e.figures.get("replayed_actions", 0))
        elif e.component == "recovery" and e.kind == "resume_refused":  # restarted from the prompt
            tok += int(e.figures.get("committed", 0))
    for s in a["redone"]:
        tok += len(s["traj"]) * turns * tpt
        act += s["actions"]
    below = 0.0
    if a["arm"] == "on" and a["t_work_s"]:
        t0, t1 = a["t0_wall"], a["t0_wall"] + a["t_work_s"]
        state: dict[str, tuple[str, float]] = {}
        down: list[tuple[float, float]] = []
        for e in a["events"]:
            if e.component == "fleet" and e.kind == "transition" and e.to_state:
                prev = state.get(e.subject)
                if prev and prev[0] not in ("HEALTHY", "SUSPECT"):
                    down.append((prev[1], e.t))
                state[e.subject] = (e.to_state, e.t)
        down += [(t, t1) for st, t in state.values() if st not in ("HEALTHY", "SUSPECT")]
        below = _union([(max(t0, x), min(t1, y)) for x, y in down if y > t0 and x < t1])
    elif a["arm"] == "restart":  # no job training: from the fault that ended one to the next one's first step
        down_from: Optional[float] = None
        for i, seg in enumerate(a["segments"]):
            starts = [t for (g, _), t in a["step_start"].items() if g == i]
            if down_from is not None and starts:
                below += max(0.0, min(starts) - down_from)
                down_from = None
            if seg["status"] != "ok" and down_from is None:
                hit = [f["delivered_s"] for f in a["faults"] if f["segment"] == i]
                down_from = min(hit) if hit else seg["end_s"]
    return {"wasted_tokens": tok, "wasted_actions": act, "below_full_s": round(below, 2)}


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for x, y in sorted(spans):
        if y <= end:
            continue
        total += y - max(x, end)
        end = y
    return total


def outcome(a: dict, ff: dict) -> tuple[bool, str]:
    """Every step done; batches (trajectory digests) and losses equal to the fault-free run's. Required where the
    recipe is greedy; reported otherwise (seeded sampling is exact on the CPU engine, so they match too)."""
    steps = a["steps"]
    n = len(ff["steps"])
    if a["capped"]:  # a result, not a failure: the arm did not finish the work within its cap
        return True, f"capped: steps {sorted(steps)} of {n} done within the cap"
    if sorted(set(steps) | set(a["unrecorded"])) != list(range(1, n + 1)):
        return False, f"steps done {sorted(steps)} of {n}"
    same_b = sum(steps[k]["traj"] == ff["steps"][k]["traj"] for k in steps)
    same_l = sum(abs(steps[k]["loss"] - ff["steps"][k]["loss"]) <= 1e-6 * max(1.0, abs(ff["steps"][k]["loss"]))
                 for k in steps)
    m = len(steps)  # a step whose job was cut after its checkpoint (unrecorded) is done, its batch not recorded
    text = (f"{n}/{n} steps, batches equal to fault-free {same_b}/{m}, losses {same_l}/{m}"
            + (f" (steps {a['unrecorded']} trained, job cut before their end was recorded)" if a["unrecorded"] else ""))
    ok = a["temperature"] > 0 or (same_b == m and same_l == m)
    return ok, text


def goodput_paced(a: dict, ff: dict) -> Optional[float]:
    """Goodput against the fault-free time rescaled to the arm's own pace: the fault-free time x (the median
    of the arm's steps no fault was delivered in / the fault-free run's median step). The machine's drift
    between the two runs (+-20% on this shared 2-core VM) cancels; what slows every step of an arm alike
    (Belayer's failure-free overhead, bench/overhead.py) is then not in it."""
    hit = {(f["segment"], f["step"]) for f in a["faults"]}
    mine = [s["step_s"] for k, s in a["steps"].items() if (s["segment"], k) not in hit]
    if not a["t_work_s"] or not mine:
        return None
    pace = statistics.median(mine) / statistics.median(s["step_s"] for s in ff["steps"].values())
    return ff["t_work_s"] * pace / a["t_work_s"]


def breakdown(a: dict, ff: dict) -> dict[str, float]:
    """Where the arm's lost time went: each step's excess over the same fault-free step, by the fault kinds
    delivered in it (several in one step: one cause named by all of them), 'no fault' for the rest; restarts
    (the arm's time outside its counted steps: the job's end, a cold start, redone steps) as 'restarts'."""
    out: dict[str, float] = {}
    counted = 0.0
    for k, s in a["steps"].items():
        counted += s["step_s"]
        kinds = sorted({f["kind"] for f in a["faults"] if f["step"] == k and f["segment"] == s["segment"]})
        cause = "+".join(kinds) or "no fault"
        out[cause] = out.get(cause, 0.0) + s["step_s"] - ff["steps"][k]["step_s"]
    if a["t_work_s"] is not None:
        gap = a["t_work_s"] - counted - (ff["t_work_s"] - sum(s["step_s"] for s in ff["steps"].values()))
        if len(a["segments"]) > 1:
            out["restarts"] = gap
        else:
            out["between steps"] = gap
    return {k: round(v, 2) for k, v in out.items()}


def _plot(res: dict[float, dict], path: Path, steps: int) -> None:
    """Goodput against the mean time between faults, one line per arm, the 95% intervals as bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = sorted(res)
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    for arm, ci, color in (("on", "ci_on", "tab:green"), ("restart", "ci_rs", "tab:red")):
        ys = [res[x][arm] for x in xs]
        err = [[y - res[x][ci][0] for x, y in zip(xs, ys)], [res[x][ci][1] - y for x, y in zip(xs, ys)]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, color=color,
                    label="Belayer on" if arm == "on" else "restart from checkpoint")
    ax.axhline(GOAL_ON, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("mean time between faults (s)")
    ax.set_ylabel("goodput (fault-free time / time)")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"Goodput, {steps} steps of the main job, 4 CPU engines")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=0, help="training steps of work (default 40; --quick 20)")
    ap.add_argument("--reps", type=int, default=0, help="repetitions, each with its own schedule (default 5; --quick 2)")
    ap.add_argument("--mtbf-s", type=float, nargs="+", default=None,
                    help="mean seconds between faults, one curve point each (default 60 120 30; --quick 60)")
    ap.add_argument("--hang-timeout-s", type=float, default=120.0,
                    help="the step timeout that ends a hung job without in-run recovery (loop.step_timeout_s)")
    ap.add_argument("--cap", type=float, default=6.0, help="an arm stops at this many times the fault-free time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="also write every arm's figures to PATH")
    ap.add_argument("--png", metavar="PATH", help="also draw goodput against the mean time between faults")
    args = ap.parse_args()
    steps = args.steps or (20 if args.quick else 40)
    reps = args.reps or (2 if args.quick else 5)
    mtbfs = args.mtbf_s or ([60.0] if args.quick else [60.0, 120.0, 30.0])
    work = Path(tempfile.mkdtemp(prefix="belayer-bench-goodput-"))
    print(f"goodput bench: {steps} steps of work, 4 CPU engines, {reps} repetition(s), mtbf {mtbfs} s, hang "
          f"timeout (restart arm) {args.hang_timeout_s:g} s, fault kinds {', '.join(KINDS)}; work dir {work}", flush=True)
    rows: list[dict] = []
    ok_all = True
    for r in range(reps):
        ffr = asyncio.run(run_arm("ff", [], 0, steps, args.hang_timeout_s, 1e9, work / f"r{r}"))
        if ffr["t_work_s"] is None or sorted(ffr["steps"]) != list(range(1, steps + 1)):
            raise SystemExit(f"the fault-free run failed: {ffr['segments']}")
        print(f"rep {r + 1}: fault-free {ffr['t_work_s']:.1f} s for {steps} steps", flush=True)
        for m in mtbfs:
            seed = args.seed * 1000 + r * 10 + mtbfs.index(m)
            sched = make_schedule(seed, m, args.cap * ffr["t_work_s"])
            print(f"rep {r + 1}, mtbf {m:g} s, schedule seed {seed}: "
                  + ", ".join(f"{t:.1f}s {k}" for t, k in sched), flush=True)
            for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
                a = asyncio.run(run_arm(arm, sched, seed, steps, args.hang_timeout_s, args.cap * ffr["t_work_s"],
                                        work / f"r{r}-m{m:g}"))
                good, text = outcome(a, ffr)
                fails = []
                if a["undelivered"]:
                    fails.append(f"{len(a['undelivered'])} fault(s) due in the run not delivered: "
                                 + ", ".join(f"#{f['i']} {f['kind']} at {f['t']:.1f} s" for f in a["undelivered"]))
                if not good:
                    fails.append(f"outcome: {text}")
                gp = ffr["t_work_s"] / a["t_work_s"] if a["t_work_s"] else None
                paced = goodput_paced(a, ffr)
                w = waste(a)
                row = {"rep": r, "mtbf_s": m, "arm": arm, "goodput": gp, "goodput_paced": paced, "t_work_s": a["t_work_s"],
                       "ff_s": ffr["t_work_s"], "capped": a["capped"], "restarts": len(a["segments"]) - 1,
                       "faults": a["faults"], "outside": a["outside"], "outcome": text, "failures": fails,
                       "breakdown": breakdown(a, ffr) if a["t_work_s"] else {}, **w, "segments": a["segments"]}
                rows.append(row)
                ok_all = ok_all and not fails
                kinds = ", ".join(f"{f['kind']}@{f['delivered_s']:.1f}s(step {f['step']})" for f in a["faults"])
                print(f"  {arm:<8} goodput {'capped' if gp is None else format(gp, '.3f')} (at its own pace "
                      f"{'-' if paced is None else format(paced, '.3f')}) "
                      f"({'-' if a['t_work_s'] is None else format(a['t_work_s'], '.1f')} s); faults delivered "
                      f"{len(a['faults'])}: {kinds or '-'}; restarts {row['restarts']}; wasted tokens "
                      f"{'>=' if arm == 'restart' else ''}{w['wasted_tokens']}, actions "
                      f"{'>=' if arm == 'restart' else ''}{w['wasted_actions']}; below full strength "
                      f"{w['below_full_s']} s; {text}" + (f"; outside the run: {len(a['outside'])}" if a['outside'] else "")
                      + (f"; FAILED: {'; '.join(fails)}" if fails else ""), flush=True)
                if row["breakdown"]:
                    print(f"    lost time by cause (s): {row['breakdown']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))

    def vals(m: float, arm: str, key: str = "goodput") -> list[float]:
        # a capped arm counts at its cap (its true goodput is lower: the figure is then an upper bound)
        return [(x[key] if x[key] is not None else 1.0 / args.cap) for x in rows
                if x["mtbf_s"] == m and x["arm"] == arm]

    print("goodput (mean over repetitions; 95% bootstrap interval over them):")
    print("  mtbf_s  on                     restart                ratio on/restart")
    res: dict[float, dict] = {}
    for m in mtbfs:
        on, rs = vals(m, "on"), vals(m, "restart")
        n = len(on)
        ci_on = bootstrap.interval(n, lambda idx: statistics.fmean(on[i] for i in idx))
        ci_rs = bootstrap.interval(n, lambda idx: statistics.fmean(rs[i] for i in idx))
        ci_ra = bootstrap.interval(n, lambda idx: statistics.fmean(on[i] for i in idx) /
                                   statistics.fmean(rs[i] for i in idx))
        pon, prs = vals(m, "on", "goodput_paced"), vals(m, "restart", "goodput_paced")
        res[m] = {"on": statistics.fmean(on), "restart": statistics.fmean(rs), "ci_on": ci_on, "ci_rs": ci_rs,
                  "ci_ratio": ci_ra, "ratio": statistics.fmean(on) / statistics.fmean(rs), "n": n,
                  "on_paced": statistics.fmean(pon), "restart_paced": statistics.fmean(prs),
                  "ci_on_paced": bootstrap.interval(n, lambda idx: statistics.fmean(pon[i] for i in idx))}
        x = res[m]
        print(f"  {m:6g}  {x['on']:.3f} [{ci_on[0]:.3f}-{ci_on[1]:.3f}]  {x['restart']:.3f} "
              f"[{ci_rs[0]:.3f}-{ci_rs[1]:.3f}]  {x['ratio']:.2f} [{ci_ra[0]:.2f}-{ci_ra[1]:.2f}]; at each arm's own "
              f"pace: on {x['on_paced']:.3f} [{x['ci_on_paced'][0]:.3f}-{x['ci_on_paced'][1]:.3f}], restart "
              f"{x['restart_paced']:.3f}")
    if args.png:
        _plot(res, Path(args.png), steps)
    m = 60.0 if 60.0 in res else mtbfs[0]
    x = res[m]
    for arm in ARMS:  # where the lost time went at the headline rate, summed over repetitions
        lost: dict[str, float] = {}
        for row in rows:
            if row["mtbf_s"] == m and row["arm"] == arm:
                for k, v in row["breakdown"].items():
                    lost[k] = lost.get(k, 0.0) + v
        if lost:
            top = max(lost, key=lambda k: lost[k])
            print(f"{arm} arm at mtbf {m:g} s, lost seconds by cause (summed over repetitions): "
                  + ", ".join(f"{k} {v:+.1f}" for k, v in sorted(lost.items(), key=lambda kv: -kv[1]))
                  + f"; the largest: {top}")
    met = x["n"] >= 2 and x["ci_on"][0] >= GOAL_ON and x["ci_ratio"][0] >= GOAL_RATIO
    print(f"RESULT goodput_on={x['on']:.3f} goodput_restart={x['restart']:.3f} goodput_round=na "
          f"ratio={x['ratio']:.2f} goodput_on_ci95={x['ci_on'][0]:.3f}..{x['ci_on'][1]:.3f} "
          f"ratio_ci95={x['ci_ratio'][0]:.2f}..{x['ci_ratio'][1]:.2f} goodput_on_paced={x['on_paced']:.3f} "
          f"goodput_restart_paced={x['restart_paced']:.3f} mtbf_s={m:g} steps={steps} reps={x['n']} "
          f"hang_timeout_s={args.hang_timeout_s:g} goal_on={GOAL_ON} goal_ratio={GOAL_RATIO} "
          f"goal_met={'yes' if met else 'no'} checks={'ok' if ok_all else 'FAILED'}")
    if not ok_all:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
