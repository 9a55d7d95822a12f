"""Asserts a chaos run's outcome from its JSON report and its event log: the fault was delivered to a live
target, the recoveries the scenario declares (`belayer.chaos.expect`) ran, and the run ended as expected:
survival (identical to the fault-free golden run), a bounded typed failure, or (fault tolerance off) a
run that fails or loses work.

python -m belayer_plugin.chaos.check --report R --expect survival --golden G
python -m belayer_plugin.chaos.check --report R --expect bounded_failure --error-type T --max-duration S
python -m belayer_plugin.chaos.check --report R --expect loses_work

Owns: judging a finished chaos run from its report and events (and the engines' own ledgers). Must not: inject
faults or import the fleet, engines or sandboxes: it judges from what the run left.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Optional

Ev = dict  # one events.jsonl record: t, component, subject, kind, reason, figures, ...


def load_events(path: Path) -> list[Ev]:
    """The run's event log (events.jsonl), oldest first."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _find(evs: list[Ev], comp: str, kind: str, since: float = 0.0,
          pred: Callable[[Ev], bool] = lambda e: True) -> list[Ev]:
    return [e for e in evs if e["component"] == comp and e["kind"] == kind and e["t"] >= since and pred(e)]


def _fig(e: Ev, key: str, default=None):
    return (e.get("figures") or {}).get(key, default)


# ---------------------------------------------------------------- the named recoveries
# Each takes (events, the first delivered inject event, run dir) and returns a violation or None. Each
# docstring states the check's precondition (where the fault must land for the recovery to be observable)
# and what it accepts; belayer_plugin/chaos/positions.py refuses, before a run starts, every trigger position
# of a recipe at which a precondition cannot hold, so at every position it accepts the check can pass.
# Faults in the last phase of a run: the loop waits (loop.end_recovery_timeout_s) for every recovery under
# way before it shuts the fleet down, so a check sees the recovery's events wherever the fault landed; a run
# that ended below full strength says so in its report (`fleet_at_end`) and its replacement checks fail.

def _served(rep: dict, rid: str, prompt_tokens: int, committed: int) -> list[str]:
    """The live engines at the end (the killed server's ledger died with it; its slot's entry is its
    replacement's) whose own ledger shows a continuation of `rid` (`rid.rN`) whose prompt held the request's
    prompt plus exactly its `committed` tokens: the engine, not Belayer, says those tokens were not regenerated."""
    out = []
    for eid, ev in (rep.get("engine_evidence") or {}).items():
        for r, led in (ev.get("requests") or {}).items():
            if r.startswith(f"{rid}.r") and led.get("prompt_tokens") == prompt_tokens + committed:
                out.append(eid)
    return out


def _resumed_midway(evs: list[Ev], inj: Ev, run_dir: Path, rep: Optional[dict] = None) -> Optional[str]:
    """Precondition: the kill lands while a request generates, after its first token and before its last
    (token trigger 1..tokens_per_turn-1). Accepts: a request that was on the victim resumed from a committed
    position > 0 and, on CPU engines, the serving engine's own ledger (the report's `engine_evidence`, read
    from its /get_server_info) shows the continuation arrived with the prompt plus those committed tokens."""
    rep = rep or {}
    tgt = _fig(inj, "target")
    res = _find(evs, "recovery", "resumed", inj["t"])
    on_victim = [e for e in res if _fig(e, "failed_engine") == tgt]
    mid = [e for e in on_victim if (_fig(e, "committed") or 0) > 0]
    if not mid:
        if on_victim:
            return (f"requests on {tgt} were resumed only from token 0 ({len(on_victim)} resume(s)): the kill landed "
                    "before any token was committed, so token-level resume was not exercised")
        if res:
            return (f"{len(res)} request(s) were resumed after the fault, but none had failed on the victim {tgt} "
                    "(failed_engine): the resume is not the kill's recovery")
        return ("no request was resumed after the fault: the kill landed where it tested nothing (e.g. after the "
                "engine had already produced the request's last token)")
    if (rep.get("config") or {}).get("engine_kind", "cpu") != "cpu":
        return None  # SGLang keeps no per-request ledger: the golden comparison judges the ids
    ev = rep.get("engine_evidence")
    if not ev:
        return ("no engine-side evidence in the report (engine_evidence): nothing but Belayer's own events says "
                "the resumed request kept its committed tokens")
    for e in mid:
        p0 = _fig(e, "prompt_tokens")
        if p0 is not None and _served(rep, e["subject"], p0, _fig(e, "committed")):
            return None
    e = mid[0]
    return (f"no engine's own ledger shows {e['subject']} continued from {_fig(e, 'committed')} committed "
            f"token(s) (a prompt of {_fig(e, 'prompt_tokens')} + {_fig(e, 'committed')} tokens under "
            f"{e['subject']}.rN): the resume saved no tokens the engines can confirm")


