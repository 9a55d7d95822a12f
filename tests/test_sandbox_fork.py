"""Sandbox fork: n branches from one committed full checkpoint, equal at the boundary, independent after.

Runs on both backends with the python env: a Python process holds a counter and 16 MB of random bytes in
memory only, so equality at the boundary proves the process state was forked, not just the files.
"""

from __future__ import annotations

import pytest

from belayer_plugin.envs.build import ensure_image
from belayer_plugin.envs.definitions import get_env
from belayer_plugin.sandbox.base import CheckpointCorrupt, Sandbox, SandboxDead, SandboxSpec
from belayer_plugin.sandbox.checkpoint import CheckpointStore
from belayer_plugin.sandbox.fork import fork_sandboxes
from belayer_plugin.sandbox.trajectory import TrajectoryRecorder
from tests.sandbox_fixtures import backend, criu_ok, docker, dockerd, env_cache, podman  # noqa: F401
from tests.test_sandbox_python_env import HOLDER, ask

pytestmark = pytest.mark.containers


def start_holder(sb: Sandbox) -> None:
    sb.write_file("/opt/holder.py", HOLDER)
    r = sb.exec("(python3 /opt/holder.py </dev/null >/dev/null 2>&1 &); "
                "i=0; while [ ! -f /tmp/pyready ] && [ $i -lt 300 ]; do sleep 0.05; i=$((i+1)); done; "
                "[ -f /tmp/pyready ]", timeout=30)
    assert r.exit_code == 0, r


def act(rec: TrajectoryRecorder, word: str) -> None:
    """One committed action: bump the in-memory counter and append to a file; the context grows by one."""
    top = rec.boundaries[-1]
    rec.execute(f"echo inc > /tmp/pyctl; echo {word} >> /tmp/log",
                top.token_ids + [len(top.token_ids)], top.messages + [{"role": "assistant", "content": word}])


def state(sb: Sandbox) -> tuple[str, str]:
    return ask(sb), sb.exec("cat /tmp/log", timeout=30).stdout


def test_forks_equal_parent_at_boundary_then_diverge_independently(backend, env_cache, tmp_path, criu_ok):
    image = ensure_image(backend, "python", env_cache)
    sb = Sandbox.create(backend, SandboxSpec(image=image, memory_mb=512, command=get_env("python").command))
    store = CheckpointStore(tmp_path, keep=1)
    rec = TrajectoryRecorder("parent", sb, store, checkpoint_mode="full", checkpoint_timeout_s=120,
                             restore_timeout_s=120)
    branches: list[TrajectoryRecorder] = []
    try:
        start_holder(sb)
        rec.start([1, 2, 3], [{"role": "user", "content": "go"}], checkpoint=False)
        act(rec, "a")
        act(rec, "b")
        at_fork = state(sb)
        assert at_fork[0].startswith("2 ") and at_fork[1] == "a\nb\n"

        branches = rec.fork(3)

        assert [b.trajectory_id for b in branches] == ["parent.0", "parent.1", "parent.2"]
        for br in branches:
            assert state(br.sandbox) == at_fork  # same process memory (counter, 16 MB sha) and files
            assert [(r.index, r.token_ids, r.messages) for r in br.boundaries] == \
                [(r.index, r.token_ids, r.messages) for r in rec.boundaries]  # the context forked with it
            assert br.sandbox.container_id != sb.container_id
        # Diverge: each branch acts differently; nobody else sees it.
        act(branches[0], "x")
        act(branches[0], "y")
        act(branches[1], "z")
        act(rec, "p")
        assert state(branches[0].sandbox)[1] == "a\nb\nx\ny\n" and ask(branches[0].sandbox).startswith("4 ")
        assert state(branches[1].sandbox)[1] == "a\nb\nz\n" and ask(branches[1].sandbox).startswith("3 ")
        assert state(branches[2].sandbox) == at_fork
        assert state(sb)[1] == "a\nb\np\n"
        assert len(branches[0].boundaries) == 5 and len(branches[2].boundaries) == 3

        # The parent's store moves on (keep=1 drops the fork-point checkpoint); a branch still rolls back
        # to the fork point from its own adopted copy, with its context truncated to the same boundary.
        rec.checkpoint()
        assert all(c.boundary == 3 for c in store.list("parent"))
        branches[0].sandbox.kill()
        with pytest.raises(SandboxDead):
            act(branches[0], "lost")
        rb = branches[0].recover("test kill")
        assert rb.checkpoint_id is not None and rb.boundary == 2 and rb.discarded_actions == 2
        assert state(rb.sandbox) == at_fork
        assert len(branches[0].boundaries) == 3 and branches[0].boundaries[-1].token_ids == rec.boundaries[2].token_ids
    finally:
        for br in branches:
            br.close()
        rec.close()


def test_fork_of_a_corrupt_checkpoint_starts_nothing(backend, env_cache, tmp_path, criu_ok):
    image = ensure_image(backend, "busybox", env_cache)
    sb = Sandbox.create(backend, SandboxSpec(image=image, command=get_env("busybox").command))
    store = CheckpointStore(tmp_path)
    rec = TrajectoryRecorder("p", sb, store, checkpoint_mode="full")
    try:
        rec.start([1], [], checkpoint=False)
        ck = rec.checkpoint()
        art = ck.path / ck.body["files"][0]["name"]
        data = bytearray(art.read_bytes())
        data[len(data) // 2] ^= 0xFF
        art.write_bytes(bytes(data))
        before = set(_containers(backend))
        with pytest.raises(CheckpointCorrupt):
            fork_sandboxes(ck, backend, 2, store=store)
        assert set(_containers(backend)) == before
    finally:
        rec.close()


def _containers(backend) -> list[str]:
    if backend.name == "podman":
        return backend._run(["ps", "-aq"]).stdout.decode().split()
    return [c["Id"] for c in backend.api.containers(all=True)]
