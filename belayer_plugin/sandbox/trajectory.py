"""Prefix consistency: committed action boundaries tied to the LLM context and to sandbox checkpoints.

Boundary k is the state after k committed actions: the context (token ids, messages) the agent had then,
the action that led there, and the checkpoint taken there if any. On an environment failure the recorder
restores the newest usable checkpoint at or before the last committed boundary into a fresh container,
truncates the context to that same boundary and hands it back so the agent regenerates from there. The
action that was in flight when the environment failed has an uncertain effect and is never replayed;
committed actions may be replayed exactly when the environment is declared deterministic.

Every checkpoint carries the context of the boundaries up to its own, so a process other than the one that
took it (on another node, reading a shared store) resumes the trajectory from it: `TrajectoryRecorder.resume`.

Owns: action boundaries, the checkpoint/restore cycle of one trajectory and the LLM context's rollback to the
same boundary. Must not: choose engines or generate tokens.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from belayer_plugin.sandbox.base import (
    Backend,
    CheckpointCorrupt,
    CheckpointIncompatible,
    EventSink,
    RestoreError,
    Sandbox,
    SandboxDead,
    SandboxError,
    SandboxSpec,
)
from belayer_plugin.sandbox.checkpoint import (CONTEXT_FILE, Checkpoint, CheckpointStore, full_checkpoint,
                                               full_restore)

log = logging.getLogger(__name__)


@dataclass
class BoundaryRecord:
    """The state after `index` committed actions."""

    index: int
    token_ids: list[int]
    messages: list[dict]
    action: Any = None  # the action that led here (None at boundary 0)
    result: Any = None
    checkpoint_id: Optional[str] = None
    t: float = field(default_factory=time.time)


@dataclass
class Rollback:
    """What recovery hands back to the agent."""

    boundary: int  # the agent continues after this many committed actions
    token_ids: list[int]
    messages: list[dict]
    sandbox: Sandbox
    checkpoint_id: Optional[str]  # None: rebuilt from the base image
    failed_boundary: int  # the last committed boundary when the environment failed
    discarded_actions: int  # committed actions whose effects were rolled back (the agent regenerates them)
    uncertain_action: Any  # the in-flight action whose effect was uncertain (never replayed), or None
    replayed_actions: int = 0
    restore_s: float = 0.0


def _record_json(r: BoundaryRecord) -> dict:
    """A boundary as a checkpoint's context.json stores it (the action only where JSON can carry it)."""
    try:
        action = json.loads(json.dumps(r.action))
    except (TypeError, ValueError):
        action = None
    return {"index": r.index, "token_ids": list(r.token_ids), "messages": r.messages, "action": action}


def default_replay(sandbox: Sandbox, action: Any) -> Any:
    """Replays an action recorded as {"command": ..., "timeout": ...} (or a plain command string)."""
    if isinstance(action, dict):
        return sandbox.exec(action["command"], timeout=action.get("timeout"))
    return sandbox.exec(action)