def _handover(evs: list[Ev], inj: Ev, run_dir: Path, rep: Optional[dict] = None) -> Optional[str]:
    """Precondition: a ready standby when the engine dies (shadow.num_standby >= 1, not spent). Accepts: a
    handover of the victim's slot after the fault."""
    tgt = _fig(inj, "target")
    if _find(evs, "shadow", "handover", inj["t"], lambda e: e["subject"] == tgt):
        return None
    other = _find(evs, "restart", "restarted", inj["t"], lambda e: e["subject"] == tgt)
    return (f"no standby took over {tgt} after the fault" +
            (" (it was cold-restarted instead)" if other else ""))


def _engine_replaced(evs: list[Ev], inj: Ev, run_dir: Path, rep: Optional[dict] = None) -> Optional[str]:
    """Precondition: none on the position: a kill at any step, the last refit included, is answered. A fault
    in the last phase of the run is not left behind: the loop waits for the recovery under way (bounded by
    loop.end_recovery_timeout_s) before it shuts the fleet down, and the report's `fleet_at_end` says when the
    run ended below full strength. Accepts: a handover or a restart of the victim's slot after the fault; an
    end state below full strength fails (the recovery did not finish), named as such."""
    tgt = _fig(inj, "target")
    if _find(evs, "shadow", "handover", inj["t"], lambda e: e["subject"] == tgt) or \
            _find(evs, "restart", "restarted", inj["t"], lambda e: e["subject"] == tgt):
        return None
    end = _find(evs, "loop", "end_state", inj["t"])
    if end and tgt in (_fig(end[-1], "still_recovering") or []):
        return (f"{tgt} got no new engine: its recovery was still under way when the run ended "
                f"({end[-1]['reason']})")
    return f"{tgt} got no new engine (neither a handover nor a restart) after the fault"


def _engine_detected(evs: list[Ev], inj: Ev, run_dir: Path, rep: Optional[dict] = None) -> Optional[str]:
    """Precondition: none on the position (a death the monitor has not seen by the end of the run is found by
    the loop's liveness check before shutdown). Accepts: the monitor declared the victim dead after the fault."""
    tgt = _fig(inj, "target")
    if _find(evs, "monitor", "detected", inj["t"], lambda e: e["subject"] == tgt):
        return None
    return f"the monitor never declared {tgt} dead after the fault"


def _standby_replaced(evs: list[Ev], inj: Ev, run_dir: Path, rep: Optional[dict] = None) -> Optional[str]:
    """Precondition: a ready standby to kill. The loop waits for replacements still starting before shutdown
    when this is expected, so a kill at the last step is covered. Accepts: the standby noticed lost, then
    another one ready."""
    tgt = _fig(inj, "target")
    lost = _find(evs, "shadow", "shadow_lost", inj["t"], lambda e: e["subject"] == tgt)
    if not lost:
        return f"the killed standby {tgt} was never noticed lost"
    if not _find(evs, "shadow", "shadow_ready", lost[0]["t"], lambda e: e["subject"] != tgt):
        return f"no new standby became ready after {tgt} was lost"
    return None


