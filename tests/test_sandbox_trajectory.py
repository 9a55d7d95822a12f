"""Prefix consistency: rollback of sandbox and LLM context to the same boundary (real containers)."""

from __future__ import annotations

import time

import pytest

from belayer_plugin.sandbox.base import Sandbox, SandboxDead, SandboxSpec
from belayer_plugin.sandbox.checkpoint import CheckpointStore
from belayer_plugin.sandbox.miniswe import BelayerEnvironment
from belayer_plugin.sandbox.policy import CheckpointPolicy
from belayer_plugin.sandbox.scripted import action, golden_state, messages, query_state, setup_stated, tokens
from belayer_plugin.sandbox.trajectory import TrajectoryRecorder
from tests.sandbox_fixtures import (  # noqa: F401  (fixtures)
    backend,
    busybox_image,
    criu_ok,
    docker,
    dockerd,
    env_cache,
    podman,
)

pytestmark = pytest.mark.containers


@pytest.fixture
def recorder(backend, busybox_image, tmp_path, criu_ok):
    events: list[dict] = []
    sb = Sandbox.create(backend, SandboxSpec(image=busybox_image, memory_mb=128), "traj", 20.0, events.append)
    setup_stated(sb)
    rec = TrajectoryRecorder("traj", sb, CheckpointStore(tmp_path, keep=3), checkpoint_mode="full",
                             setup=setup_stated, on_event=events.append)
    rec.events = events  # type: ignore[attr-defined]
    yield rec
    rec.close()


def run(rec: TrajectoryRecorder, i: int) -> None:
    rec.begin_action(action(i))
    assert rec.sandbox.exec(action(i)["command"]).exit_code == 0
    rec.commit(tokens(i), messages(i))


def test_recover_restores_latest_checkpoint_and_rolls_context_back_to_the_same_boundary(recorder):
    recorder.start(tokens(0), messages(0))
    run(recorder, 1)
    ck1 = recorder.checkpoint()
    assert ck1 is not None and ck1.boundary == 1
    run(recorder, 2)  # committed but not checkpointed
    recorder.begin_action(action(3))  # in flight when the environment dies: effect uncertain
    recorder.sandbox.kill()
    with pytest.raises(SandboxDead):
        recorder.sandbox.exec(action(3)["command"])
    rb = recorder.recover("test kill")
    assert (rb.boundary, rb.failed_boundary, rb.discarded_actions, rb.checkpoint_id) == (1, 2, 1, ck1.id)
    assert rb.uncertain_action == action(3)
    assert rb.token_ids == tokens(1) and rb.messages == messages(1)
    assert recorder.latest == 1 and rb.replayed_actions == 0
    assert query_state(rb.sandbox) == golden_state(1)  # a2's effects are gone, a3 never ran
    # the agent regenerates from boundary 1 and the trajectory completes exactly once
    for i in (2, 3):
        run(recorder, i)
    assert query_state(recorder.sandbox) == golden_state(3)
    kinds = [e["kind"] for e in recorder.events]  # type: ignore[attr-defined]
    assert "rollback" in kinds and "restore" in kinds


def test_deterministic_env_replays_committed_actions_but_never_the_uncertain_one(backend, busybox_image, tmp_path,
                                                                                  criu_ok):
    sb = Sandbox.create(backend, SandboxSpec(image=busybox_image, memory_mb=128))
    setup_stated(sb)
    rec = TrajectoryRecorder("det", sb, CheckpointStore(tmp_path), deterministic=True, replay=True,
                             checkpoint_mode="full")
    try:
        rec.start(tokens(0), messages(0))
        run(rec, 1)
        rec.checkpoint()
        run(rec, 2)
        run(rec, 3)
        rec.begin_action(action(4))
        rec.sandbox.kill()
        rb = rec.recover()
        assert rb.replayed_actions == 2 and rb.boundary == 3
        assert rb.token_ids == tokens(3) and rb.uncertain_action == action(4)
        assert query_state(rb.sandbox) == golden_state(3)
    finally:
        rec.close()


