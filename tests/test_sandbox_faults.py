"""Fail-stop fault injection: kill containers at random moments of a scripted trajectory (30 seeds; 50 in full).

Kills land during actions, during checkpoints and during restores; some trials also corrupt a published
checkpoint. Every trial must converge to the golden final state (each action's effect exactly once, in
memory and on disk), never restore a corrupt checkpoint, roll the LLM context back to the restored
boundary and end with the context of exactly its committed actions, and leave no process of any container it
created running. Across the seeds of each runtime, most trials must have had a kill delivered and, with CRIU
working, some recovery must have come from a CRIU restore (a rebuild from the image with replay reaches the
same state, so the state alone cannot show that checkpoints worked). `belayer soak envs` runs the same trials
by the thousand.
"""

from __future__ import annotations

import os

import pytest

from belayer_plugin.sandbox.scripted import run_trial
from tests.sandbox_fixtures import (  # noqa: F401  (fixtures)
    busybox_image_for,
    criu_ok,
    docker,
    dockerd,
    env_cache,
    podman,
)

pytestmark = pytest.mark.containers

# CI runs 15 seeds a runtime (its time budget); the full suite (BELAYER_FULL_SUITE=1) 25, and `belayer soak envs`
# thousands.
_N = 25 if os.environ.get("BELAYER_FULL_SUITE", "") == "1" else 15
PODMAN_SEEDS = range(0, _N)
DOCKER_SEEDS = range(1000, 1000 + _N)
N_ACTIONS = 3


# The trials this session ran, per (runtime, seed): the aggregate tests judge the seeds from what was
# DELIVERED (a running container hit) and what each recovery came from, not from the plans.
RESULTS: dict[tuple[str, int], object] = {}


def _check(result) -> None:
    assert result.violations == [], f"seed {result.seed}: {result.violations}"


@pytest.mark.parametrize("seed", PODMAN_SEEDS)
def test_podman_trial_converges_to_golden_state_after_random_kills(podman, env_cache, criu_ok, tmp_path, seed):
    r = run_trial(podman, busybox_image_for(podman, env_cache), seed, tmp_path, n_actions=N_ACTIONS)
    RESULTS["podman", seed] = r
    _check(r)


@pytest.mark.parametrize("seed", DOCKER_SEEDS)
def test_docker_trial_converges_to_golden_state_after_random_kills(docker, env_cache, criu_ok, tmp_path, seed):
    r = run_trial(docker, busybox_image_for(docker, env_cache), seed, tmp_path, n_actions=N_ACTIONS)
    RESULTS["docker", seed] = r
    _check(r)


def _seed_results(backend, image: str, name: str, seeds, tmp_path) -> list:
    """This session's trials of `seeds` on `backend`; seeds deselected in this session are run here."""
    for seed in seeds:
        if (name, seed) not in RESULTS:
            RESULTS[name, seed] = run_trial(backend, image, seed, tmp_path / f"{name}{seed}", n_actions=N_ACTIONS)
    return [RESULTS[name, seed] for seed in seeds]


def _campaign_ok(results, name: str) -> None:
    """Most trials were hit, and with CRIU working (criu_ok) some recovery came from a CRIU restore."""
    from belayer_plugin.sandbox.scripted import campaign_violations

    hit = sum(1 for r in results if r.delivered)
    assert hit >= len(results) * 3 // 4, f"{name}: only {hit} of {len(results)} trials had a kill delivered"
    assert campaign_violations(results, True, "full") == [], [(r.seed, r.recovered_by) for r in results]
    criu = sum(r.recovered_by.get("criu_full", 0) for r in results)
    assert criu >= 1, f"{name}: no recovery came from a CRIU restore: {[r.recovered_by for r in results]}"
    print(f"{name}: {hit}/{len(results)} trials hit; recovered by", {
        k: sum(r.recovered_by.get(k, 0) for r in results) for k in ("criu_full", "fs_only", "rebuild_replay")})


@pytest.mark.timeout(1500)  # run alone it runs the podman trials itself
def test_trials_exercise_kills_in_every_phase_and_corruption(podman, env_cache, criu_ok, tmp_path):
    """The seeds above are not vacuous: across them, kills were delivered in each phase (action, checkpoint,
    restore), most trials were hit at all, and a corrupt checkpoint is met, detected and skipped."""
    image = busybox_image_for(podman, env_cache)
    results = _seed_results(podman, image, "podman", PODMAN_SEEDS, tmp_path)
    fired = [p for r in results for p in r.fired_phases]
    assert {"exec", "checkpoint", "restore"} <= set(fired), f"delivered kills by phase: {sorted(fired)}"
    _campaign_ok(results, "podman")
    # corruption forced: the corrupt checkpoint is met by the next recovery, detected, and skipped
    r = run_trial(podman, image, 7, tmp_path / "corrupt", n_actions=N_ACTIONS, corrupt_prob=1.0)
    _check(r)
    assert r.corrupted is not None
    assert any(e.get("kind") == "checkpoint_corrupt" and e.get("checkpoint") == r.corrupted for e in r.events)
    assert not any(e.get("kind") == "restore" and e.get("checkpoint") == r.corrupted for e in r.events)


@pytest.mark.timeout(1500)  # run alone it runs the docker trials itself
def test_docker_trials_had_kills_delivered_and_recoveries_from_criu(docker, env_cache, criu_ok, tmp_path):
    """The Docker seeds are not vacuous either: most were hit, and some recovery came from a CRIU restore."""
    results = _seed_results(docker, busybox_image_for(docker, env_cache), "docker", DOCKER_SEEDS, tmp_path)
    _campaign_ok(results, "docker")


