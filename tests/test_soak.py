"""`belayer soak`: a short seeded run of both campaigns through the command (the full-size figures in README
come from the same command with its default sizes). The engine rounds go through the phases in which a fault
used to be recovered before any request was sent: paused (the requests now go out while the slot recovers)
and refit (to weights whose ids differ, with requests sent while the refit with the fault runs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.containers
@pytest.mark.functional
@pytest.mark.timeout(660)  # the hang while paused holds the fleet's resume for its 60 s memory call
def test_short_seeded_soak_of_sandboxes_and_engines_loses_nothing_and_hits_every_fault_kind(tmp_path):
    from tests.sandbox_fixtures import criu_verdict
    from belayer_plugin.sandbox.criu import criu_problem
    import os

    verdict, why = criu_verdict(criu_problem(""), os.environ.get("CI", "").lower() in ("1", "true", "yes"))
    if verdict != "ok":
        (pytest.fail if verdict == "fail" else pytest.skip)(why)
    p = subprocess.run([sys.executable, "-m", "belayer_plugin.cli", "soak", "all", "--trials", "3", "--seed", "7",
                        "--backend", "podman", "--actions", "3", "--concurrency", "4", "--tokens", "32",
                        "--phases", "token,paused,refit", "--no-progress", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=640, cwd=ROOT)
    tail = (p.stdout + p.stderr)[-3000:]
    assert p.returncode == 0, tail
    s = json.loads((tmp_path / "soak.json").read_text())
    env, eng = s["envs"], s["engines"]
    # 3 trials that each had a kill delivered (undelivered ones are reported, not counted); every recovery
    # attributed to the checkpoint kind it came from
    assert env["trials"] == 3 and env["violations"] == 0, env
    st = env["stats"]
    assert st["kills_delivered"] >= 3 and "undelivered_trials=" in p.stdout, env
    assert sum(st.get(f"recovered_by_{k}", 0) for k in ("criu_full", "fs_only", "rebuild_replay")) \
        == st["recoveries"], env
    assert st.get("recovered_by_criu_full", 0) >= 1, env  # CRIU works here (criu_verdict): restores must use it
    assert eng["faults"] == 3 and eng["stats"].get("faults_missed", 0) == 0, eng
    st = eng["stats"]
    assert {k for k in st if "@" in k and not k.startswith("met_")} == {"server_kill@token", "hang@paused",
                                                                          "actor_kill@refit"}, st
    # The paused and refit rounds' requests went out before the victim's slot was replaced (before, both were
    # recovered before any request was sent); the hung engine is found by the requests themselves.
    assert st.get("met_recovery@paused") == 1 and st.get("met_recovery@refit") == 1, st
    # the refit went to weights whose ids differ, and every request after it has their fault-free ids
    assert st.get("refits_to_distinct_weights") == 1 and st["checked_at_new_weights"] == 4, eng
    # the refit round sends its requests twice: during the refit and after it
    assert eng["requests"] == eng["completed"] == 4 * 4, eng
    assert (eng["lost"], eng["inconsistent"], eng["regenerated_tokens"]) == (0, 0, 0), eng
    assert (tmp_path / "soak.png").stat().st_size > 1000
    assert "RESULT engines faults=3" in p.stdout


def test_regenerated_tokens_count_promoted_standbys_and_engines_that_came_up_in_the_round():
    # Before, only engines serving at the start of the round were counted: a standby promoted in the round, or
    # a restarted engine, that restarted a request from token 0 passed.
    from belayer_plugin.soak import regenerated

    base = {"http://e0": 100, "http://standby": 7}  # a ready standby is read before the round too
    committed = {"http://e0": 20, "http://standby": 30, "http://restarted": 12}
    fine = {"http://e0": 120, "http://standby": 37, "http://restarted": 12}
    assert regenerated(base, fine, committed, "http://e1") == []
    promoted_from_0 = dict(fine, **{"http://standby": 37 + 18})  # re-decoded 18 committed tokens
    assert regenerated(base, promoted_from_0, committed, "http://e1") == [("http://standby", 48, 30)]
    restarted_from_0 = dict(fine, **{"http://restarted": 30})
    assert regenerated(base, restarted_from_0, committed, None) == [("http://restarted", 30, 12)]
    assert regenerated(base, dict(fine, **{"http://e1": 999}), committed, "http://e1") == []  # the victim
    # an engine that served the round but whose counter could not be read is not taken as clean
    unread = {k: v for k, v in fine.items() if k != "http://restarted"}
    assert regenerated(base, unread, committed, None) == [("http://restarted", None, 12)]
    # an engine that answered without counters (real SGLang) is not judged, and not taken as unread
    assert regenerated(base, dict(fine, **{"http://restarted": None}), committed, None) == []
