"""full_checkpoint / full_restore: verified, atomically published checkpoints of a sandbox.

A checkpoint is a directory `<root>/<trajectory>/b<boundary>-<seq>/` holding the artifacts (CRIU images and
the writable layer, or the writable layer alone in fs-only mode), the LLM context of every boundary up to
its own (context.json: any process reading the store can resume the trajectory from it) and MANIFEST.json
(boundary, trajectory id, mode, the sandbox spec, the signature of the host that took it (sandbox/host.py),
size and sha256 of every artifact, and a checksum of the manifest itself). It is assembled in a
`.staging-*` directory and published by one rename once every artifact is complete, so a reader sees
either a whole checkpoint or none; anything that fails verification is never restored, nor is a checkpoint
from a host this one does not match (CheckpointIncompatible).

Each trajectory has a lease in the store (`.lease`: a generation and the boundary it took over at). A
trajectory resumed elsewhere (`take_over`: its node was lost or cut off) gets the next generation, and its
checkpoints carry it. One of an older generation past the take-over boundary, published late by a cut-off
node that still runs the old sandbox, is refused at publish (CheckpointFenced) and ignored by `list` when it
slipped in between that check and its rename: it is a future the trajectory abandoned.

Owns: the checkpoint format, its manifest and checksum, publishing and verified restore. Must not: decide when
to checkpoint (sandbox/policy.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from belayer_plugin.sandbox.base import (
    Backend,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointFenced,
    CheckpointIncompatible,
    CheckpointTimeout,
    CriuUnavailable,
    EventSink,
    RestoreError,
    Sandbox,
    SandboxDead,
    SandboxError,
    SandboxSpec,
    kill_cgroup_leftovers,
    new_name,
)
from belayer_plugin.sandbox.fsdiff import tar_upper, untar_upper
from belayer_plugin.sandbox.host import host_signature, mismatches

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
FS_FILE = "rootfs-diff.tar"
CONTEXT_FILE = "context.json"
LEASE = ".lease"  # the trajectory's generation (take_over); a dot name: never listed as a checkpoint
FORMAT = 1
MODES = ("full", "fs_only", "auto")
_WARNED: set[str] = set()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _body_digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass
class Checkpoint:
    """A published checkpoint: its directory and manifest body."""

    path: Path
    body: dict

    @property
    def boundary(self) -> int:
        return int(self.body["boundary"])

    @property
    def trajectory_id(self) -> str:
        return str(self.body["trajectory_id"])

    @property
    def mode(self) -> str:
        return str(self.body["mode"])

    @property
    def id(self) -> str:
        return self.path.name

    @property
    def spec(self) -> SandboxSpec:
        return SandboxSpec(**self.body["spec"])

    @property
    def size_bytes(self) -> int:
        return sum(int(f["size"]) for f in self.body["files"])

    @property
    def host(self) -> Optional[dict]:
        """The signature of the host that took it (None for a checkpoint taken before signatures)."""
        return self.body.get("host")

    def context(self) -> Optional[list[dict]]:
        """The LLM context of each boundary 0..boundary ({index, token_ids, messages, action}), as the recorder
        gave it when the checkpoint was taken; None when the checkpoint carries none. Read it after
        CheckpointStore.verify (the file is one of the checksummed artifacts)."""
        if not any(f["name"] == CONTEXT_FILE for f in self.body.get("files", [])):
            return None
        try:
            return list(json.loads((self.path / CONTEXT_FILE).read_text())["boundaries"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointCorrupt(f"{self.id}: unreadable {CONTEXT_FILE} ({e})") from None


class CheckpointStore:
    """Published checkpoints under `root`, per trajectory; keeps the newest `keep` of each trajectory."""

    def __init__(self, root: str | Path, keep: int = 2):
        if keep < 1:
            raise ValueError("keep must be >= 1 (the previous checkpoint stays until a new one is published)")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = keep

    def _tdir(self, trajectory_id: str) -> Path:
        if not trajectory_id or "/" in trajectory_id or trajectory_id.startswith("."):
            raise ValueError(f"bad trajectory id {trajectory_id!r}")
        d = self.root / trajectory_id
        d.mkdir(parents=True, exist_ok=True)
        return d

    def new_staging(self, trajectory_id: str) -> Path:
        """A fresh private directory to assemble a checkpoint in."""
        d = self._tdir(trajectory_id) / f".staging-{uuid.uuid4().hex}"
        d.mkdir()
        return d

    def clean_staging(self, trajectory_id: Optional[str] = None) -> int:
        """Deletes leftovers of interrupted checkpoints (staging and discarded dirs); returns how many."""
        n = 0
        dirs = [self._tdir(trajectory_id)] if trajectory_id else [d for d in self.root.iterdir() if d.is_dir()]
        for d in dirs:
            for s in d.iterdir():
                if s.name.startswith((".staging-", ".discard-")):
                    shutil.rmtree(s, ignore_errors=True)
                    n += 1
        return n

    def lease(self, trajectory_id: str) -> tuple[int, int]:
        """(generation, boundary it took over at) of the trajectory's lease; (0, -1) before any take-over."""
        try:
            d = json.loads((self._tdir(trajectory_id) / LEASE).read_text())
            return int(d["gen"]), int(d["from_boundary"])
        except FileNotFoundError:
            return 0, -1
        except (OSError, ValueError, KeyError, TypeError) as e:
            # an unreadable lease must not let a fenced owner back in: nothing past boundary 0 is trusted
            log.warning("unreadable lease of %s (%s): fencing every generation", trajectory_id, e)
            return 1 << 30, 0

    def take_over(self, trajectory_id: str, boundary: int) -> int:
        """The trajectory continues from `boundary` under a new generation (returned); checkpoints of older ones
        past `boundary` are refused and ignored from now on. Written atomically (rename)."""
        gen = self.lease(trajectory_id)[0] + 1
        d = self._tdir(trajectory_id)
        tmp = d / f".lease-{uuid.uuid4().hex}"
        with open(tmp, "w") as f:
            json.dump({"gen": gen, "from_boundary": int(boundary), "t": time.time()}, f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, d / LEASE)
        _fsync_dir(d)
        return gen

    def _fenced(self, trajectory_id: str, body: dict) -> Optional[str]:
        gen, since = self.lease(trajectory_id)
        mine = int(body.get("gen", 0))
        if mine < gen and int(body["boundary"]) > since:
            return (f"trajectory {trajectory_id} was taken over by generation {gen} at boundary {since}; this "
                    f"checkpoint (generation {mine}, boundary {body['boundary']}) is of the abandoned branch")
        return None

    def publish(self, staging: Path, body: dict) -> Checkpoint:
        """Checksums the artifacts, writes the manifest and renames the complete directory into place;
        CheckpointFenced when the trajectory was taken over by a newer generation before this boundary."""
        why = self._fenced(str(body["trajectory_id"]), body)
        if why:
            raise CheckpointFenced(why)
        files = []
        for rel in body.pop("artifact_names"):
            p = staging / rel
            if not p.is_file():
                raise CheckpointError(f"artifact {rel} missing from staging")
            files.append({"name": rel, "size": p.stat().st_size, "sha256": _sha256(p)})
            with open(p, "rb+") as f:
                os.fsync(f.fileno())
        body = {**body, "format": FORMAT, "files": files}
        with open(staging / MANIFEST, "w") as f:
            json.dump({"body": body, "body_sha256": _body_digest(body)}, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(staging)
        final = staging.parent / f"b{int(body['boundary']):06d}-{time.time_ns()}"
        os.rename(staging, final)
        _fsync_dir(staging.parent)
        return Checkpoint(final, body)

    def _load(self, path: Path) -> Checkpoint:
        try:
            raw = json.loads((path / MANIFEST).read_text())
            body = raw["body"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointCorrupt(f"{path.name}: unreadable manifest ({e})") from None
        if not isinstance(body, dict) or _body_digest(body) != raw.get("body_sha256"):
            raise CheckpointCorrupt(f"{path.name}: manifest checksum mismatch")
        return Checkpoint(path, body)

    def list(self, trajectory_id: str) -> list[Checkpoint]:
        """Published checkpoints of a trajectory with a readable manifest, oldest first (not yet verified)."""
        out = []
        for p in sorted(self._tdir(trajectory_id).iterdir()):
            if p.name.startswith(".") or not p.is_dir():
                continue
            try:
                ck = self._load(p)
            except CheckpointCorrupt as e:
                log.warning("ignoring checkpoint: %s", e)
                continue
            why = self._fenced(trajectory_id, ck.body)
            if why:  # published by a fenced owner between publish's check and its rename
                log.warning("ignoring checkpoint %s: %s", ck.id, why)
                continue
            out.append(ck)
        return sorted(out, key=lambda c: (c.boundary, c.id))

    def verify(self, ck: Checkpoint) -> None:
        """Raises CheckpointCorrupt unless the manifest and every artifact's size and sha256 match."""
        fresh = self._load(ck.path)
        if fresh.body != ck.body:
            raise CheckpointCorrupt(f"{ck.id}: manifest changed on disk")
        if fresh.body.get("format") != FORMAT or not fresh.body.get("files"):
            raise CheckpointCorrupt(f"{ck.id}: unknown format or no artifacts")
        if fresh.body.get("trajectory_id") != ck.path.parent.name:
            # a whole checkpoint moved or copied under another trajectory: its state is not this one's
            raise CheckpointCorrupt(f"{ck.id}: belongs to trajectory {fresh.body.get('trajectory_id')!r}, "
                                    f"found under {ck.path.parent.name!r}")
        for f in fresh.body["files"]:
            p = ck.path / f["name"]
            try:
                size = p.stat().st_size
            except OSError:
                raise CheckpointCorrupt(f"{ck.id}: artifact {f['name']} missing") from None
            if size != int(f["size"]):
                raise CheckpointCorrupt(f"{ck.id}: artifact {f['name']} has {size} bytes, manifest says {f['size']}")
            if _sha256(p) != f["sha256"]:
                raise CheckpointCorrupt(f"{ck.id}: artifact {f['name']} checksum mismatch")

    def discard(self, ck: Checkpoint) -> None:
        """Removes a checkpoint (renamed out of sight first, so a crash mid-delete leaves nothing usable)."""
        if not ck.path.exists():
            return
        gone = ck.path.parent / f".discard-{ck.path.name}"
        os.rename(ck.path, gone)
        shutil.rmtree(gone, ignore_errors=True)

    def drop_after(self, trajectory_id: str, boundary: int) -> int:
        """Discards checkpoints past `boundary` (a rolled-back branch's future must never be restored)."""
        n = 0
        for ck in self.list(trajectory_id):
            if ck.boundary > boundary:
                self.discard(ck)
                n += 1
        return n

    def gc(self, trajectory_id: str) -> int:
        """Keeps the newest `keep` checkpoints of the trajectory; returns how many were removed."""
        cks = self.list(trajectory_id)
        old = cks[: max(0, len(cks) - self.keep)]
        for ck in old:
            self.discard(ck)
        return len(old)

    def latest(self, trajectory_id: str, at_or_before: Optional[int] = None) -> Optional[Checkpoint]:
        """The newest published checkpoint at or before a boundary (unverified)."""
        cks = [c for c in self.list(trajectory_id) if at_or_before is None or c.boundary <= at_or_before]
        return cks[-1] if cks else None


def resolve_mode(backend: Backend, mode: str) -> tuple[str, Optional[str]]:
    """("full" | "fs_only", why CRIU is unavailable or None). Raises CriuUnavailable for mode="full"."""
    if mode not in MODES:
        raise ValueError(f"checkpoint mode must be one of {MODES}, got {mode!r}")
    if mode == "fs_only":
        return "fs_only", None
    problem = backend.criu_problem()
    if problem is None:
        return "full", None
    if mode == "full":
        raise CriuUnavailable(problem)
    return "fs_only", problem


def _emit(on_event: Optional[EventSink], subject: str, kind: str, reason: str, **figures: Any) -> None:
    rec = {"t": time.time(), "component": "sandbox", "subject": subject, "kind": kind, "reason": reason, **figures}
    log.info("sandbox %s %s: %s %s", subject, kind, reason, figures)
    if on_event is not None:
        try:
            on_event(rec)
        except Exception:
            log.exception("on_event callback failed")


def full_checkpoint(sandbox: Sandbox, boundary: int, store: CheckpointStore, trajectory_id: str,
                    mode: str = "auto", timeout_s: float = 60.0,
                    on_event: Optional[EventSink] = None, context: Optional[list[dict]] = None,
                    gen: int = 0) -> Checkpoint:
    """Captures the writable layer and (unless fs-only) the process state at a committed action boundary,
    with the LLM context of boundaries 0..boundary when `context` is given and this host's signature.

    Publishes only when every artifact is complete; on any failure the staging directory is deleted and
    the previous checkpoint stays. Raises SandboxDead when the container died (before or during it).
    """
    sink = on_event or sandbox.on_event
    real_mode, why = resolve_mode(sandbox.backend, mode)
    if why:
        if why not in _WARNED:
            _WARNED.add(why)
            log.warning("sandbox checkpoints are FILE-SYSTEM ONLY (processes restart fresh after a restore): %s", why)
        _emit(sink, trajectory_id, "checkpoint_mode", f"CRIU unavailable, file-system only: {why}",
              requested=mode, mode=real_mode)
    host = host_signature(sandbox.backend, sandbox.spec.image)  # cached after the first: off the freeze
    t0 = time.monotonic()
    with sandbox.lock:
        if not sandbox.alive():
            raise SandboxDead(f"sandbox {sandbox.sandbox_id} is not running; cannot checkpoint")
        sandbox.reap_exec_helpers()
        staging = store.new_staging(trajectory_id)
        be = sandbox.backend
        try:
            if real_mode == "full":
                cont_name = new_name()
                names, new_cid = be.criu_checkpoint(sandbox.container_id, sandbox.spec, staging, timeout_s,
                                                    cont_name)
                if new_cid:  # the backend continued in a fresh container (podman)
                    sandbox.container_id, sandbox.name = new_cid, cont_name
            else:
                be.pause(sandbox.container_id)
                try:
                    tar_upper(be.upper_dir(sandbox.container_id), staging / FS_FILE, timeout_s)
                finally:
                    be.unpause(sandbox.container_id)
                names = [FS_FILE]
            if context is not None:
                (staging / CONTEXT_FILE).write_text(json.dumps({"boundaries": context}, separators=(",", ":")))
                names = [*names, CONTEXT_FILE]
            elapsed = time.monotonic() - t0
            if elapsed > timeout_s:
                raise CheckpointTimeout(f"checkpoint took {elapsed:.2f}s > timeout {timeout_s}s")
            ck = store.publish(staging, {
                "boundary": int(boundary), "trajectory_id": trajectory_id, "mode": real_mode,
                "backend": be.name, "spec": dataclasses.asdict(sandbox.spec), "created_t": time.time(), "host": host,
                "duration_s": elapsed, "artifact_names": names, "gen": int(gen)})
        except BaseException as e:
            shutil.rmtree(staging, ignore_errors=True)
            alive = False
            try:
                alive = sandbox.alive()
            except Exception:
                pass
            _emit(sink, trajectory_id, "checkpoint_failed", f"{type(e).__name__}: {e}", boundary=boundary,
                  mode=real_mode, duration_s=time.monotonic() - t0, sandbox_alive=alive)
            if not alive and isinstance(e, (SandboxError, OSError)):
                raise SandboxDead(f"sandbox died during checkpoint: {e}") from e
            if isinstance(e, SandboxError) and not isinstance(e, CheckpointError):
                raise CheckpointError(str(e)) from e
            raise
    removed = store.gc(trajectory_id)
    _emit(sink, trajectory_id, "checkpoint", "published", boundary=boundary, mode=real_mode,
          duration_s=ck.body["duration_s"], size_bytes=ck.size_bytes, checkpoint=ck.id, removed_old=removed)
    return ck


def full_restore(ck: Checkpoint, backend: Backend, store: Optional[CheckpointStore] = None,
                 sandbox_id: Optional[str] = None, timeout_s: float = 60.0, exec_timeout_s: float = 60.0,
                 on_event: Optional[EventSink] = None, name: Optional[str] = None) -> Sandbox:
    """A fresh container continuing from the checkpoint (processes too, unless it is fs-only).

    Verifies the checkpoint first (CheckpointCorrupt: never used), then that this host can restore it
    (CheckpointIncompatible, naming each difference: never used). After a failed restore nothing of the
    half-restored sandbox keeps running: the container and everything left in its cgroup are killed.
    """
    t0 = time.monotonic()
    subject = sandbox_id or ck.trajectory_id
    if store is not None:
        store.verify(ck)
    else:
        CheckpointStore(ck.path.parent.parent, keep=1 << 30).verify(ck)
    if ck.body["backend"] != backend.name:
        raise RestoreError(f"checkpoint {ck.id} was taken with {ck.body['backend']}, not {backend.name}")
    spec = ck.spec
    bad = mismatches(ck.host, host_signature(backend, spec.image), ck.mode)
    if bad:
        err = CheckpointIncompatible(f"checkpoint {ck.id} ({ck.mode}) cannot be restored on this host: "
                                     + "; ".join(bad), bad)
        _emit(on_event, subject, "restore_refused", str(err), checkpoint=ck.id, boundary=ck.boundary,
              mode=ck.mode, mismatches=bad)
        raise err
    name = name or new_name()
    t_verify = time.monotonic() - t0
    try:
        if ck.mode == "full":
            cid = backend.criu_restore(ck.path, spec, name, timeout_s)
        else:
            cid = backend.create(spec, name)
            try:
                untar_upper(ck.path / FS_FILE, backend.upper_dir(cid), timeout_s)
                backend.start(cid)
            except BaseException as e:
                _discard(backend, name, cid)
                raise RestoreError(f"{type(e).__name__}: {e}", cid) from e
        if not backend.is_running(cid):
            _discard(backend, name, cid)
            raise RestoreError(f"restored container {name} is not running", cid)
    except (SandboxError, OSError) as e:
        cid_failed = getattr(e, "container_id", None)
        _emit(on_event, subject, "restore_failed", f"{type(e).__name__}: {e}", checkpoint=ck.id,
              boundary=ck.boundary, mode=ck.mode, duration_s=time.monotonic() - t0, container_id=cid_failed)
        if isinstance(e, RestoreError):
            raise
        raise RestoreError(str(e), cid_failed) from e
    sb = Sandbox(backend, spec, cid, name, sandbox_id, exec_timeout_s, on_event)
    sb.processes_fresh = ck.mode != "full"
    _emit(on_event, subject, "restore", "fresh container from checkpoint", checkpoint=ck.id,
          boundary=ck.boundary, mode=ck.mode, duration_s=time.monotonic() - t0, verify_s=t_verify,
          processes_restored=ck.mode == "full",
          # The container id the runtime's own restore printed (podman/docker `container restore`): absent
          # on a file-system-only restore (a fresh container started from the image); chaos/check.py reads it.
          runtime_restored_id=cid if ck.mode == "full" else None)
    return sb


def _discard(backend: Backend, name: str, cid: Optional[str]) -> None:
    backend.kill(name)
    backend.remove(name)
    if cid:
        kill_cgroup_leftovers(cid)