def _refit_before_serving(evs: list[Ev], inj: Ev, run_dir: Path, rep: Optional[dict] = None) -> Optional[str]:
    """Precondition: a refit follows the kill (a step trigger's kill at paused or refit comes before its step's
    refit: every step qualifies, the last included, since the replacement that comes after the last refit is
    waited for). Accepts: the replacement registered with the fleet's current version and served the first
    version refit after the kill."""
    tgt = _fig(inj, "target")
    if not (_find(evs, "shadow", "handover", inj["t"], lambda e: e["subject"] == tgt) or
            _find(evs, "restart", "restarted", inj["t"], lambda e: e["subject"] == tgt)):
        return f"{tgt} was never replaced after the kill, so no replacement could be refit"
    begins = _find(evs, "fleet", "refit_begin", inj["t"])
    if not begins:
        return "no refit followed the kill: the scenario tested nothing"
    new = _fig(begins[0], "version")
    all_begins = _find(evs, "fleet", "refit_begin")
    regs = _find(evs, "fleet", "registered", inj["t"], lambda e: e["subject"] == tgt)
    for reg in regs:  # never admitted to serve with weights other than the fleet's at that moment
        cur = [_fig(b, "version") for b in all_begins if b["t"] <= reg["t"]]
        if cur and _fig(reg, "version") != cur[-1]:
            return f"{tgt}'s replacement was registered serving {_fig(reg, 'version')} while the fleet was at {cur[-1]}"
    refit = _find(evs, "fleet", "refit_done", begins[0]["t"], lambda e: (_fig(e, "engines") or {}).get(tgt) == new)
    if not refit and not any(_fig(r, "version") == new for r in regs):
        return f"{tgt}'s replacement never served the new weight version {new}"
    return None


def _rollback_from_checkpoint(evs: list[Ev], inj: Ev) -> tuple[Optional[Ev], list[Ev]]:
    tgt = _fig(inj, "target")
    rbs = _find(evs, "sandbox", "rollback", inj["t"], lambda e: e["subject"] == tgt)
    good = [e for e in rbs if not _fig(e, "from_base_image", True) and _fig(e, "checkpoint")]
    return (good[0] if good else None), rbs


def _restored_from_checkpoint(evs: list[Ev], inj: Ev, run_dir: Path, rep: Optional[dict] = None) -> Optional[str]:
    """Precondition: a sandbox checkpoint at or before the kill's boundary (action trigger at >=
    sandbox.policy.every_n_actions; boundary 0 is the base image, never checkpointed). Accepts: a rollback of
    the victim from a checkpoint whose restore was recorded, at a boundary > 0; under checkpoint_mode auto
    where the runtime's own CRIU probe found CRIU working (the report's `sandbox_evidence`), only a CRIU
    restore that the runtime itself reported (the container id its `container restore` printed)."""
    rep = rep or {}
    tgt = _fig(inj, "target")
    rb, rbs = _rollback_from_checkpoint(evs, inj)
    if rb is None:
        if rbs:
            return (f"sandbox {tgt} was rebuilt from the base image, not restored from a checkpoint (none existed "
                    "or none could be restored): the kill landed where it tested nothing")
        return f"sandbox {tgt} was never recovered after the kill"
    res = _find(evs, "sandbox", "restore", inj["t"], lambda e: _fig(e, "checkpoint") == _fig(rb, "checkpoint"))
    if not res:
        return f"rollback of {tgt} names checkpoint {_fig(rb, 'checkpoint')} but no restore of it was recorded"
    bounds = {"restored boundary": _fig(rb, "restored_boundary"), "rollback boundary": _fig(rb, "boundary"),
              "restore boundary": _fig(res[-1], "boundary")}
    bad = {k: v for k, v in bounds.items() if not isinstance(v, int) or v <= 0}
    if bad:
        return (f"{tgt} was 'restored' at boundary {bad} (0 or unknown is the base image): nothing a checkpoint "
                "held was brought back")
    sb = rep.get("sandbox_evidence") or {}
    if sb.get("checkpoint_mode") == "auto" and "criu_problem" in sb and sb["criu_problem"] is None:
        if _fig(res[-1], "mode") != "full" or not _fig(res[-1], "runtime_restored_id"):
            return (f"checkpoint_mode auto with a working CRIU (the runtime's probe found no problem), yet {tgt}'s "
                    f"restore was {_fig(res[-1], 'mode')!r} with no runtime restore output: a silent "
                    "file-system-only fallback, its processes restarted fresh")
    return None


