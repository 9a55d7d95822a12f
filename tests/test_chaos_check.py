"""The chaos checks fail a run whose recovery silently failed (issue 44, item 2): each judges evidence Belayer's
own events do not write where it can (the engines' own request ledgers, the runtime's CRIU probe and restore
output) and the boundary restored, so a resume not tied to the victim, a resume the engines do not confirm, a
'restore' of boundary 0 and a file-system-only fallback where CRIU works all FAIL."""

from __future__ import annotations

from belayer_plugin.chaos.check import check
from tests.test_functional import _ev, _report

RID = "s1-p0-g0-t1"


def _resume_run(tmp_path, *, failed_engine="engine-0", committed=7, ledger=None):
    rep = _report(tmp_path, ["request_resumed_midway"], kind="engine_server_kill")
    rep["config"]["engine_kind"] = "cpu"
    if ledger is not None:
        rep["engine_evidence"] = {"engine-0": {"requests": {}}, "engine-1": {"requests": ledger}}
    evs = [_ev(1.0, "chaos", "inject", subject="engine-0 server", delivered=True, target="engine-0"),
           _ev(1.2, "recovery", "resumed", subject=RID, committed=committed, failed_engine=failed_engine,
               prompt_tokens=30, next_rid=f"{RID}.r1")]
    return rep, evs


def _bad(rep, evs):
    return check(rep, "survival", golden=rep, events=evs)


def test_a_resume_the_serving_engine_confirms_passes(tmp_path):
    rep, evs = _resume_run(tmp_path, ledger={f"{RID}.r1": {"prompt_tokens": 37, "generated_tokens": 25}})
    assert _bad(rep, evs) == []


def test_a_resume_of_a_request_that_was_not_on_the_victim_fails(tmp_path):
    rep, evs = _resume_run(tmp_path, failed_engine="engine-1",
                           ledger={f"{RID}.r1": {"prompt_tokens": 37, "generated_tokens": 25}})
    bad = _bad(rep, evs)
    assert len(bad) == 1 and "none had failed on the victim engine-0" in bad[0], bad


def test_a_resume_with_no_engine_side_evidence_fails(tmp_path):
    rep, evs = _resume_run(tmp_path, ledger=None)
    bad = _bad(rep, evs)
    assert len(bad) == 1 and "no engine-side evidence" in bad[0], bad


def test_a_resume_the_engines_saw_restart_from_token_0_fails(tmp_path):
    """Belayer's event says 7 tokens were kept, but the engine that served the continuation got the bare prompt
    (30 tokens) and generated everything again: no tokens were saved."""
    rep, evs = _resume_run(tmp_path, ledger={f"{RID}.r1": {"prompt_tokens": 30, "generated_tokens": 32},
                                             "other.r1": {"prompt_tokens": 37}})
    bad = _bad(rep, evs)
    assert len(bad) == 1 and "no engine's own ledger shows" in bad[0], bad


def _restore_run(tmp_path, *, boundary=2, mode="full", runtime_id="c0ffee", sandbox_evidence=None,
                 expect=("restored_from_checkpoint",)):
    rep = _report(tmp_path, list(expect))
    if sandbox_evidence is not None:
        rep["sandbox_evidence"] = sandbox_evidence
    ck = f"b{boundary:06d}-x"
    evs = [_ev(1.0, "chaos", "inject", delivered=True, target="s1-p0-g0"),
           _ev(1.5, "sandbox", "restore", checkpoint=ck, mode=mode, boundary=boundary,
               runtime_restored_id=runtime_id if mode == "full" else None),
           _ev(2.0, "sandbox", "rollback", from_base_image=False, checkpoint=ck, boundary=boundary,
               restored_boundary=boundary)]
    return rep, evs


CRIU_WORKS = {"checkpoint_mode": "auto", "criu_problem": None, "backend": "podman"}


def test_a_criu_restore_at_a_checkpointed_boundary_passes(tmp_path):
    assert _bad(*_restore_run(tmp_path, sandbox_evidence=CRIU_WORKS)) == []
    assert _bad(*_restore_run(tmp_path, sandbox_evidence=CRIU_WORKS,
                              expect=("restored_from_checkpoint", "criu_restore"))) == []


def test_a_restore_of_boundary_0_fails(tmp_path):
    bad = _bad(*_restore_run(tmp_path, boundary=0, sandbox_evidence=CRIU_WORKS))
    assert len(bad) == 1 and "boundary" in bad[0] and "base image" in bad[0], bad


def test_a_file_system_only_fallback_under_auto_where_criu_works_fails(tmp_path):
    bad = _bad(*_restore_run(tmp_path, mode="fs_only", sandbox_evidence=CRIU_WORKS))
    assert len(bad) == 1 and "silent file-system-only fallback" in bad[0], bad


def test_a_full_restore_the_runtime_never_reported_fails(tmp_path):
    bad = _bad(*_restore_run(tmp_path, runtime_id=None, sandbox_evidence=CRIU_WORKS,
                             expect=("restored_from_checkpoint", "criu_restore")))
    assert len(bad) == 2 and all("runtime" in b for b in bad), bad


def test_a_file_system_only_restore_where_criu_is_absent_or_not_asked_for_passes(tmp_path):
    no_criu = {"checkpoint_mode": "auto", "criu_problem": "criu not found", "backend": "podman"}
    assert _bad(*_restore_run(tmp_path, mode="fs_only", sandbox_evidence=no_criu)) == []
    fs_only = {"checkpoint_mode": "fs_only", "criu_problem": None, "backend": "podman"}
    assert _bad(*_restore_run(tmp_path, mode="fs_only", sandbox_evidence=fs_only)) == []
