"""Fuzzing checkpoints (hypothesis): real checkpoints of two sandboxes (CRIU images and file-system layer on
Podman), copied, then truncated, bit-flipped, deleted or swapped between the sandboxes (one artifact, the
manifest, or the whole checkpoint). Every mutation is detected as CheckpointCorrupt before the runtime is
asked to restore anything: a corrupt checkpoint is never restored. An untouched copy restores (control).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from belayer_plugin.sandbox.base import Sandbox, SandboxSpec
from belayer_plugin.sandbox.checkpoint import MANIFEST, CheckpointCorrupt, CheckpointStore, full_checkpoint, full_restore
from tests.sandbox_fixtures import busybox_image_for, env_cache, podman  # noqa: F401  (fixtures)

pytestmark = pytest.mark.containers

FUZZ_EXAMPLES = 150
_RESTORING = ("criu_restore", "create", "run", "start")


class _Recording:
    """The real backend, recording every call that would bring a container up from a checkpoint."""

    def __init__(self, inner):
        self.inner, self.name, self.calls = inner, inner.name, []

    def __getattr__(self, item):
        if item in _RESTORING:
            self.calls.append(item)
        return getattr(self.inner, item)


@pytest.fixture(scope="module")
def originals(podman, env_cache, tmp_path_factory):
    """One real checkpoint each of sandboxes `alpha` and `beta` (different state), mode auto."""
    image = busybox_image_for(podman, env_cache)
    store = CheckpointStore(tmp_path_factory.mktemp("ck-originals"), keep=5)
    cks = {}
    for tid in ("alpha", "beta"):
        sb = Sandbox.create(podman, SandboxSpec(image=image, memory_mb=128), tid, 20.0)
        try:
            assert sb.exec(f"mkdir -p /work && echo {tid} > /work/who && (sleep 1000 &)").exit_code == 0
            cks[tid] = full_checkpoint(sb, 1, store, tid, mode="auto", timeout_s=60)
        finally:
            sb.close()
    return cks


def _copy(ck, root: Path, tid: str):
    """A private copy of checkpoint `ck` under `root/tid`, as the store would list it."""
    store = CheckpointStore(root, keep=5)
    dst = root / tid / ck.id
    shutil.copytree(ck.path, dst)
    (held,) = [c for c in store.list(tid) if c.id == ck.id]
    return store, held


MUTATION = st.one_of(
    st.tuples(st.just("truncate"), st.integers(0, 10**6), st.floats(0, 0.999)),
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.floats(0, 0.999), st.integers(0, 7)),
    st.tuples(st.just("delete"), st.integers(0, 10**6)),
    st.tuples(st.just("swap_file"), st.integers(0, 10**6)),
    st.tuples(st.just("swap_manifest")),
    st.tuples(st.just("swap_checkpoint")),
)


def _mutate(m, d: Path, other: Path) -> str:
    files = sorted(p for p in d.rglob("*") if p.is_file())
    kind = m[0]
    if kind == "swap_manifest":
        shutil.copyfile(other / MANIFEST, d / MANIFEST)
        return kind
    if kind == "swap_checkpoint":  # the other sandbox's whole checkpoint, under this one's name
        shutil.rmtree(d)
        shutil.copytree(other, d)
        return kind
    victim = files[m[1] % len(files)]
    rel = victim.relative_to(d)
    if kind == "delete":
        victim.unlink()
    elif kind == "swap_file":
        donor = other / rel if (other / rel).is_file() else max(other.rglob("*"), key=lambda p: p.stat().st_size)
        if donor.read_bytes() == victim.read_bytes():  # identical in both: swap in another artifact instead
            donor = max((p for p in other.rglob("*") if p.is_file() and p.read_bytes() != victim.read_bytes()),
                        key=lambda p: p.stat().st_size)
        shutil.copyfile(donor, victim)
    else:
        data = bytearray(victim.read_bytes())
        if not data:
            victim.write_bytes(b"\0")  # an empty artifact grown by one byte
            return f"grow {rel}"
        if kind == "truncate":
            victim.write_bytes(bytes(data[: int(len(data) * m[2])]))
        else:
            data[int(len(data) * m[2])] ^= 1 << m[3]
            victim.write_bytes(bytes(data))
    return f"{kind} {rel}"


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(m=MUTATION)
def test_a_corrupted_or_swapped_checkpoint_is_never_restored(podman, originals, tmp_path_factory, m):
    root = tmp_path_factory.mktemp("ck-fuzz")
    store, held = _copy(originals["alpha"], root, "alpha")
    what = _mutate(m, held.path, originals["beta"].path)
    with pytest.raises(CheckpointCorrupt):
        store.verify(held)
    spy = _Recording(podman)
    with pytest.raises(CheckpointCorrupt):
        full_restore(held, spy, store, sandbox_id="alpha", timeout_s=30)
    assert spy.calls == [], f"{what}: the runtime was asked to restore ({spy.calls})"
    for ck in store.list("alpha"):  # what a fresh reader finds on disk is rejected too
        with pytest.raises(CheckpointCorrupt):
            store.verify(ck)
    shutil.rmtree(root, ignore_errors=True)


def test_an_untouched_copy_restores_with_its_own_state(podman, originals, tmp_path):
    store, held = _copy(originals["alpha"], tmp_path, "alpha")
    store.verify(held)
    sb = full_restore(held, podman, store, sandbox_id="alpha", timeout_s=60)
    try:
        assert sb.exec("cat /work/who").stdout.strip() == "alpha"
    finally:
        sb.close()