def _criu_restore(evs: list[Ev], inj: Ev, run_dir: Path, rep: Optional[dict] = None) -> Optional[str]:
    """Precondition: as restored_from_checkpoint, and a working CRIU. Accepts: that restore in mode full,
    with the container id the runtime's own `container restore` printed."""
    rb, _ = _rollback_from_checkpoint(evs, inj)
    if rb is None:
        return "no restore from a checkpoint, so no CRIU restore"
    res = _find(evs, "sandbox", "restore", inj["t"], lambda e: _fig(e, "checkpoint") == _fig(rb, "checkpoint"))
    if res and _fig(res[-1], "mode") == "full":
        if not _fig(res[-1], "runtime_restored_id"):
            return "the restore says mode full but the runtime reported no restored container (runtime_restored_id)"
        return None
    why = [e["reason"] for e in _find(evs, "sandbox", "checkpoint_mode")][:1]
    return ("the restore was file-system only, not CRIU (processes restarted fresh)" +
            (f": {why[0]}" if why else "") + " -- this scenario needs a working CRIU >= 4.2")


def _restore_retried(evs: list[Ev], inj: Ev, run_dir: Path, rep: Optional[dict] = None) -> Optional[str]:
    """Precondition: as restored_from_checkpoint (a restore must run for the second kill to hit it). Accepts:
    the killed restore retried, then the victim restored from a checkpoint."""
    tgt = _fig(inj, "target")
    kills = _find(evs, "chaos", "inject", inj["t"], lambda e: e is not inj and "restore" in e["reason"])
    if not kills:
        return (f"the restore of {tgt} was never killed (no restore ran, e.g. no checkpoint or no CRIU): "
                "the retry was not exercised")
    retries = _find(evs, "sandbox", "restore_retry", kills[0]["t"], lambda e: e["subject"] == tgt)
    if not retries:
        return f"the killed restore of {tgt} was not retried"
    rb, _ = _rollback_from_checkpoint(evs, inj)
    if rb is None or rb["t"] < retries[0]["t"]:
        return f"after the retry, {tgt} was not restored from a checkpoint"
    return None


def _checkpoint_discarded(evs: list[Ev], inj: Ev, run_dir: Path, rep: Optional[dict] = None) -> Optional[str]:
    """Precondition: the run makes at least `at` checkpoint calls (positions.py counts those certain).
    Accepts: the checkpoint the kill hit failed, was never published, left no staging directory, and its
    trajectory was recovered."""
    tgt = _fig(inj, "target")
    failed = _find(evs, "sandbox", "checkpoint_failed", inj["t"], lambda e: e["subject"] == tgt)
    if not failed:
        return f"the checkpoint of {tgt} the kill hit did not fail: the kill landed where it tested nothing"
    b = _fig(failed[0], "boundary")
    pub = _find(evs, "sandbox", "checkpoint", inj["t"], lambda e: e["subject"] == tgt and _fig(e, "boundary") == b
                and e["t"] <= failed[0]["t"] + 1e-3)
    if pub:
        return f"the checkpoint of {tgt} at boundary {b} was published although its call failed"
    left = sorted(str(p) for p in (run_dir / "sandbox-checkpoints").glob("*/.staging-*"))
    if left:
        return f"partial checkpoints left behind: {left[:3]}"
    if not _find(evs, "sandbox", "rollback", inj["t"], lambda e: e["subject"] == tgt):
        return f"{tgt} was never recovered after its checkpoint was killed"
    return None


def _learner_restarted(evs: list[Ev], inj: Ev, run_dir: Path, rep: Optional[dict] = None) -> Optional[str]:
    """Precondition: the learner is killed before step N's update (step trigger, victim_state paused), when
    the checkpoints of steps 1..N-1 are complete and none of step N exists. So the new learner must resume
    from the checkpoint of step N-1, or, killed before its first checkpoint (N = 1), start from the initial
    weights, and re-run step N. Judged from what the run reports: the step the loop re-ran, and what the new
    learner itself said it found on disk, loaded and is at (its `info`, in the `restarted` event); that the
    re-run step's result is right is the golden comparison's (identical loss and weights version)."""
    rs = _find(evs, "learner", "restarted", inj["t"])
    if not rs:
        return "the learner was never restarted after the kill"
    r = rs[0]
    rerun, at, resumed = _fig(r, "step"), _fig(r, "learner_step"), _fig(r, "resumed_from")
    found = _fig(r, "checkpoints_found")
    if rerun is None or at is None or found is None:
        return "the restart does not say which step it re-ran and what the new learner loaded (no evidence)"
    killed = _fig(inj, "step")
    if killed is not None and rerun != killed:
        return f"the learner was killed before step {killed}'s update but step {rerun} was re-run"
    if rerun == 1:  # killed before its first checkpoint existed: only the initial weights are right
        if found or resumed is not None or at != 0:
            return (f"killed before step 1's update, the new learner should start from the initial weights, but "
                    f"it found checkpoints {found}, resumed from {resumed} and is at step {at}")
        return None
    if resumed is None:
        return (f"the new learner did not resume from a checkpoint (it started from the initial weights; found "
                f"{found}), but step {rerun - 1}'s must exist before step {rerun}'s update")
    if resumed != rerun - 1 or at != rerun - 1 or resumed != max(found):
        return (f"the new learner resumed from the checkpoint of step {resumed} (at step {at}, found {found}); "
                f"re-running step {rerun} needs the newest, step {rerun - 1}'s")
    return None


