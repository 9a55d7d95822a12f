"""Runs every functional chaos script (tests/functional/*.sh): real faults injected into the main job,
asserted on its JSON report (survival identical to the golden run, a bounded typed failure, or lost work
with fault tolerance off)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent / "functional"
SCRIPTS = sorted(p for p in HERE.glob("*.sh") if p.name != "run_scenario.sh")
# Left out of CI's suite (CI has a time limit on 2 cores); `bash .ci/test.sh --full` runs them. Each has a
# counterpart that CI does run, named here.
FULL_ONLY = {
    "engine_kill_paused_sglang": "engine_kill_paused on CPU engines and tests/test_sglang_fleet.py (kill, refit, "
                                 "re-admission on real SGLang)",
    "engine_server_kill_sglang": "engine_server_kill on CPU engines and tests/test_sglang_fleet.py / "
                                 "test_sglang_sampling.py (SIGKILL mid-generation on real SGLang, golden ids)",
    "engine_kill_refit": "tests/test_fleet_recovery.py::test_sigkill_mid_refit_restarts_onto_the_new_version (the "
                         "kill mid-refit, restart onto the new version) and the other engine scenarios of the main job",
    "verl_replica_kill": "this script, through tests/test_verl_real_replicas.py (which judges its report)",
    "nemo_rl_engine_kill": "the mid-rollout handover in tests/test_hooks_nemo_rl.py",
}
FULL = os.environ.get("BELAYER_FULL_SUITE", "") == "1"


@pytest.mark.functional
@pytest.mark.containers
@pytest.mark.timeout(900)
@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_chaos_scenario(script):
    if script.stem in FULL_ONLY and not FULL:
        pytest.skip(f"full suite only (bash .ci/test.sh --full); CI runs {FULL_ONLY[script.stem]}")
    if script.stem.endswith("_sglang"):
        from belayer_plugin.engines.sglang import sglang_available
        from tests.conftest import belayer_cfg

        if not sglang_available(belayer_cfg("belayer.engines.kind=sglang").engines):
            pytest.skip(".venv-sglang not built (bash .ci/setup.sh --sglang)")
    if script.stem.startswith("nemo_rl_"):
        nemo_rl = HERE.parents[2] / "shared" / "upstream" / "nemo-rl"
        if not (nemo_rl / "nemo_rl").is_dir():
            pytest.skip(f"NeMo-RL source not found at {nemo_rl} (see .ci/setup_nemo_rl.sh)")
    p = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=850)
    tail = (p.stdout + p.stderr)[-4000:]
    assert p.returncode == 0, f"{script.name} failed:\n{tail}"
    assert "-> PASS" in p.stdout, tail


# ------------------------------------------------------------------ the check itself can fail
def _report(run_dir, expect, kind="sandbox_kill"):
    return {"status": "ok", "run_dir": str(run_dir), "lost": [], "trajectories": [], "steps": [], "error": None,
            "duration_s": 1.0, "recovery": {},
            "config": {"chaos": {"enabled": True, "kind": kind, "trigger": "action", "at": 2,
                                 "victim_state": "any", "expect": expect}}}


def _ev(t, component, kind, subject="s1-p0-g0", reason="", **figures):
    return {"t": t, "component": component, "subject": subject, "kind": kind, "reason": reason, "figures": figures}


def test_check_fails_a_run_whose_fault_was_never_delivered(tmp_path):
    from belayer_plugin.chaos.check import check

    rep = _report(tmp_path, ["restored_from_checkpoint"])
    evs = [_ev(1.0, "chaos", "missed", reason="action 2: container was not running: not killed")]
    bad = check(rep, "survival", golden=rep, events=evs)
    assert any("no fault was delivered" in b and "not running" in b for b in bad), bad


def test_check_names_a_sandbox_kill_that_was_rebuilt_instead_of_restored(tmp_path):
    from belayer_plugin.chaos.check import check

    rep = _report(tmp_path, ["restored_from_checkpoint"])
    inj = _ev(1.0, "chaos", "inject", delivered=True, target="s1-p0-g0")
    rebuilt = [inj, _ev(2.0, "sandbox", "rollback", from_base_image=True, checkpoint=None)]
    bad = check(rep, "survival", golden=rep, events=rebuilt)
    assert len(bad) == 1 and "rebuilt from the base image" in bad[0], bad
    restored = [inj, _ev(1.5, "sandbox", "restore", checkpoint="b000002-x", mode="full", boundary=2,
                         runtime_restored_id="c0ffee"),
                _ev(2.0, "sandbox", "rollback", from_base_image=False, checkpoint="b000002-x", boundary=2,
                    restored_boundary=2)]
    assert check(rep, "survival", golden=rep, events=restored) == []


def test_check_names_a_token_kill_that_landed_after_the_request_finished(tmp_path):
    from belayer_plugin.chaos.check import check

    rep = _report(tmp_path, ["request_resumed_midway"], kind="engine_server_kill")
    inj = _ev(1.0, "chaos", "inject", subject="engine-0 server", delivered=True, target="engine-0")
    bad = check(rep, "survival", golden=rep, events=[inj])
    assert len(bad) == 1 and "tested nothing" in bad[0], bad
    ok = [inj, _ev(1.2, "recovery", "resumed", subject="s1-p0-g0-t1", committed=7, failed_engine="engine-0",
                   prompt_tokens=30)]
    rep["engine_evidence"] = {"engine-1": {"requests": {"s1-p0-g0-t1.r1": {"prompt_tokens": 37}}}}
    assert check(rep, "survival", golden=rep, events=ok) == []


def test_every_declared_expectation_has_a_check():
    from belayer_plugin.chaos.check import RECOVERIES
    from belayer_plugin.config import CHAOS_EXPECTATIONS

    assert set(RECOVERIES) == set(CHAOS_EXPECTATIONS)
    from belayer_plugin.config import load_belayer_config

    for recipe in sorted((HERE.parents[1] / "recipes" / "chaos").glob("*.yaml")):
        cfg, _ = load_belayer_config(f"chaos/{recipe.stem}")
        script = (HERE / f"{recipe.stem}.sh").read_text()
        if "EXPECT=survival" in script:
            assert cfg.chaos.expect, f"{recipe.stem}: a survival scenario must declare its recovery"


# ------------------------------------------------------------------ acceptance: recovery removed -> FAIL
_NO_RESTORE = """
import sys
from belayer_plugin.sandbox import trajectory
from belayer_plugin.sandbox.checkpoint import RestoreError

