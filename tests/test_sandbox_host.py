"""Checkpoints any node can restore: the host signature in a real CRIU checkpoint's manifest, refused on a host
that differs (a foreign CRIU), and a trajectory whose process died resumed by another process from the store.

Another node of a real cluster is a process with its own run directory reading the shared store: the netns
cluster's worker nodes (tests/netns_cluster.py) cannot run containers, because `ip netns exec` gives each node
a fresh /sys without the cgroup mounts runc needs ("runc create failed: no cgroup mount found in mountinfo").
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

if __name__ == "__main__":  # run as "node A": the repository's root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from belayer_plugin.sandbox.base import (  # noqa: E402
    CheckpointFenced,
    CheckpointIncompatible,
    Sandbox,
    SandboxDead,
    SandboxSpec,
)
from belayer_plugin.sandbox.checkpoint import MANIFEST, CheckpointStore, _body_digest, full_restore  # noqa: E402
from belayer_plugin.sandbox.scripted import (  # noqa: E402
    action,
    golden_state,
    messages,
    query_state,
    setup_stated,
    tokens,
)
from belayer_plugin.sandbox.trajectory import TrajectoryRecorder  # noqa: E402
from tests.sandbox_fixtures import busybox_image, criu_ok, env_cache, podman  # noqa: E402,F401  (fixtures)

pytestmark = pytest.mark.containers
READY_TIMEOUT_S = 180  # node A: sandbox up, three actions, three CRIU checkpoints on 2 loaded cores


@pytest.fixture(scope="session")
def backend(podman):  # CRIU across hosts is the question here: one runtime is enough
    return podman


def run(rec: TrajectoryRecorder, i: int) -> None:
    rec.begin_action(action(i))
    assert rec.sandbox.exec(action(i)["command"]).exit_code == 0
    rec.commit(tokens(i), messages(i))


def criu_says() -> str:
    """The installed CRIU's version, as `criu --version` prints it (not Belayer's parse of it)."""
    out = subprocess.run(["/usr/local/sbin/criu", "--version"], capture_output=True, text=True, timeout=10).stdout
    return re.search(r"Version:\s*(\S+)", out).group(1)


def as_foreign_host_wrote_it(ck_path: Path, **host: str) -> None:
    """Rewrites a checkpoint's manifest with other host values and a valid checksum: what a host with another
    CRIU (or kernel) would have published, as opposed to a corrupt manifest."""
    raw = json.loads((ck_path / MANIFEST).read_text())
    raw["body"]["host"].update(host)
    raw["body_sha256"] = _body_digest(raw["body"])
    (ck_path / MANIFEST).write_text(json.dumps(raw, indent=1, sort_keys=True))


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


def test_a_checkpoint_records_the_host_that_took_it_and_restores_where_it_matches(recorder, backend):
    recorder.start(tokens(0), messages(0))
    run(recorder, 1)
    ck = recorder.checkpoint()
    assert ck.mode == "full"
    host = json.loads((ck.path / MANIFEST).read_text())["body"]["host"]
    assert host["criu"] == criu_says() and host["kernel"] == os.uname().release and host["arch"] == os.uname().machine
    img = subprocess.run(["podman", "image", "inspect", "--format", "{{.Id}}", recorder.base_spec.image],
                         capture_output=True, text=True, timeout=30).stdout.strip()
    assert host["image"] == img and host["cgroup"].startswith(("v1:", "v2:"))
    assert [r["token_ids"] for r in ck.context()] == [tokens(0), tokens(1)]  # the context rides with it
    sb = full_restore(ck, backend, recorder.store, sandbox_id="copy")
    try:
        assert query_state(sb) == golden_state(1)  # the state daemon's memory, restored by CRIU
    finally:
        sb.close()


def test_a_checkpoint_from_a_host_with_another_criu_is_refused_and_the_resume_falls_back(recorder, backend):
    recorder.start(tokens(0), messages(0))
    run(recorder, 1)
    ck1 = recorder.checkpoint()
    run(recorder, 2)
    ck2 = recorder.checkpoint()
    here = criu_says()
    as_foreign_host_wrote_it(ck2.path, criu="4.1.0", node="elsewhere")
    store = CheckpointStore(ck2.path.parent.parent, keep=3)  # the store as another node reads it
    foreign = store.list("traj")[-1]
    with pytest.raises(CheckpointIncompatible) as e:
        full_restore(foreign, backend, store)
    assert e.value.mismatches == [f"criu: 4.1.0 in the checkpoint (taken on elsewhere), {here} here"]
    recorder.sandbox.kill()  # the trajectory's node is lost; this host resumes it from the store
    with pytest.raises(SandboxDead):
        recorder.sandbox.exec("true")
    events: list[dict] = []
    rec, rb = TrajectoryRecorder.resume("traj", backend, store, exec_timeout_s=20.0, on_event=events.append,
                                        setup=setup_stated, checkpoint_mode="full")
    try:
        # never restored: the checkpoint before it is, with the context of its own boundary
        assert (rb.boundary, rb.checkpoint_id, rb.token_ids) == (1, ck1.id, tokens(1))
        assert query_state(rb.sandbox) == golden_state(1)
        refused = [x for x in events if x["kind"] == "checkpoint_incompatible"]
        assert refused and refused[0]["checkpoint"] == ck2.id and "criu: 4.1.0" in refused[0]["reason"]
        assert not any(x["kind"] == "restore" and x["checkpoint"] == ck2.id for x in events)
        assert [x["kind"] for x in events].count("restore") == 1
    finally:
        rec.close()


def test_a_cut_off_owner_that_lives_on_cannot_publish_past_the_take_over_and_its_late_checkpoint_is_never_used(
        recorder, backend):
    """A node cut off (not lost) still runs the old sandbox: after another node took the trajectory over from the
    store at boundary 2, the old owner's next checkpoint is refused, and one that slipped in between the check and
    its rename (written here as it would have landed) is never listed nor restored."""
    recorder.start(tokens(0), messages(0))
    for i in (1, 2):
        run(recorder, i)
        recorder.checkpoint()
    store = CheckpointStore(recorder.store.root, keep=3)  # the store as the taking-over node reads it
    rec, rb = TrajectoryRecorder.resume("traj", backend, store, exec_timeout_s=20.0, setup=setup_stated,
                                        checkpoint_mode="full")
    try:
        assert (rb.boundary, rec.gen, store.lease("traj")) == (2, 1, (1, 2))
        run(recorder, 3)  # the old owner, alive on its side of the partition, goes on
        with pytest.raises(CheckpointFenced, match="taken over by generation 1 at boundary 2"):
            recorder.checkpoint()
        assert [c.boundary for c in store.list("traj")] == [0, 1, 2]  # nothing of its was published
        # one that raced the check: a boundary-3 checkpoint of generation 0 in place, manifest and checksum valid
        src = store.list("traj")[-1].path
        raw = json.loads((src / MANIFEST).read_text())
        raw["body"].update(boundary=3, gen=0)
        raw["body_sha256"] = _body_digest(raw["body"])
        late = src.parent / "b000003-1"
        shutil.copytree(src, late)
        (late / MANIFEST).write_text(json.dumps(raw, indent=1, sort_keys=True))
        assert [c.boundary for c in store.list("traj")] == [0, 1, 2]  # ignored by every reader
        # the new owner's own checkpoints are taken and listed past the take-over
        run(rec, 3)
        ck3 = rec.checkpoint()
        assert ck3.body["gen"] == 1 and [c.boundary for c in store.list("traj")] == [1, 2, 3]  # keep=3
        assert store.list("traj")[-1].id == ck3.id and query_state(rec.sandbox) == golden_state(3)
    finally:
        rec.close()


# -- another process restores: node A dies, "node B" resumes from the shared store -------------------------------


def node_a(store_root: str, image: str) -> None:
    """Node A: a trajectory with checkpoints at boundaries 0, 1 and 2, action 3 committed after the last
    checkpoint; prints its own record of the context and its container, then waits to be killed."""
    from belayer_plugin.sandbox.podman import PodmanBackend

    be = PodmanBackend(state_dir=Path(store_root).parent / "node-a-podman")
    sb = Sandbox.create(be, SandboxSpec(image=image, memory_mb=128), "traj", 20.0)
    setup_stated(sb)
    rec = TrajectoryRecorder("traj", sb, CheckpointStore(store_root, keep=3), checkpoint_mode="full")
    rec.start(tokens(0), messages(0))
    for i in (1, 2):
        run(rec, i)
        rec.checkpoint()
    run(rec, 3)
    print("NODE_A " + json.dumps({"container": sb.container_id, "context": {b.index: b.token_ids
                                                                          for b in rec.boundaries}}), flush=True)
    threading.Event().wait()  # until the test kills this "node"


def test_a_trajectory_whose_node_died_is_resumed_by_another_process_from_the_shared_store(
        backend, busybox_image, tmp_path, criu_ok):
    shared = tmp_path / "shared-store"  # sandbox.checkpoint_dir, a directory both "nodes" mount
    a = subprocess.Popen([sys.executable, __file__, str(shared), busybox_image], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in a.stdout], daemon=True).start()
    said, out = None, []
    try:
        while said is None:
            try:
                line = lines.get(timeout=READY_TIMEOUT_S)
            except queue.Empty:
                pytest.fail(f"node A not ready in {READY_TIMEOUT_S} s: {''.join(out)[-3000:]}")
            out.append(line)
            if line.startswith("NODE_A "):
                said = json.loads(line[len("NODE_A "):])
            elif a.poll() is not None and lines.empty():
                pytest.fail(f"node A exited with {a.returncode}: {''.join(out)[-3000:]}")
    finally:
        a.send_signal(signal.SIGKILL)  # the node is lost: its process, and (below) its container
        a.wait(timeout=30)
    backend.kill(said["container"])
    backend.remove(said["container"])
    events: list[dict] = []
    rec, rb = TrajectoryRecorder.resume("traj", backend, CheckpointStore(shared, keep=3), exec_timeout_s=20.0,
                                        on_event=events.append, setup=setup_stated, checkpoint_mode="full")
    try:
        # the newest checkpoint (boundary 2); action 3 died with node A and is regenerated
        assert (rb.boundary, rb.failed_boundary) == (2, 2) and rb.checkpoint_id is not None
        assert rb.token_ids == said["context"]["2"] and rec.latest == 2  # node A's own context at boundary 2
        assert [b.token_ids for b in rec.boundaries] == [said["context"][str(i)] for i in range(3)]
        assert query_state(rb.sandbox) == golden_state(2)  # its in-memory state too: restored by CRIU here
        for i in (3, 4):
            run(rec, i)
        assert query_state(rec.sandbox) == golden_state(4)  # as a fault-free run ends
        assert any(e["kind"] == "rollback" and e.get("resumed_from_store") for e in events)
    finally:
        rec.close()


if __name__ == "__main__":
    node_a(sys.argv[1], sys.argv[2])
