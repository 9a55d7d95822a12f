"""The run report: a terminal summary table, report.json, and a PNG timeline of the recovery events."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from belayer_plugin.events import EventLog

# Event kinds that make up the recovery story, by component (the timeline's rows).
_TIMELINE = {
    "chaos": ("inject", "missed"),
    "monitor": ("detected",),
    "fleet": ("deregistered", "registered", "below_floor", "weight_version_mismatch"),
    "restart": ("restarted", "backoff"),
    "shadow": ("handover", "shadow_ready", "shadow_lost"),
    "recovery": ("resumed", "request_failed_on_engine"),
    "sandbox": ("restore", "rollback", "checkpoint"),
    "learner": ("died", "restarted", "resumed"),
    "loop": ("failed",),
}


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
    if rep["lost"]:
        out.append(f"LOST: {len(rep['lost'])} trajectories; first: {rep['lost'][0]['error']}")
    if rep["error"]:
        out.append(f"ERROR {rep['error']['type']}: {rep['error']['message'][:600]}")
    return "\n".join(out)


def timeline_png(events: EventLog, path: Path) -> None:
    """Draws the recovery events over time, one row per component."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evs = [e for e in events.events if e.kind in _TIMELINE.get(e.component, ()) or
           (e.component == "rollout" and e.kind == "rolled_back")]
    rows = list(_TIMELINE) + ["rollout"]
    t0 = min((e.t for e in events.events), default=0.0)
    fig, ax = plt.subplots(figsize=(11, 4.5))
    markers = "o^sDv<>pP*X"
    kinds = sorted({(e.component, e.kind) for e in evs})
    for i, (comp, kind) in enumerate(kinds):
        xs = [e.t - t0 for e in evs if (e.component, e.kind) == (comp, kind)]
        ax.scatter(xs, [rows.index(comp)] * len(xs), marker=markers[i % len(markers)], s=50, label=f"{comp}: {kind}")
    for e in events.events:
        if e.component == "fleet" and e.kind == "phase":
            ax.axvline(e.t - t0, color="0.85", lw=0.8, zorder=0)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel("seconds since start (grey lines: phase changes)")
    ax.set_title("Belayer recovery timeline")
    if kinds:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
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
