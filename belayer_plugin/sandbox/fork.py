"""Sandbox fork: one committed checkpoint restored into n independent containers.

A fork is `full_restore` n times from the same verified checkpoint, each into its own fresh container, so
every branch starts with the parent's process memory and file system at that action boundary and then
diverges on its own (GRPO groups that share an environment state; tree-structured rollouts branching at an
action). A branch adopts the checkpoint under its own trajectory id (hard links, no copy), so it can roll
back to the fork point later even after the parent's store forgot it.

Owns: restoring one checkpoint into n containers and forking the context per branch. Must not: decide when to
fork.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

from belayer_plugin.sandbox.base import Backend, EventSink, RestoreError, Sandbox
from belayer_plugin.sandbox.checkpoint import Checkpoint, CheckpointStore, full_restore


def fork_sandboxes(ck: Checkpoint, backend: Backend, n: int, *, store: Optional[CheckpointStore] = None,
                   sandbox_ids: Optional[Sequence[str]] = None, timeout_s: float = 60.0,
                   exec_timeout_s: float = 60.0, workers: int = 0,
                   on_event: Optional[EventSink] = None) -> list[Sandbox]:
    """n running sandboxes restored from `ck`; all or none (a failed branch closes the others).

    The checkpoint is verified once up front (CheckpointCorrupt: nothing is started). `workers` restores
    run at a time (0: two per core, at most n): a restore waits on the runtime's locks, CRIU and I/O for
    much of its time (bench/fork.py, 8 forks on 2 cores: 4 at a time 1.3 s, 2 at a time 1.65 s). Backends
    that cannot restore one checkpoint concurrently (`parallel_restores = False`) restore one at a time.
    """
    if n < 1:
        raise ValueError(f"fork needs n >= 1, got {n}")
    ids = list(sandbox_ids) if sandbox_ids is not None else [f"{ck.trajectory_id}-fork{i}" for i in range(n)]
    if len(ids) != n:
        raise ValueError(f"{len(ids)} sandbox ids for {n} forks")
    (store or CheckpointStore(ck.path.parent.parent, keep=1 << 30)).verify(ck)
    # Verified above; the branches skip re-hashing the artifacts (n x sha256 of a large image).
    trusted = _TrustedStore(ck)
    t0 = time.monotonic()

    def one(sid: str) -> Sandbox:
        return full_restore(ck, backend, trusted, sandbox_id=sid, timeout_s=timeout_s,
                            exec_timeout_s=exec_timeout_s, on_event=on_event)

    if not getattr(backend, "parallel_restores", True):
        workers = 1
    pool = ThreadPoolExecutor(max_workers=min(n, workers or 2 * (os.cpu_count() or 1)), thread_name_prefix="fork")
    futures = [pool.submit(one, sid) for sid in ids]
    pool.shutdown(wait=True)
    made, errors = [], []
    for sid, f in zip(ids, futures):
        e = f.exception()
        if e is None:
            made.append(f.result())
        else:
            errors.append(f"{sid}: {type(e).__name__}: {e}")
    if errors:
        for sb in made:
            try:
                sb.close()
            except Exception:  # best effort: the error below is what the caller must see
                pass
        raise RestoreError(f"fork of {ck.id} into {n} failed ({len(errors)} branches): " + "; ".join(errors))
    if on_event is not None:
        on_event({"t": time.time(), "component": "sandbox", "subject": ck.trajectory_id, "kind": "fork",
                  "reason": f"{n} branches from checkpoint {ck.id}", "checkpoint": ck.id, "boundary": ck.boundary,
                  "branches": ids, "duration_s": round(time.monotonic() - t0, 4)})
    return made


class _TrustedStore:
    """A store view whose verify() is a no-op for one checkpoint fork_sandboxes has just verified."""

    def __init__(self, ck: Checkpoint):
        self.ck = ck

    def verify(self, ck: Checkpoint) -> None:
        if ck is not self.ck:
            raise RestoreError("fork restores only the checkpoint it verified")


def adopt_checkpoint(store: CheckpointStore, ck: Checkpoint, trajectory_id: str) -> Checkpoint:
    """`ck` published under `trajectory_id` too (artifacts hard-linked, manifest re-signed), verified."""
    staging = store.new_staging(trajectory_id)
    try:
        names = []
        for f in ck.body["files"]:
            src, dst = ck.path / f["name"], staging / f["name"]
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:  # another file system: copy
                shutil.copy2(src, dst)
            names.append(f["name"])
        body = {k: v for k, v in ck.body.items() if k not in ("files", "format")}
        body.update(trajectory_id=trajectory_id, artifact_names=names, forked_from=ck.id)
        new = store.publish(staging, body)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    store.verify(new)
    return new


__all__ = ["adopt_checkpoint", "fork_sandboxes"]