def test_corrupt_newest_checkpoint_falls_back_to_an_older_one(recorder):
    recorder.start(tokens(0), messages(0))
    run(recorder, 1)
    recorder.checkpoint()
    run(recorder, 2)
    ck2 = recorder.checkpoint()
    img = max((p for p in ck2.path.rglob("*") if p.is_file() and p.name != "MANIFEST.json"),
              key=lambda p: p.stat().st_size)
    img.write_bytes(img.read_bytes()[:-1] + b"!")
    recorder.sandbox.kill()
    rb = recorder.recover()
    assert rb.boundary == 1 and rb.token_ids == tokens(1)
    assert query_state(rb.sandbox) == golden_state(1)
    ev = recorder.events  # type: ignore[attr-defined]
    assert any(e["kind"] == "checkpoint_corrupt" and e["checkpoint"] == ck2.id for e in ev)
    assert not any(e["kind"] == "restore" and e["checkpoint"] == ck2.id for e in ev)
    assert not ck2.path.exists()  # discarded, never to be tried again


def test_without_any_checkpoint_recovery_rebuilds_from_the_base_image_at_boundary_zero(recorder):
    recorder.start(tokens(0), messages(0), checkpoint=False)
    run(recorder, 1)
    recorder.sandbox.kill()
    rb = recorder.recover()
    assert rb.boundary == 0 and rb.checkpoint_id is None and rb.token_ids == tokens(0)
    assert query_state(rb.sandbox) == golden_state(0)  # set-up re-ran, nothing else


def test_async_policy_checkpoint_overlaps_generation_so_the_agent_barely_waits(recorder):
    recorder.start(tokens(0), messages(0), checkpoint=False)
    pol = CheckpointPolicy(recorder.checkpoint, failure_prob=0.5, min_overhead_s=0.0, async_checkpoint=True,
                           cooldown_s=20.0, subject="traj")
    run(recorder, 1)
    pol.note_work(4.0, "generation", action_done=True)
    t_call = time.time()
    fut = pol.maybe_checkpoint_async(recorder.latest)
    t_returned = time.time()
    assert fut is not None
    # The next LLM generation runs now; a checkpoint taken synchronously would already be published.
    ck = fut.result(timeout=60)
    time.sleep(0.3)  # the rest of that generation: simulated LLM work, not synchronisation
    t_gen_end = time.time()
    waited = pol.wait_ready(timeout=60)
    pol.close()
    pub = [e for e in recorder.events if e["kind"] == "checkpoint" and e.get("boundary") == 1]  # type: ignore[attr-defined]
    assert ck is not None and ck.boundary == 1 and len(pub) == 1
    ck_end, ck_s = pub[0]["t"], pub[0]["duration_s"]
    assert ck_end > t_returned, "the checkpoint was published before the call returned: it did not overlap"
    assert t_returned - t_call < ck_s, f"the call blocked {t_returned - t_call:.3f} s for a {ck_s:.3f} s checkpoint"
    overlap = min(ck_end, t_gen_end) - max(ck_end - ck_s, t_returned)
    assert overlap > 0.5 * ck_s, f"checkpoint ({ck_s:.3f} s) overlapped generation by only {overlap:.3f} s"
    assert waited < 0.05  # it finished during the generation: the agent did not wait for it


def test_checkpoint_requested_for_an_old_boundary_is_refused(recorder):
    recorder.start(tokens(0), messages(0), checkpoint=False)
    run(recorder, 1)
    run(recorder, 2)
    assert recorder.checkpoint(1) is None  # the sandbox is already past boundary 1
    recorder.begin_action(action(3))
    assert recorder.checkpoint() is None  # an action is in flight: its effect is uncertain


def test_miniswe_adapter_runs_actions_as_committed_boundaries(recorder):
    recorder.start(tokens(0), messages(0), checkpoint=False)
    env = BelayerEnvironment(recorder=recorder, context_fn=lambda: (tokens(recorder.latest + 1), messages(recorder.latest + 1)))
    out = env.execute("echo hi; exit 3")
    assert out == {"output": "hi\n", "returncode": 3}
    out2 = env.execute({"command": "echo two"})
    assert out2["output"] == "two\n" and out2["exception_info"] == ""
    assert recorder.latest == 2 and recorder.boundaries[2].action["command"] == "echo two"
    import subprocess

    with pytest.raises(subprocess.TimeoutExpired):
        env.execute("sleep 20", timeout=1)
    assert env.serialize()["info"]["config"]["environment"]["timeout"] == 30