RECOVERIES: dict[str, Callable[..., Optional[str]]] = {
    "request_resumed_midway": _resumed_midway,
    "handover": _handover,
    "engine_replaced": _engine_replaced,
    "engine_detected": _engine_detected,
    "standby_replaced": _standby_replaced,
    "refit_before_serving": _refit_before_serving,
    "restored_from_checkpoint": _restored_from_checkpoint,
    "criu_restore": _criu_restore,
    "restore_retried": _restore_retried,
    "checkpoint_discarded": _checkpoint_discarded,
    "learner_restarted_from_checkpoint": _learner_restarted,
}


def check_fault(report: dict, events: list[Ev]) -> list[str]:
    """Violations of 'the fault hit a live target and the declared recoveries ran'."""
    ch = report["config"]["chaos"]
    if not ch["enabled"]:
        return []
    run_dir = Path(report.get("run_dir", "."))
    injected = [e for e in _find(events, "chaos", "inject") if _fig(e, "delivered")]
    if not injected:
        missed = [e["reason"] for e in _find(events, "chaos", "missed")]
        return ["no fault was delivered to a live target: the scenario did not test anything" +
                (f" (missed: {'; '.join(missed[:3])})" if missed else "")]
    bad = []
    for name in ch.get("expect", []):
        fn = RECOVERIES.get(name)
        if fn is None:
            bad.append(f"unknown expectation {name!r}")
            continue
        why = fn(events, injected[0], run_dir, report)
        if why:
            bad.append(f"{name}: {why}")
    return bad


def check(report: dict, expect: str, golden: Optional[dict] = None, error_type: str = "",
          max_duration_s: float = 0.0, events: Optional[list[Ev]] = None) -> list[str]:
    """Returns the list of violations (empty when the run behaved as expected)."""
    if events is None:
        events = load_events(Path(report.get("run_dir", ".")) / "events.jsonl")
    bad = check_fault(report, events)
    ch = report["config"]["chaos"]
    if ch["enabled"] and expect == "survival" and not ch.get("expect"):
        bad.append("a survival scenario must declare the recovery it proves (belayer.chaos.expect)")
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
    ap.add_argument("--events", help="events.jsonl (default: the one in the report's run dir)")
    ap.add_argument("--error-type", default="")
    ap.add_argument("--max-duration", type=float, default=0.0)
    a = ap.parse_args(argv)
    report = json.load(open(a.report))
    golden = json.load(open(a.golden)) if a.golden else None
    events = load_events(Path(a.events)) if a.events else None
    bad = check(report, a.expect, golden, a.error_type, a.max_duration, events)
    r = report.get("recovery", {})
    print(f"[check] EXPECT={a.expect} status={report['status']} faults={r.get('faults_injected')} "
          f"missed={r.get('faults_missed')} detected={r.get('engine_deaths_detected')} handovers={r.get('handovers')} "
          f"restarts={r.get('cold_restarts')} resumed={r.get('requests_resumed')} env_restores={r.get('env_restores')} "
          f"learner_restarts={r.get('learner_restarts')} recoveries={report['config']['chaos'].get('expect')} "
          f"-> {'PASS' if not bad else 'FAIL'}")
    for b in bad:
        print(f"[check]   {b}")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
