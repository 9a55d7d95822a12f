"""The run report: a terminal summary table, report.json, and a PNG timeline of the recovery events.

Owns: the run report's table, report.json and timeline.png, all from events. Must not: read any component's
state directly.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from belayer_plugin.events import EventLog

def build(loop: Any, status: str, error: Any, duration_s: float) -> dict:
    """Assembles the report of a ReferenceLoop run."""
    evs = loop.events.events
    kinds = Counter((e.component, e.kind) for e in evs)
    cfg = loop.cfg
    return {
        "status": status,
        "error": error,
        "duration_s": round(duration_s, 2),
        "run_dir": str(loop.run_dir),
        "config": {"use_fault_tolerance": cfg.use_fault_tolerance, "engines": cfg.engines.num_engines,
                   "engine_kind": cfg.engines.kind, "standby": cfg.shadow.num_standby,
                   "chaos": {"enabled": cfg.chaos.enabled, "kind": cfg.chaos.kind, "trigger": cfg.chaos.trigger,
                             "at": cfg.chaos.at, "victim_state": cfg.chaos.victim_state,
                             "scenario": cfg.chaos.scenario, "expect": list(cfg.chaos.expect)},
                   "loop": loop.loop.__dict__},
        "steps": loop.steps,
        "trajectories": loop.trajectories,
        "lost": loop.lost,
        "recovery": {
            "faults_injected": kinds[("chaos", "inject")],  # delivered to a live target
            "faults_missed": kinds[("chaos", "missed")],  # the target was gone: nothing was hit
            "engine_deaths_detected": kinds[("monitor", "detected")],
            "cold_restarts": kinds[("restart", "restarted")],
            "handovers": kinds[("shadow", "handover")],
            "requests_resumed": kinds[("recovery", "resumed")],
            "env_restores": kinds[("rollout", "rolled_back")],
            "learner_restarts": kinds[("learner", "restarted")],
            "engines_retired": sum(1 for e in evs if e.kind == "transition" and e.to_state == "RETIRED"),
        },
        "final_states": loop.fleet.states() if loop.fleet is not None else {},
        # Whether the run ended at full strength, after waiting for recoveries under way (loop._settle_fleet)
        "fleet_at_end": getattr(loop, "fleet_at_end", {}),
        # Evidence for the chaos checks that Belayer's events did not write: each live engine's own counters
        # and request ledger at the end, and the runtime's CRIU probe under the checkpoint mode asked for.
        "engine_evidence": getattr(loop, "engine_evidence", {}),
        "sandbox_evidence": getattr(loop, "sandbox_evidence", {}),
        # Every fleet verdict with its evidence (fleet/nodes.py) and every quarantined request.
        "node_exclusions": [{"node": e.subject, "kind": e.kind, "reason": e.reason} for e in evs
                            if e.kind in ("node_excluded", "node_exclusion_refused", "node_readmitted")],
        "poison_requests": [{"rid": e.subject, "reason": e.reason} for e in evs if e.kind == "poison_request"],
        "events": len(evs),
    }


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([fmt(headers), "  ".join("-" * w for w in widths), *(fmt(r) for r in cells)])


def render(rep: dict) -> str:
    """The human-readable summary printed at the end of a run."""
    out = [f"\n=== Belayer run: {rep['status'].upper()} in {rep['duration_s']:.1f} s "
           f"(fault tolerance {'on' if rep['config']['use_fault_tolerance'] else 'off'}) ==="]
    ch = rep["config"]["chaos"]
    if ch["enabled"]:
        out.append(f"chaos: {ch['kind']} at {ch['trigger']} {ch['at']:g} (victim state {ch['victim_state']})")
    if rep["steps"]:
        out.append(_table(["step", "trajectories", "mean reward", "loss", "weights", "engines on it", "seconds"],
                          [[s["step"], s["trajectories"], f"{s['mean_reward']:+.2f}", f"{s['loss']:+.4f}", s["version"],
                            len(s["engines"]), f"{s['step_s']:.1f}"] for s in rep["steps"]]))
    r = rep["recovery"]
    out.append(_table(["recovery", "count"], [[k.replace("_", " "), v] for k, v in r.items()]))
    for x in rep.get("node_exclusions", []):
        out.append(f"node {x['node'][:12]}: {x['kind'].replace('_', ' ')}: {x['reason']}")
    for x in rep.get("poison_requests", []):
        out.append(f"poison request {x['rid']}: {x['reason']}")
    end = rep.get("fleet_at_end") or {}
    if end and not end.get("full_strength", True):
        out.append(f"fleet at the end: BELOW FULL STRENGTH, {end['serving']} of {end['engines']} engines serving"
                   + (f"; still recovering: {', '.join(end['still_recovering'])}" if end.get("still_recovering") else ""))
    if rep["lost"]:
        out.append(f"LOST: {len(rep['lost'])} trajectories; first: {rep['lost'][0]['error']}")
    if rep["error"]:
        out.append(f"ERROR {rep['error']['type']}: {rep['error']['message'][:600]}")
    return "\n".join(out)


_STATE_COLORS = {"HEALTHY": "#4caf50", "SUSPECT": "#ffb300", "DEAD": "#e53935", "RESTARTING": "#8e24aa",
                 "STALE": "#90a4ae", "RETIRED": "#212121", "STANDBY": "#bbdefb"}
_PHASE_COLORS = {"paused": "#fff3e0", "released": "#fff3e0", "refit": "#e3f2fd"}
_SUB_ROWS = 6  # request bars stacked inside one engine lane


def _fleet_lanes(evs: list[Any], t_end: float) -> tuple[list[str], dict[str, list[tuple[float, float, str]]]]:
    """Engine slots and standbys, each with its (start, end, state) spans over the run."""
    spans: dict[str, list[tuple[float, float, str]]] = {}
    cur: dict[str, tuple[float, str]] = {}
    slots, standbys = [], []

    def close(lane: str, t: float) -> None:
        if lane in cur:
            t0, st = cur.pop(lane)
            spans.setdefault(lane, []).append((t0, t, st))

    for e in evs:
        if e.component == "fleet" and e.kind == "transition" and e.to_state:
            if e.subject not in slots:
                slots.append(e.subject)
            close(e.subject, e.t)
            cur[e.subject] = (e.t, e.to_state)
        elif e.component == "shadow" and e.kind == "shadow_ready":
            if e.subject not in standbys:
                standbys.append(e.subject)
            close(e.subject, e.t)
            cur[e.subject] = (e.t, "STANDBY")
        elif e.component == "shadow" and e.kind in ("shadow_lost", "shadow_failed"):
            close(e.subject, e.t)
        elif e.component == "shadow" and e.kind == "handover":
            close(str(e.figures.get("shadow", "")), e.t)
    for lane in list(cur):
        close(lane, t_end)
    return sorted(slots) + sorted(standbys), spans


def timeline_png(events: EventLog, path: Path) -> None:
    """A picture of the fleet: one lane per engine slot and standby with its health states over time,
    handovers as arrows, every request's segments as bars on the lanes they ran on (a resumed request jumps
    lanes, joined by a dashed line), sandbox checkpoints and restores, chaos faults, phases and refits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    evs = sorted(events.events, key=lambda e: e.t)
    if not evs:
        return
    t0, t_end = evs[0].t, evs[-1].t
    lanes, spans = _fleet_lanes(evs, t_end)
    extra = ["sandboxes", "chaos", "learner"]
    rows = lanes + extra
    y = {name: len(rows) - 1 - i for i, name in enumerate(rows)}  # first lane on top
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.62 * len(rows)))
    # Phases (serving is the white background) and refits.
    phase, since = "serving", t0
    for e in evs:
        if e.component == "fleet" and e.kind == "phase":
            if phase in _PHASE_COLORS:
                ax.axvspan(since - t0, e.t - t0, color=_PHASE_COLORS[phase], zorder=0)
            phase, since = e.reason, e.t
        elif e.component == "fleet" and e.kind in ("refit_done", "version_adopted"):
            ax.axvline(e.t - t0, color="#1e88e5", lw=1.0, ls=":", zorder=1)
            ax.text(e.t - t0, len(rows) - 0.45, str(e.figures.get("version", "")), fontsize=7, color="#1e88e5",
                    ha="center")
    if phase in _PHASE_COLORS:
        ax.axvspan(since - t0, t_end - t0, color=_PHASE_COLORS[phase], zorder=0)
    # Health states.
    for lane in lanes:
        for a, b, st in spans.get(lane, []):
            ax.broken_barh([(a - t0, max(b - a, 1e-3))], (y[lane] - 0.42, 0.84),
                           facecolors=_STATE_COLORS.get(st, "#eeeeee"), alpha=0.35, zorder=2)
    # Requests: segments on the lanes they ran on.
    reqs = [e for e in evs if e.component == "generation" and e.kind == "request"]
    free: dict[tuple[str, int], float] = {}
    for e in reqs:
        points = []
        for seg in e.figures.get("segments", []):
            eng, a, b, _s, _e, outcome = seg
            if eng not in y:
                continue
            sub = min(range(_SUB_ROWS), key=lambda k: max(0.0, free.get((eng, k), 0.0) - a))
            free[(eng, sub)] = b
            yy = y[eng] - 0.36 + 0.72 * (sub + 0.5) / _SUB_ROWS
            failed = str(outcome).startswith("failed")
            ax.plot([a - t0, b - t0], [yy, yy], lw=2.2, solid_capstyle="butt", zorder=4,
                    color="#c62828" if failed else ("#6a1b9a" if len(e.figures["segments"]) > 1 else "#37474f"))
            points.append((a - t0, b - t0, yy))
        for (_, b1, y1), (a2, _, y2) in zip(points, points[1:]):
            ax.plot([b1, a2], [y1, y2], ls="--", lw=0.9, color="#6a1b9a", zorder=5)
    # Handovers: arrows from the standby's lane to the slot it took over.
    for e in evs:
        if e.component == "shadow" and e.kind == "handover":
            src = str(e.figures.get("shadow", ""))
            if src in y and e.subject in y:
                ax.annotate("", xy=(e.t - t0, y[e.subject]), xytext=(e.t - t0, y[src]), zorder=6,
                            arrowprops=dict(arrowstyle="->", color="#0d47a1", lw=1.6))
    # Sandboxes, chaos, learner.
    marks = [("sandbox", "checkpoint", "sandboxes", "|", "#455a64", 40),
             ("sandbox", "checkpoint_skipped", "sandboxes", "|", "#b0bec5", 30),
             ("sandbox", "fork", "sandboxes", "v", "#00897b", 60),
             ("sandbox", "restore", "sandboxes", "o", "#2e7d32", 60),
             ("rollout", "rolled_back", "sandboxes", "<", "#c62828", 60),
             ("chaos", "inject", "chaos", "X", "#d50000", 90),
             ("chaos", "missed", "chaos", "x", "#9e9e9e", 60),
             ("learner", "died", "learner", "X", "#d50000", 80),
             ("learner", "restarted", "learner", "^", "#2e7d32", 60),
             ("monitor", "detected", None, "*", "#ff6f00", 90)]
    handles = []
    for comp, kind, lane, m, color, size in marks:
        pts = [(e.t - t0, y[lane] if lane else y.get(e.subject)) for e in evs
               if e.component == comp and e.kind == kind]
        pts = [(x, yy) for x, yy in pts if yy is not None]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=m, s=size, color=color, zorder=7,
                       label=f"{comp}: {kind}")
    ax.set_yticks([y[r] for r in rows], rows)
    ax.set_ylim(-0.6, len(rows) - 0.2)
    ax.set_xlim(0, max(1.0, t_end - t0) * 1.01)
    ax.set_xlabel("seconds since start  (background: orange = paused / memory released, blue = refit; "
                  "dotted lines: weight versions)")
    n_standby = sum(1 for lane in lanes if spans.get(lane) and spans[lane][0][2] == "STANDBY")
    ax.set_title(f"Belayer fleet: {len(lanes) - n_standby} engine slots + {n_standby} standby, {len(reqs)} requests "
                 f"({sum(1 for e in reqs if len(e.figures.get('segments', [])) > 1)} resumed on another lane)")
    handles = [Patch(color=c, alpha=0.5, label=s) for s, c in _STATE_COLORS.items()]
    handles += [plt.Line2D([], [], color="#37474f", lw=2.2, label="request segment"),
                plt.Line2D([], [], color="#6a1b9a", lw=2.2, ls="--", label="resumed request"),
                plt.Line2D([], [], color="#c62828", lw=2.2, label="segment cut by a fault"),
                plt.Line2D([], [], color="#0d47a1", marker=">", lw=1.5, label="handover")]
    h2, _ = ax.get_legend_handles_labels()
    ax.legend(handles=handles + h2, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(rep: dict, run_dir: Path, events: EventLog) -> None:
    """Writes report.json and timeline.png into the run dir and prints the summary."""
    (run_dir / "report.json").write_text(json.dumps(rep, indent=2, default=str))
    try:
        timeline_png(events, run_dir / "timeline.png")
    except Exception as e:  # a plotting problem must not hide the result
        print(f"(timeline not drawn: {e})")
    print(render(rep))
    print(f"report: {run_dir / 'report.json'}\ntimeline: {run_dir / 'timeline.png'}")
