"""Checkpoint store: atomic publish, verification, retention (no containers needed)."""

from __future__ import annotations

import json

import pytest

from belayer_plugin.sandbox.base import CheckpointCorrupt, CheckpointError
from belayer_plugin.sandbox.checkpoint import MANIFEST, CheckpointStore


def publish(store: CheckpointStore, tid: str, boundary: int, payload: bytes = b"x" * 1000):
    st = store.new_staging(tid)
    (st / "a.bin").write_bytes(payload)
    (st / "sub").mkdir()
    (st / "sub/b.img").write_bytes(payload[::-1] + b"tail")
    return store.publish(st, {"boundary": boundary, "trajectory_id": tid, "mode": "fs_only", "backend": "podman",
                              "spec": {"image": "i"}, "artifact_names": ["a.bin", "sub/b.img"]})


def test_published_checkpoint_verifies_and_lists_in_boundary_order(tmp_path):
    s = CheckpointStore(tmp_path, keep=5)
    c2, c1 = publish(s, "t", 2), publish(s, "t", 1)
    assert [c.boundary for c in s.list("t")] == [1, 2]
    s.verify(c1)
    s.verify(c2)
    sizes = {f["name"]: f["size"] for f in c1.body["files"]}
    assert sizes == {"a.bin": 1000, "sub/b.img": 1004}


def test_staging_directory_without_manifest_is_never_listed_and_is_cleaned(tmp_path):
    s = CheckpointStore(tmp_path)
    st = s.new_staging("t")
    (st / "a.bin").write_bytes(b"partial")
    assert s.list("t") == [] and s.latest("t") is None
    assert s.clean_staging("t") == 1 and not st.exists()


def test_missing_artifact_refuses_to_publish_and_nothing_appears(tmp_path):
    s = CheckpointStore(tmp_path)
    st = s.new_staging("t")
    with pytest.raises(CheckpointError):
        s.publish(st, {"boundary": 1, "trajectory_id": "t", "mode": "full", "backend": "podman", "spec": {},
                       "artifact_names": ["nope.img"]})
    assert s.list("t") == []


@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "delete", "edit_manifest", "garbage_manifest"])
def test_damaged_checkpoint_fails_verification(tmp_path, damage):
    s = CheckpointStore(tmp_path)
    ck = publish(s, "t", 1)
    if damage == "flip_byte":
        p = ck.path / "sub/b.img"
        data = bytearray(p.read_bytes())
        data[10] ^= 0x01
        p.write_bytes(bytes(data))
    elif damage == "truncate":
        p = ck.path / "a.bin"
        p.write_bytes(p.read_bytes()[:-1])
    elif damage == "delete":
        (ck.path / "a.bin").unlink()
    elif damage == "edit_manifest":
        raw = json.loads((ck.path / MANIFEST).read_text())
        raw["body"]["boundary"] = 7  # checksum no longer matches
        (ck.path / MANIFEST).write_text(json.dumps(raw))
    else:
        (ck.path / MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointCorrupt):
        s.verify(ck)


def test_gc_keeps_the_newest_and_drop_after_discards_a_rolled_back_future(tmp_path):
    s = CheckpointStore(tmp_path, keep=2)
    for b in range(4):
        publish(s, "t", b)
        s.gc("t")
    assert [c.boundary for c in s.list("t")] == [2, 3]
    assert s.drop_after("t", 2) == 1
    assert [c.boundary for c in s.list("t")] == [2]
    assert s.latest("t", at_or_before=1) is None and s.latest("t").boundary == 2


def test_keep_zero_is_rejected_and_bad_trajectory_ids_are_refused(tmp_path):
    with pytest.raises(ValueError):
        CheckpointStore(tmp_path, keep=0)
    with pytest.raises(ValueError):
        CheckpointStore(tmp_path).new_staging("../escape")


def test_a_stuck_runtime_dump_of_one_container_is_killed_and_no_other_process():
    # The soak found a CRIU dump of a container killed mid-dump waiting forever while dockerd held the
    # container's lock. kill_stuck_dumps ends the CRIU under `runc ... checkpoint ... <id>` of that container.
    import subprocess
    import time

    from belayer_plugin.sandbox.base import kill_stuck_dumps

    def fake_runc(cid: str) -> tuple[subprocess.Popen, int]:
        # argv[0] "runc" and the runtime's argument shape; its child (a sleep) stands for CRIU
        p = subprocess.Popen(["bash", "-c", "exec -a runc bash -c 'sleep 300 & echo $!; wait' checkpoint "
                              f"--leave-running {cid}"], stdout=subprocess.PIPE, text=True)
        return p, int(p.stdout.readline())

    victim, criu = fake_runc("c0ffee" * 10)
    other, other_criu = fake_runc("beef" * 16)
    try:
        assert kill_stuck_dumps("c0ffee" * 10) == 1
        deadline = time.monotonic() + 10
        while _alive(criu):
            assert time.monotonic() < deadline, "the stuck dump survived"
            time.sleep(0.02)  # a killed process leaves /proc asynchronously; bounded by the deadline
        assert _alive(other_criu), "another container's checkpoint was killed"
    finally:
        for p in (victim, other):
            p.kill()
        subprocess.run(["kill", "-9", str(other_criu)], check=False)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