class TrajectoryRecorder:
    """Records boundaries and checkpoints of one trajectory and recovers it prefix-consistently."""

    def __init__(self, trajectory_id: str, sandbox: Sandbox, store: CheckpointStore, *,
                 checkpoint_mode: str = "auto", checkpoint_timeout_s: float = 30.0,
                 restore_timeout_s: float = 60.0, restore_retries: int = 2, deterministic: bool = False,
                 replay: bool = False, setup: Optional[Callable[[Sandbox], None]] = None,
                 replay_fn: Callable[[Sandbox, Any], Any] = default_replay,
                 on_event: Optional[EventSink] = None, skip_unchanged: bool = False):
        if replay and not deterministic:
            raise ValueError("exact replay needs an environment declared deterministic")
        self.trajectory_id = trajectory_id
        self.sandbox = sandbox
        self.backend: Backend = sandbox.backend
        self.base_spec: SandboxSpec = sandbox.spec
        self.store = store
        self.checkpoint_mode = checkpoint_mode
        self.checkpoint_timeout_s = checkpoint_timeout_s
        self.restore_timeout_s = restore_timeout_s
        self.restore_retries = restore_retries
        self.deterministic = deterministic
        self.replay = replay
        self.setup = setup
        self.replay_fn = replay_fn
        self.on_event = on_event
        self.boundaries: list[BoundaryRecord] = []
        self.in_flight: Any = None
        self._has_in_flight = False
        self.epoch = 0  # bumped by each recovery: a checkpoint started before it is stale
        self.gen = 0  # the store's lease generation this recorder checkpoints under (resume takes a new one)
        self._lock = threading.RLock()
        self._ck_lock = threading.Lock()  # one checkpoint at a time; recovery waits for it
        self.checkpoints: dict[str, Checkpoint] = {}
        self.recoveries = 0
        # Side-effect-aware checkpoints: a boundary whose sandbox fingerprint equals the one taken right
        # after checkpoint `_clean[0]` (or right after restoring it) is that checkpoint's state already.
        self.skip_unchanged = skip_unchanged
        self._clean: Optional[tuple[str, str]] = None
        self.skipped_checkpoints = 0

    # -- events ---------------------------------------------------------------------------------------
    def _emit(self, kind: str, reason: str, **figures: Any) -> None:
        rec = {"t": time.time(), "component": "sandbox", "subject": self.trajectory_id, "kind": kind,
               "reason": reason, **figures}
        log.info("trajectory %s %s: %s %s", self.trajectory_id, kind, reason, figures)
        if self.on_event is not None:
            try:
                self.on_event(rec)
            except Exception:
                log.exception("on_event callback failed")

    # -- recording ------------------------------------------------------------------------------------
    @property
    def latest(self) -> int:
        """The index of the last committed boundary."""
        return self.boundaries[-1].index if self.boundaries else -1

    def start(self, token_ids: list[int], messages: list[dict], checkpoint: bool = True) -> Optional[Checkpoint]:
        """Records boundary 0 (the prompt) and, by default, checkpoints the set-up sandbox there."""
        with self._lock:
            if self.boundaries:
                raise RuntimeError("trajectory already started")
            self.boundaries.append(BoundaryRecord(0, list(token_ids), copy.deepcopy(messages)))
        return self.checkpoint(0) if checkpoint else None

    def begin_action(self, action: Any) -> None:
        """Marks `action` in flight: until `commit`, its effect on the environment is uncertain."""
        with self._lock:
            if not self.boundaries:
                raise RuntimeError("call start() first")
            if self._has_in_flight:
                raise RuntimeError("an action is already in flight")
            self.in_flight, self._has_in_flight = action, True

    def commit(self, token_ids: list[int], messages: list[dict], result: Any = None) -> int:
        """Commits the in-flight action with the context after it; returns the new boundary index."""
        with self._lock:
            if not self._has_in_flight:
                raise RuntimeError("commit without begin_action")
            rec = BoundaryRecord(self.latest + 1, list(token_ids), copy.deepcopy(messages), self.in_flight, result)
            self.boundaries.append(rec)
            self.in_flight, self._has_in_flight = None, False
            return rec.index

    def execute(self, action: Any, token_ids: list[int], messages: list[dict],
                run: Optional[Callable[[Sandbox, Any], Any]] = None) -> tuple[int, Any]:
        """begin_action + run it on the sandbox + commit. Raises SandboxDead (then call `recover`)."""
        self.begin_action(action)
        result = (run or self.replay_fn)(self.sandbox, action)
        return self.commit(token_ids, messages, result), result

    # -- checkpoints ----------------------------------------------------------------------------------
    def checkpoint(self, boundary: Optional[int] = None) -> Optional[Checkpoint]:
        """Checkpoints the sandbox at the last committed boundary; None if it is no longer that boundary.

        Safe to call from the policy's worker thread: it holds the sandbox lock, so no action runs
        meanwhile, and it refuses when an action began since `boundary` or a recovery intervened.
        """
        with self._ck_lock:
            with self._lock:
                b = self.latest if boundary is None else boundary
                epoch, sandbox = self.epoch, self.sandbox
            with sandbox.lock:
                with self._lock:
                    if self._has_in_flight or b != self.latest or epoch != self.epoch or sandbox is not self.sandbox:
                        self._emit("checkpoint_superseded", "the trajectory moved on before the checkpoint began",
                                   boundary=b, latest=self.latest)
                        return None
                same = self._unchanged_since_clean(sandbox)
                if same is not None:
                    with self._lock:
                        self.boundaries[b].checkpoint_id = same.id
                        self.skipped_checkpoints += 1
                    self._emit("checkpoint_skipped", f"no side effect since checkpoint {same.id} (boundary "
                               f"{same.boundary}): boundary {b} restores from it", boundary=b,
                               checkpoint=same.id, checkpoint_boundary=same.boundary)
                    return same
                with self._lock:
                    context = [_record_json(r) for r in self.boundaries[: b + 1]]
                ck = full_checkpoint(sandbox, b, self.store, self.trajectory_id, self.checkpoint_mode,
                                     self.checkpoint_timeout_s, on_event=self.on_event, context=context,
                                     gen=self.gen)
                self._note_clean(ck, sandbox)
            with self._lock:
                if epoch != self.epoch or b > self.latest:
                    self.store.discard(ck)
                    return None
                self.boundaries[b].checkpoint_id = ck.id
                self.checkpoints[ck.id] = ck
                # gc may have removed older ones: forget them
                for old_id in [i for i, c in self.checkpoints.items() if not c.path.exists()]:
                    del self.checkpoints[old_id]
                    for r in self.boundaries:
                        if r.checkpoint_id == old_id:
                            r.checkpoint_id = None
            return ck

    def _note_clean(self, ck: Checkpoint, sandbox: Sandbox) -> None:
        """Remembers the fingerprint of `sandbox`, which is in `ck`'s state right now (held lock)."""
        if self.skip_unchanged:
            from belayer_plugin.sandbox.side_effects import state_fingerprint

            fp = state_fingerprint(sandbox, with_processes=ck.mode == "full")
            self._clean = (ck.id, fp) if fp is not None else None

    def _unchanged_since_clean(self, sandbox: Sandbox) -> Optional[Checkpoint]:
        """The checkpoint whose state `sandbox` still is (nothing changed since), else None."""
        if not self.skip_unchanged or self._clean is None:
            return None
        ck = self.checkpoints.get(self._clean[0])
        if ck is None or not ck.path.exists():
            return None
        from belayer_plugin.sandbox.side_effects import state_fingerprint

        fp = state_fingerprint(sandbox, with_processes=ck.mode == "full")
        return ck if fp is not None and fp == self._clean[1] else None

    def ready_checkpoint(self, at_or_before: Optional[int] = None) -> Optional[Checkpoint]:
        """The newest published checkpoint of this trajectory at or before a boundary."""
        with self._lock:
            limit = self.latest if at_or_before is None else at_or_before
            for r in reversed(self.boundaries[: limit + 1]):
                if r.checkpoint_id and r.checkpoint_id in self.checkpoints:
                    return self.checkpoints[r.checkpoint_id]
        return None

    # -- recovery -------------------------------------------------------------------------------------
    def recover(self, reason: str = "environment failure", lock_timeout_s: Optional[float] = None) -> Rollback:
        """Restores the newest usable checkpoint at or before the failed boundary and rolls the context back.

        Corrupt checkpoints are discarded and older ones tried; restore failures are retried
        `restore_retries` times per checkpoint; with none left the sandbox is rebuilt from the base image
        (boundary 0, `setup` re-run). The in-flight action, if any, is dropped, never replayed.
        """
        t0 = time.monotonic()
        wait = lock_timeout_s if lock_timeout_s is not None else self.checkpoint_timeout_s + 30.0
        if not self._ck_lock.acquire(timeout=wait):
            raise SandboxError(f"a checkpoint still runs after {wait}s; cannot recover")
        try:
            with self._lock:
                self.epoch += 1
                failed = self.latest
                uncertain = self.in_flight if self._has_in_flight else None
                had_uncertain = self._has_in_flight
                self.in_flight, self._has_in_flight = None, False
                old = self.sandbox
            try:
                old.close()  # kill and remove the broken container and anything left in its cgroup
            except SandboxError as e:
                log.warning("closing the failed sandbox: %s", e)
            sb, target, ck_id = None, 0, None
            cands: list[tuple[int, Checkpoint]] = []  # (boundary it restores, checkpoint), newest first
            with self._lock:
                for r in reversed(self.boundaries[: failed + 1]):
                    if r.checkpoint_id and r.checkpoint_id in self.checkpoints \
                            and all(c.id != r.checkpoint_id for _, c in cands):
                        cands.append((r.index, self.checkpoints[r.checkpoint_id]))
            self._clean = None
            for at, ck in cands:
                for attempt in range(1, self.restore_retries + 1):
                    try:
                        sb = full_restore(ck, self.backend, self.store, sandbox_id=self.trajectory_id,
                                          timeout_s=self.restore_timeout_s, exec_timeout_s=old.exec_timeout_s,
                                          on_event=self.on_event)
                        break
                    except CheckpointCorrupt as e:
                        self._emit("checkpoint_corrupt", str(e), checkpoint=ck.id, boundary=ck.boundary)
                        self._forget(ck)
                        break
                    except CheckpointIncompatible as e:  # never used here; left for a host that can restore it
                        self._emit("checkpoint_incompatible", str(e), checkpoint=ck.id, boundary=ck.boundary,
                                   mismatches=e.mismatches)
                        self._forget(ck, discard=False)
                        break
                    except (RestoreError, SandboxError, OSError) as e:
                        self._emit("restore_retry", f"attempt {attempt} failed: {e}", checkpoint=ck.id,
                                   boundary=ck.boundary, attempt=attempt)
                if sb is not None:
                    # `at` > ck.boundary when the actions in between had no side effect (skipped checkpoints)
                    target, ck_id = at, ck.id
                    self._note_clean(ck, sb)
                    break
                if ck.id in self.checkpoints:  # exhausted its retries: do not try it again
                    self._forget(ck)
            if sb is None:
                sb = Sandbox.create(self.backend, self.base_spec, self.trajectory_id, old.exec_timeout_s, self.on_event)
                if self.setup is not None:
                    self.setup(sb)
                target = 0
            replayed = 0
            with self._lock:
                dropped = self.store.drop_after(self.trajectory_id, target)
                for cid in [i for i, c in self.checkpoints.items() if c.boundary > target]:
                    del self.checkpoints[cid]
                replay_actions = [r for r in self.boundaries[target + 1: failed + 1]] if self.replay else []
                del self.boundaries[target + 1:]
                self.sandbox = sb
            for r in replay_actions:
                # Only committed actions (certain effect) are replayed, in order, on the restored state.
                try:
                    res = self.replay_fn(sb, r.action)
                except SandboxDead:
                    break
                with self._lock:
                    self.boundaries.append(BoundaryRecord(r.index, r.token_ids, r.messages, r.action, res))
                replayed += 1
            self.recoveries += 1
            with self._lock:
                top = self.boundaries[-1]
                rb = Rollback(top.index, list(top.token_ids), copy.deepcopy(top.messages), sb, ck_id, failed,
                              failed - top.index, uncertain, replayed, time.monotonic() - t0)
            self._emit("rollback", reason, failed_boundary=failed, restored_boundary=target, boundary=rb.boundary,
                       checkpoint=ck_id, discarded_actions=rb.discarded_actions, uncertain_action=had_uncertain,
                       replayed_actions=replayed, dropped_checkpoints=dropped, duration_s=rb.restore_s,
                       from_base_image=ck_id is None)
            return rb
        finally:
            self._ck_lock.release()

    def _forget(self, ck: Checkpoint, discard: bool = True) -> None:
        with self._lock:
            self.checkpoints.pop(ck.id, None)
            for r in self.boundaries:
                if r.checkpoint_id == ck.id:
                    r.checkpoint_id = None
        if not discard:
            return
        try:
            self.store.discard(ck)
        except OSError:
            pass

    # -- resume elsewhere ---------------------------------------------------------------------------
    @classmethod
    def resume(cls, trajectory_id: str, backend: Backend, store: CheckpointStore, *,
               exec_timeout_s: float = 60.0, on_event: Optional[EventSink] = None,
               reason: str = "resumed from the checkpoint store",
               **options: Any) -> tuple["TrajectoryRecorder", Rollback]:
        """A trajectory whose sandbox and recorder were lost with their node (or process), continued here from
        the store: the newest checkpoint that verifies and that this host can restore, in a fresh container,
        with the LLM context of that same boundary (its context.json). Corrupt checkpoints are discarded, those
        of an incompatible host skipped (left in the store), each restore retried `restore_retries` times; with
        none usable the sandbox is rebuilt from the base image at boundary 0 (`setup` re-run) when a verified
        checkpoint gave the prompt, else RestoreError. `options` are the recorder's keyword arguments."""
        t0 = time.monotonic()
        retries = int(options.get("restore_retries", 2))
        restore_timeout_s = float(options.get("restore_timeout_s", 60.0))
        cks = list(reversed(store.list(trajectory_id)))
        if not cks:
            raise RestoreError(f"trajectory {trajectory_id}: no checkpoint in {store.root}")
        failed = cks[0].boundary  # the newest boundary the store knows of (later actions died with the node)
        why: list[str] = []
        sb: Optional[Sandbox] = None
        used: Optional[Checkpoint] = None
        prompt: Optional[tuple[SandboxSpec, dict]] = None  # (spec, boundary 0) of a verified checkpoint

        def emit(kind: str, text: str, **figures: Any) -> None:
            rec = {"t": time.time(), "component": "sandbox", "subject": trajectory_id, "kind": kind,
                   "reason": text, **figures}
            log.info("trajectory %s %s: %s %s", trajectory_id, kind, text, figures)
            if on_event is not None:
                try:
                    on_event(rec)
                except Exception:  # a broken sink must not stop the resume
                    log.exception("on_event callback failed")

        for ck in cks:
            if not any(f["name"] == CONTEXT_FILE for f in ck.body.get("files", [])):
                why.append(f"{ck.id}: carries no LLM context")
                emit("checkpoint_without_context", "the LLM context of its boundary is unknown", checkpoint=ck.id,
                     boundary=ck.boundary)
                continue
            for attempt in range(1, retries + 1):
                try:
                    sb = full_restore(ck, backend, store, sandbox_id=trajectory_id, timeout_s=restore_timeout_s,
                                      exec_timeout_s=exec_timeout_s, on_event=on_event)
                    break
                except CheckpointCorrupt as e:
                    why.append(str(e))
                    emit("checkpoint_corrupt", str(e), checkpoint=ck.id, boundary=ck.boundary)
                    try:
                        store.discard(ck)
                    except OSError:
                        pass
                    break
                except CheckpointIncompatible as e:
                    why.append(str(e))
                    emit("checkpoint_incompatible", str(e), checkpoint=ck.id, boundary=ck.boundary,
                         mismatches=e.mismatches)
                    ctx = ck.context()  # verified before the host check: its prompt can be trusted
                    if prompt is None and ctx:
                        prompt = (ck.spec, ctx[0])
                    break
                except (RestoreError, SandboxError, OSError) as e:
                    why.append(f"{ck.id}: attempt {attempt}: {e}")
                    emit("restore_retry", f"attempt {attempt} failed: {e}", checkpoint=ck.id, boundary=ck.boundary,
                         attempt=attempt)
            if sb is not None:
                used = ck
                break
        if sb is not None and used is not None:
            records = used.context() or []
            spec = used.spec
        elif prompt is not None:
            spec, first = prompt
            sb = Sandbox.create(backend, spec, trajectory_id, exec_timeout_s, on_event)
            if options.get("setup") is not None:
                options["setup"](sb)
            records = [first]
        else:
            raise RestoreError(f"trajectory {trajectory_id}: no checkpoint in {store.root} can be restored here: "
                               + "; ".join(why))
        rec = cls(trajectory_id, sb, store, on_event=on_event, **options)
        rec.base_spec = spec
        rec.boundaries = [BoundaryRecord(int(r["index"]), list(r["token_ids"]), r["messages"], r.get("action"))
                          for r in records]
        target = rec.latest
        if used is not None:
            rec.boundaries[-1].checkpoint_id = used.id
            rec.checkpoints = {used.id: used}
            rec._note_clean(used, sb)
        # A new generation first: a node cut off (not lost) that still runs the old sandbox can no longer
        # publish past `target`; then the abandoned future is dropped.
        rec.gen = store.take_over(trajectory_id, target)
        dropped = store.drop_after(trajectory_id, target)  # the abandoned future is never restored
        rb = Rollback(target, list(rec.boundaries[-1].token_ids), copy.deepcopy(rec.boundaries[-1].messages), sb,
                      used.id if used is not None else None, failed, failed - target, None, 0,
                      time.monotonic() - t0)
        rec.recoveries = 1
        rec._emit("rollback", reason, failed_boundary=failed, restored_boundary=target, boundary=target,
                  checkpoint=rb.checkpoint_id, discarded_actions=rb.discarded_actions, uncertain_action=False,
                  replayed_actions=0, dropped_checkpoints=dropped, duration_s=rb.restore_s,
                  from_base_image=used is None, resumed_from_store=True, generation=rec.gen)
        return rec, rb

    # -- fork ---------------------------------------------------------------------------------------
    def fork(self, n: int, boundary: Optional[int] = None, workers: int = 0,
             ids: Optional[list[str]] = None) -> list["TrajectoryRecorder"]:
        """n independent branches continuing from `boundary` (default: the last committed one).

        Each branch gets its own container restored from the checkpoint at that boundary (taken now if the
        last boundary has none), a copy of the context up to it (prefix consistency per branch) and the
        checkpoint adopted under its own id (`ids`, default `<id>.<i>`) so it can roll back to the fork
        point on its own.
        Raises RuntimeError while an action is in flight (its effect is uncertain: nothing to fork from).
        """
        from belayer_plugin.sandbox.fork import adopt_checkpoint, fork_sandboxes

        with self._lock:
            if self._has_in_flight:
                raise RuntimeError("cannot fork while an action is in flight")
            b = self.latest if boundary is None else boundary
            if not 0 <= b <= self.latest:
                raise ValueError(f"boundary {b} not committed (latest {self.latest})")
            ck = self.checkpoints.get(self.boundaries[b].checkpoint_id or "")  # taken at b, or b's state
        if ck is None:
            if b != self.latest:
                raise RuntimeError(f"no checkpoint at boundary {b} to fork from")
            ck = self.checkpoint(b)
            if ck is None:
                raise RuntimeError(f"could not checkpoint boundary {b} to fork from (the trajectory moved on)")
        ids = list(ids) if ids is not None else [f"{self.trajectory_id}.{i}" for i in range(n)]
        sandboxes = fork_sandboxes(ck, self.backend, n, store=self.store, sandbox_ids=ids,
                                   timeout_s=self.restore_timeout_s, exec_timeout_s=self.sandbox.exec_timeout_s,
                                   workers=workers, on_event=self.on_event)
        branches = []
        with self._lock:
            prefix = self.boundaries[: b + 1]
        for sid, sb in zip(ids, sandboxes):
            own = adopt_checkpoint(self.store, ck, sid)
            br = TrajectoryRecorder(sid, sb, self.store, checkpoint_mode=self.checkpoint_mode,
                                    checkpoint_timeout_s=self.checkpoint_timeout_s,
                                    restore_timeout_s=self.restore_timeout_s, restore_retries=self.restore_retries,
                                    deterministic=self.deterministic, replay=self.replay, setup=self.setup,
                                    replay_fn=self.replay_fn, on_event=self.on_event,
                                    skip_unchanged=self.skip_unchanged)
            br.base_spec = self.base_spec
            br.boundaries = [BoundaryRecord(r.index, list(r.token_ids), copy.deepcopy(r.messages), r.action,
                                            r.result, own.id if r.index == b else None, r.t) for r in prefix]
            br.checkpoints = {own.id: own}
            branches.append(br)
        return branches

    def close(self) -> None:
        """Closes the current sandbox (checkpoints stay on disk)."""
        self.sandbox.close()
