"""Asserts a chaos run's outcome from its JSON report: survival (identical to the fault-free golden run),
a bounded typed failure, or (fault tolerance off) a run that fails or loses work.

python -m belayer_plugin.chaos.check --report R --expect survival --golden G
python -m belayer_plugin.chaos.check --report R --expect bounded_failure --error-type T --max-duration S
python -m belayer_plugin.chaos.check --report R --expect loses_work
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional


def check(report: dict, expect: str, golden: Optional[dict] = None, error_type: str = "",
          max_duration_s: float = 0.0) -> list[str]:
    """Returns the list of violations (empty when the run behaved as expected)."""
    bad = []
    rec = report.get("recovery", {})
    if report["config"]["chaos"]["enabled"] and rec.get("faults_injected", 0) < 1:
        bad.append("no fault was injected: the scenario did not test anything")
    if expect == "survival":
        if report["status"] != "ok":
            bad.append(f"status {report['status']}: {report.get('error')}")
        if report.get("lost"):
            bad.append(f"{len(report['lost'])} trajectories lost")
        if golden is None:
            bad.append("survival needs --golden")
        else:
            got = [(t["id"], t["digest"]) for t in report["trajectories"]]
            want = [(t["id"], t["digest"]) for t in golden["trajectories"]]
            if got != want:
                diff = [g for g, w in zip(got, want) if g != w][:3]
                bad.append(f"trajectories differ from the golden run (token ids or final env state): {diff or 'count'}")
            gs = [(s["version"], round(s["loss"], 6)) for s in golden["steps"]]
            rs = [(s["version"], round(s["loss"], 6)) for s in report["steps"]]
            if gs != rs:
                bad.append(f"training steps differ from the golden run: {rs} vs {gs}")
    elif expect == "bounded_failure":
        if report["status"] != "failed":
            bad.append("expected a typed failure, but the run succeeded")
        elif error_type and (report.get("error") or {}).get("type") != error_type:
            bad.append(f"expected error {error_type}, got {(report.get('error') or {}).get('type')}")
        if max_duration_s and report["duration_s"] > max_duration_s:
            bad.append(f"failure took {report['duration_s']} s, bound {max_duration_s} s")
    elif expect == "loses_work":
        if report["status"] == "ok" and not report.get("lost"):
            bad.append("fault tolerance off, yet nothing failed or was lost: the fault had no effect")
    else:
        bad.append(f"unknown EXPECT {expect!r}")
    return bad


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--report", required=True)
    ap.add_argument("--expect", required=True, choices=["survival", "bounded_failure", "loses_work"])
    ap.add_argument("--golden")
    ap.add_argument("--error-type", default="")
    ap.add_argument("--max-duration", type=float, default=0.0)
    a = ap.parse_args(argv)
    report = json.load(open(a.report))
    golden = json.load(open(a.golden)) if a.golden else None
    bad = check(report, a.expect, golden, a.error_type, a.max_duration)
    r = report.get("recovery", {})
    print(f"[check] EXPECT={a.expect} status={report['status']} faults={r.get('faults_injected')} "
          f"detected={r.get('engine_deaths_detected')} handovers={r.get('handovers')} "
          f"restarts={r.get('cold_restarts')} resumed={r.get('requests_resumed')} env_restores={r.get('env_restores')} "
          f"learner_restarts={r.get('learner_restarts')} -> {'PASS' if not bad else 'FAIL'}")
    for b in bad:
        print(f"[check]   {b}")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