def no_restore(ck, *a, **kw):  # the recovery under test, removed: every restore fails
    raise RestoreError("restore disabled by the test")

trajectory.full_restore = no_restore
from belayer_plugin.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.functional
@pytest.mark.containers
@pytest.mark.timeout(600)
def test_sandbox_kill_check_fails_when_restore_from_checkpoint_is_removed(tmp_path):
    """With restores disabled the run still ends 'ok' (the sandbox is rebuilt from the base image and the
    trajectory regenerated), which the old check passed; the scenario's declared recovery makes it FAIL."""
    import json
    import sys

    from belayer_plugin.chaos.check import check

    run_dir = tmp_path / "run"
    small = ["loop.num_steps=1", "loop.prompts_per_step=1", "loop.group_size=1", "belayer.shadow.num_standby=0",
             "belayer.engines.num_engines=1", "belayer.restart.min_healthy_engines=1"]
    p = subprocess.run([sys.executable, "-c", _NO_RESTORE, "run", "chaos/sandbox_kill", f"belayer.run_dir={run_dir}",
                        *small], capture_output=True, text=True, timeout=540, cwd=HERE.parents[1])
    rep = json.loads((run_dir / "report.json").read_text())
    tail = (p.stdout + p.stderr)[-3000:]
    assert rep["status"] == "ok" and not rep["lost"], tail
    bad = check(rep, "survival", golden=rep)  # the golden comparison is not what is under test here
    assert bad and all(b.startswith("restored_from_checkpoint:") for b in bad), (bad, tail)
    assert "rebuilt from the base image" in bad[0]
