"""Side-effect-aware checkpoints: a boundary reached by actions that changed neither the file system nor a
long-lived process needs no checkpoint; recovery restores the last one and keeps those boundaries."""

from __future__ import annotations

import pytest

from belayer_plugin.envs.definitions import get_env
from belayer_plugin.sandbox.base import Sandbox, SandboxSpec
from belayer_plugin.sandbox.checkpoint import CheckpointStore
from belayer_plugin.sandbox.scripted import setup_stated
from belayer_plugin.sandbox.trajectory import TrajectoryRecorder
from tests.sandbox_fixtures import backend, busybox_image, criu_ok, docker, dockerd, env_cache, podman  # noqa: F401

pytestmark = pytest.mark.containers

WRITE_BOTH = "echo add a1 > /tmp/ctl && mkdir -p /work && echo a1 >> /work/log"
READ_ONLY = ["cat /work/log", "ls -la / /work", "wc -l /work/log; ps"]
MEMORY_ONLY = "echo add m2 > /tmp/ctl"  # only the daemon's in-memory state changes
FILE_ONLY = "echo f > /work/f"


def query(sb: Sandbox) -> str:
    return sb.exec("echo get > /tmp/ctl && cat /tmp/reply && cat /work/log /work/f 2>/dev/null", timeout=20).stdout


def step(rec: TrajectoryRecorder, cmd: str):
    top = rec.boundaries[-1]
    rec.execute(cmd, top.token_ids + [top.index], [], run=lambda sb, a: sb.exec(a, timeout=20))
    return rec.checkpoint()


@pytest.mark.parametrize("skip", [True, False], ids=["skip_unchanged", "always"])
def test_actions_without_side_effects_reuse_the_last_checkpoint(backend, busybox_image, tmp_path, criu_ok, skip):
    sb = Sandbox.create(backend, SandboxSpec(image=busybox_image, command=get_env("busybox").command))
    store = CheckpointStore(tmp_path, keep=8)
    rec = TrajectoryRecorder("t", sb, store, checkpoint_mode="full", skip_unchanged=skip)
    try:
        setup_stated(sb)
        rec.start([0], [], checkpoint=False)
        first = step(rec, WRITE_BOTH)
        reused = [step(rec, c) for c in READ_ONLY]
        at_3 = query(rec.sandbox)
        published = len(store.list("t"))
        if skip:
            assert [c.id for c in reused] == [first.id] * 3 and rec.skipped_checkpoints == 3
            assert published == 1
        else:
            assert len({c.id for c in [first, *reused]}) == 4 and published == 4
        # A change to process memory alone, or to a file alone, is a side effect: a real checkpoint each.
        mem = step(rec, MEMORY_ONLY)
        assert mem.id != first.id and mem.boundary == 5
        fil = step(rec, FILE_ONLY)
        assert fil.id != mem.id and fil.boundary == 6
        after_mem_and_file = query(rec.sandbox)
        assert rec.skipped_checkpoints == (3 if skip else 0)
        # A read-only action after a restore is recognised too (the restored state is the checkpoint's).
        rec.sandbox.kill()
        rb = rec.recover("test kill")
        assert rb.boundary == 6 and rb.checkpoint_id == fil.id
        again = step(rec, "cat /work/f")
        assert (again.id == fil.id) is skip
        assert query(rec.sandbox) == after_mem_and_file  # (a query is a side effect itself: asked last)
    finally:
        rec.close()


def test_recovery_keeps_the_boundaries_of_skipped_checkpoints(backend, busybox_image, tmp_path, criu_ok):
    sb = Sandbox.create(backend, SandboxSpec(image=busybox_image, command=get_env("busybox").command))
    rec = TrajectoryRecorder("k", sb, CheckpointStore(tmp_path), checkpoint_mode="full", skip_unchanged=True)
    try:
        setup_stated(sb)
        rec.start([0], [], checkpoint=False)
        first = step(rec, WRITE_BOTH)
        for c in READ_ONLY[:2]:
            step(rec, c)
        want = query(rec.sandbox)
        rec.begin_action("echo add lost > /tmp/ctl")  # in flight when the sandbox dies: never replayed
        rec.sandbox.kill()
        rb = rec.recover("test kill")
        # Restored from the checkpoint of boundary 1, yet the trajectory continues after boundary 3: the two
        # read-only actions are not regenerated.
        assert rb.checkpoint_id == first.id and first.boundary == 1
        assert rb.boundary == 3 and rb.discarded_actions == 0 and rb.token_ids == [0, 0, 1, 2]
        assert query(rb.sandbox) == want
    finally:
        rec.close()