def test_only_a_restore_after_the_corruption_counts_as_restoring_a_corrupt_checkpoint():
    # The full-size soak (seeds 2328, 2954) restored checkpoint b3 after a kill, then the harness corrupted
    # that same b3 and the next recovery rejected it: the old check counted the earlier, sound restore.
    from belayer_plugin.sandbox.scripted import corruption_violations

    ck = "b000003-1"
    sound_then = [{"kind": "restore", "checkpoint": ck}, {"kind": "rollback", "restored_boundary": 3},
                  {"kind": "test_corrupted", "checkpoint": ck},
                  {"kind": "checkpoint_corrupt", "checkpoint": ck}, {"kind": "restore", "checkpoint": "b000002-1"},
                  {"kind": "rollback", "restored_boundary": 2}]
    assert corruption_violations(sound_then, ck) == []
    used = [{"kind": "test_corrupted", "checkpoint": ck}, {"kind": "restore", "checkpoint": ck},
            {"kind": "rollback", "restored_boundary": 3}]
    assert corruption_violations(used, ck) == [f"corrupt checkpoint {ck} was restored"]
    unseen = [{"kind": "checkpoint_corrupt", "checkpoint": "b000001-1"}, {"kind": "test_corrupted", "checkpoint": ck},
              {"kind": "rollback", "restored_boundary": 1}]
    assert corruption_violations(unseen, ck) == [f"corrupt checkpoint {ck} was not detected"]


def _rollback(ck, base=False):
    return {"kind": "rollback", "checkpoint": ck, "from_base_image": base, "restored_boundary": 0 if base else 1}


def test_a_campaign_whose_recoveries_all_rebuilt_from_the_image_fails_where_criu_could_restore():
    # Every trial converged (no trial violation) but each CRIU restore failed and the sandbox was rebuilt from
    # the base image with replay: the state alone cannot show it, the recovery kinds do.
    from belayer_plugin.sandbox.scripted import TrialResult, campaign_violations

    full_ck = {"kind": "checkpoint", "checkpoint": "b000001-1", "mode": "full"}
    rebuilt = [full_ck, {"kind": "restore_failed", "checkpoint": "b000001-1", "mode": "full"}, _rollback(None, True)]
    criu = [full_ck, {"kind": "restore", "checkpoint": "b000001-1", "mode": "full", "runtime_restored_id": "c" * 64},
            _rollback("b000001-1")]
    fs = [{"kind": "checkpoint", "checkpoint": "b000001-1", "mode": "fs_only"},
          {"kind": "restore", "checkpoint": "b000001-1", "mode": "fs_only", "runtime_restored_id": None},
          _rollback("b000001-1")]

    def trial(seed, events, fired=1):
        return TrialResult(seed, [], 1, 1, fired, None, 1.0, events, ["exec"] * fired)

    assert trial(0, rebuilt).recovered_by == {"rebuild_replay": 1}
    assert trial(0, criu).recovered_by == {"criu_full": 1} and trial(0, fs).recovered_by == {"fs_only": 1}
    assert trial(0, fs).criu_restorable == 0 and trial(0, rebuilt).criu_restorable == 1
    all_rebuilt = [trial(s, rebuilt) for s in range(3)]
    assert campaign_violations(all_rebuilt, True, "full") and campaign_violations(all_rebuilt, True, "auto")
    assert "no recovery came from a CRIU restore" in campaign_violations(all_rebuilt, True, "full")[0]
    assert campaign_violations(all_rebuilt, False, "full") == []  # no CRIU here: nothing to require
    assert campaign_violations(all_rebuilt, True, "fs_only") == []
    assert campaign_violations(all_rebuilt + [trial(9, criu)], True, "full") == []
    assert campaign_violations([trial(s, fs) for s in range(3)], True, "full") == []  # none could use CRIU


def test_a_campaign_counts_only_trials_whose_kills_were_delivered():
    from belayer_plugin.sandbox.scripted import TrialResult, campaign_violations

    hit = TrialResult(1, [], 1, 1, 1, None, 1.0, [_rollback(None, True)], ["exec"])
    missed = TrialResult(2, [], 0, 2, 0, None, 1.0, [], [], missed=2)
    assert hit.delivered and not missed.delivered
    assert campaign_violations([hit, missed, missed], False, "full", wanted=2) == [
        "only 1 of 2 trials had a kill delivered (2 undelivered)"]
    assert campaign_violations([hit, hit, missed], False, "full", wanted=2) == []
    assert campaign_violations([hit, missed, missed], False, "full") != []  # timed out: more missed than hit
    assert campaign_violations([hit, hit, missed], False, "full") == []


def test_the_context_at_the_end_of_a_trial_must_be_that_of_its_committed_actions():
    from belayer_plugin.sandbox.scripted import context_violations, messages, tokens
    from belayer_plugin.sandbox.trajectory import BoundaryRecord

    good = [BoundaryRecord(i, tokens(i), messages(i)) for i in range(4)]
    assert context_violations(good, 3) == []
    stale = good[:3] + [BoundaryRecord(3, tokens(2), messages(3))]  # the last turn's tokens never appended
    assert context_violations(stale, 3) == ["context at the end differs from the committed actions at boundaries [3]"]
    assert context_violations(good[:3], 3)  # a boundary lost
    assert context_violations(good[:2] + good[3:] + [good[2]], 3)  # out of order
