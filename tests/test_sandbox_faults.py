"""Fail-stop fault injection: kill containers at random moments of a scripted trajectory (>= 50 seeds).

Kills land during actions, during checkpoints and during restores; some trials also corrupt a published
checkpoint. Every trial must converge to the golden final state (each action's effect exactly once, in
memory and on disk), never restore a corrupt checkpoint, roll the LLM context back to the restored
boundary, and leave no process of any container it created running. The soak (bench/env_soak.py) runs
the same trials by the thousand.
"""

from __future__ import annotations

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

PODMAN_SEEDS = range(0, 25)
DOCKER_SEEDS = range(1000, 1025)
N_ACTIONS = 3


# Phases in which a kill was DELIVERED (a running container was hit), per podman seed, from the trials
# this session ran: the last test asserts the seeds are not vacuous from these, not from the plans.
FIRED: dict[int, list[str]] = {}


def _check(result) -> None:
    assert result.violations == [], f"seed {result.seed}: {result.violations}"


@pytest.mark.parametrize("seed", PODMAN_SEEDS)
def test_podman_trial_converges_to_golden_state_after_random_kills(podman, env_cache, criu_ok, tmp_path, seed):
    r = run_trial(podman, busybox_image_for(podman, env_cache), seed, tmp_path, n_actions=N_ACTIONS)
    FIRED[seed] = r.fired_phases
    _check(r)


@pytest.mark.parametrize("seed", DOCKER_SEEDS)
def test_docker_trial_converges_to_golden_state_after_random_kills(docker, env_cache, criu_ok, tmp_path, seed):
    _check(run_trial(docker, busybox_image_for(docker, env_cache), seed, tmp_path, n_actions=N_ACTIONS))


@pytest.mark.timeout(1500)  # run alone it runs the 25 podman trials itself
def test_trials_exercise_kills_in_every_phase_and_corruption(podman, env_cache, criu_ok, tmp_path):
    """The seeds above are not vacuous: across them, kills were delivered in each phase (action, checkpoint,
    restore), most trials were hit at all, and a corrupt checkpoint is met, detected and skipped."""
    image = busybox_image_for(podman, env_cache)
    for seed in PODMAN_SEEDS:  # seeds deselected in this session are run here
        if seed not in FIRED:
            FIRED[seed] = run_trial(podman, image, seed, tmp_path / str(seed), n_actions=N_ACTIONS).fired_phases
    fired = [p for seed in PODMAN_SEEDS for p in FIRED[seed]]
    assert {"exec", "checkpoint", "restore"} <= set(fired), f"delivered kills by phase: {sorted(fired)}"
    hit = sum(1 for seed in PODMAN_SEEDS if FIRED[seed])
    assert hit >= len(PODMAN_SEEDS) * 3 // 4, f"only {hit} of {len(PODMAN_SEEDS)} trials had a kill delivered"
    # corruption forced: the corrupt checkpoint is met by the next recovery, detected, and skipped
    r = run_trial(podman, image, 7, tmp_path / "corrupt", n_actions=N_ACTIONS, corrupt_prob=1.0)
    _check(r)
    assert r.corrupted is not None
    assert any(e.get("kind") == "checkpoint_corrupt" and e.get("checkpoint") == r.corrupted for e in r.events)
    assert not any(e.get("kind") == "restore" and e.get("checkpoint") == r.corrupted for e in r.events)


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
