"""Sandboxes on every node of a cluster (`sandbox.placement: spread`): one host actor per node runs the sandboxes
of the trajectories placed there, and a driver-side proxy continues a trajectory on another node, from the shared
checkpoint store, when its node is lost.

A trajectory's recorder (sandbox/trajectory.py: its container, boundaries and checkpoints) lives on the node of
its container, where its checkpoints are taken and restored; the driver holds a `RemoteRecorder`, the recorder
interface rollout.py uses (start, begin_action, sandbox.exec, commit, checkpoint, recover, close), each call
forwarded to the host and bounded by the call's own timeout plus `sandbox.host_timeout_s`. The events the
recorder emits there come back with each answer and reach the run's event log. A host that does not answer
(node lost, cut off) turns the call into SandboxDead, so the agent loop recovers as for any environment
failure; recovery then asks another node's host to continue the trajectory from the store
(TrajectoryRecorder.resume: the newest checkpoint that verifies, with the LLM context of the same boundary; with
none, a fresh sandbox at boundary 0 with the prompt the proxy kept).

Owns: SandboxHosts (one host actor per node, placement of new trajectories), RemoteRecorder (the proxy and its
move to another node). Must not: take, publish or restore checkpoints itself (the recorder on the host does).
A node cut off (not lost) may still run the old sandbox: the resume takes a new generation of the trajectory's
lease in the store first (sandbox/checkpoint.py), so nothing that node checkpoints later is published or used.
Not covered: its containers run until the run ends (its host is killed when the link returns; the containers
are not); the fork of a shared group prefix (refused at start-up).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from belayer_plugin.sandbox.base import SandboxDead

log = logging.getLogger("belayer.sandbox.remote")

PLACEMENTS = ("driver", "spread")


class HostLost(SandboxDead):
    """The node hosting a trajectory's sandbox did not answer (lost or cut off): an environment failure."""


@dataclass
class RemoteRollback:
    """What recovery hands back to the agent (sandbox/trajectory.Rollback's fields the agent loop reads)."""

    boundary: int
    token_ids: list[int]
    messages: list[dict]
    checkpoint_id: Optional[str]
    failed_boundary: int
    discarded_actions: int
    restore_s: float
    node: str
    container: str


@dataclass
class CheckpointTaken:
    """A checkpoint the host published (what the checkpoint policy reads of it)."""

    id: str
    boundary: int


class SandboxHostActor:
    """On one node: the sandbox backend, the environment's image, and the recorders of the trajectories there.
    Every trajectory method returns (result, events emitted meanwhile, the trajectory's container id now: a
    CRIU checkpoint may leave the sandbox running in a new container)."""

    def __init__(self, sb_cfg: Any, store_root: str):
        import ray

        from belayer_plugin.sandbox.checkpoint import CheckpointStore
        from belayer_plugin.sandbox.factory import make_backend

        self.cfg = sb_cfg
        self.backend = make_backend(sb_cfg)
        self.store = CheckpointStore(Path(store_root), keep=sb_cfg.keep_checkpoints)
        self.node = ray.util.get_node_ip_address()
        self.recs: dict[str, Any] = {}
        self._events: dict[str, list[dict]] = {}
        self._lock = threading.Lock()

    def _sink(self, tid: str) -> Callable[[dict], None]:
        def on_event(rec: dict) -> None:
            with self._lock:
                self._events.setdefault(tid, []).append({**rec, "node": self.node})
        return on_event

    def _out(self, tid: str, result: Any) -> tuple[Any, list[dict], str]:
        rec = self.recs.get(tid)
        with self._lock:
            return result, self._events.pop(tid, []), rec.sandbox.container_id if rec is not None else ""

    def _opts(self) -> dict:
        c = self.cfg
        return dict(checkpoint_mode=c.checkpoint_mode, checkpoint_timeout_s=c.checkpoint_timeout_s,
                    restore_timeout_s=c.restore_timeout_s, restore_retries=c.restore_retries,
                    skip_unchanged=c.policy.skip_unchanged)

    def prepare(self) -> dict:
        """The environment's image here (built or imported once per node); this node's address."""
        from belayer_plugin.envs.build import ensure_image

        return {"node": self.node, "image": ensure_image(self.backend, self.cfg.env, self.cfg.env_cache_dir or None)}

    def open(self, tid: str, spec: Any) -> tuple:
        from belayer_plugin.sandbox.base import Sandbox
        from belayer_plugin.sandbox.trajectory import TrajectoryRecorder

        sb = Sandbox.create(self.backend, spec, tid, self.cfg.exec_timeout_s, self._sink(tid))
        self.recs[tid] = TrajectoryRecorder(tid, sb, self.store, on_event=self._sink(tid), **self._opts())
        return self._out(tid, sb.container_id)

    def call(self, tid: str, method: str, *args: Any) -> tuple:
        """A recorder method (start, begin_action, commit) by name."""
        if method not in ("start", "begin_action", "commit"):
            raise ValueError(f"not a recorder call: {method}")
        out = getattr(self.recs[tid], method)(*args)
        return self._out(tid, out if method == "commit" else None)

    def exec(self, tid: str, command: Any, timeout: float) -> tuple:
        return self._out(tid, self.recs[tid].sandbox.exec(command, timeout))

    def checkpoint(self, tid: str, boundary: int) -> tuple:
        ck = self.recs[tid].checkpoint(boundary)
        return self._out(tid, None if ck is None else CheckpointTaken(ck.id, ck.boundary))

    def recover(self, tid: str, reason: str) -> tuple:
        rb = self.recs[tid].recover(reason)
        return self._out(tid, self._rollback(rb))

    def resume(self, tid: str, reason: str, first: tuple[list[int], list], spec: Any) -> tuple:
        """The trajectory continued here from the store (its node was lost); with no checkpoint stored, a fresh
        sandbox of `spec` at boundary 0 with `first` (the prompt's tokens and messages)."""
        from belayer_plugin.sandbox.base import Sandbox
        from belayer_plugin.sandbox.trajectory import TrajectoryRecorder

        t0 = time.monotonic()
        if self.store.list(tid):
            rec, rb = TrajectoryRecorder.resume(tid, self.backend, self.store, exec_timeout_s=self.cfg.exec_timeout_s,
                                                on_event=self._sink(tid), reason=reason, **self._opts())
            self.recs[tid] = rec
            return self._out(tid, self._rollback(rb))
        sb = Sandbox.create(self.backend, spec, tid, self.cfg.exec_timeout_s, self._sink(tid))
        rec = self.recs[tid] = TrajectoryRecorder(tid, sb, self.store, on_event=self._sink(tid), **self._opts())
        rec.gen = self.store.take_over(tid, 0)  # the lost node's sandbox, if it lives on, publishes nothing more
        rec.start(list(first[0]), list(first[1]), checkpoint=False)
        self._sink(tid)({"t": time.time(), "subject": tid, "kind": "rollback", "reason": reason,
                         "restored_boundary": 0, "boundary": 0, "checkpoint": None, "from_base_image": True,
                         "resumed_from_store": False, "duration_s": time.monotonic() - t0})
        return self._out(tid, RemoteRollback(0, list(first[0]), list(first[1]), None, -1, -1,
                                             time.monotonic() - t0, self.node, sb.container_id))

    def _rollback(self, rb: Any) -> RemoteRollback:
        return RemoteRollback(rb.boundary, list(rb.token_ids), rb.messages, rb.checkpoint_id, rb.failed_boundary,
                              rb.discarded_actions, rb.restore_s, self.node, rb.sandbox.container_id)

    def is_running(self, cid: str) -> bool:
        return self.backend.is_running(cid)

    def kill(self, cid: str) -> None:
        self.backend.kill(cid)

    def close(self, tid: str) -> tuple:
        rec = self.recs.pop(tid, None)
        if rec is not None:
            rec.close()
        return self._out(tid, None)

    def close_all(self) -> int:
        recs, self.recs = list(self.recs.values()), {}
        for rec in recs:
            try:
                rec.close()
            except Exception:  # one stuck container must not keep the others
                log.exception("closing a sandbox at shutdown")
        return len(recs)


@dataclass
class _Host:
    node_id: str
    node: str  # address
    actor: Any
    open: int = 0
    lost: bool = False


class SandboxHosts:
    """One host actor per node; new trajectories go to the live node with the fewest open ones."""

    def __init__(self, sb_cfg: Any, store_root: Path, on_event: Callable[[dict], None]):
        self.cfg = sb_cfg
        self.store_root = str(store_root)
        self.on_event = on_event
        self.hosts: list[_Host] = []
        self._lock = threading.Lock()

    def start(self, nodes: dict[str, str]) -> dict[str, str]:
        """Starts a host on each of `nodes` ({node id: address}) and prepares the image there; {address: image}."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        cls = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=64)(SandboxHostActor)
        for nid, addr in sorted(nodes.items(), key=lambda kv: (kv[1], kv[0])):
            actor = cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False)).remote(
                self.cfg, self.store_root)
            self.hosts.append(_Host(nid, addr, actor))
        # The first image build can take minutes on a cold node: bounded by the start-up of a sandbox image.
        ready = ray.get([h.actor.prepare.remote() for h in self.hosts], timeout=max(600.0, self.cfg.exec_timeout_s))
        return {r["node"]: r["image"] for r in ready}

    def pick(self, exclude: Optional[_Host] = None) -> _Host:
        with self._lock:
            live = [h for h in self.hosts if not h.lost and h is not exclude]
            if not live:
                raise HostLost("no live node is left to host a sandbox")
            h = min(live, key=lambda h: (h.open, h.node))
            h.open += 1
            return h

    def release(self, h: _Host) -> None:
        with self._lock:
            h.open = max(0, h.open - 1)

    def mark_lost(self, h: _Host) -> None:
        """The node did not answer: no new trajectory goes there; its actor is killed (a cut-off node's, when
        the link returns)."""
        import ray

        with self._lock:
            if h.lost:
                return
            h.lost = True
        self.on_event({"subject": h.node, "kind": "sandbox_host_lost", "reason": "a call to the node's sandbox host "
                       "got no answer: its trajectories continue elsewhere", "node": h.node})
        try:
            ray.kill(h.actor, no_restart=True)
        except Exception:  # already gone
            pass

    def recorder(self, tid: str, spec: Any, on_event: Callable[[dict], None]) -> "RemoteRecorder":
        """A new trajectory's sandbox on the least loaded live node."""
        return RemoteRecorder(tid, self, spec, on_event)

    def shutdown(self, timeout_s: float = 60.0) -> None:
        import ray

        refs = [h.actor.close_all.remote() for h in self.hosts if not h.lost]
        try:
            ray.get(refs, timeout=timeout_s)
        except Exception:  # a host that cannot close its sandboxes is killed all the same
            log.exception("closing sandbox hosts")
        for h in self.hosts:
            try:
                ray.kill(h.actor, no_restart=True)
            except Exception:
                pass


class _HostBackend:
    """The two backend calls the chaos injector makes on a sandbox (is_running, kill), on its host."""

    def __init__(self, rec: "RemoteRecorder"):
        self.rec = rec

    def is_running(self, cid: str) -> bool:
        import ray

        return ray.get(self.rec.host.actor.is_running.remote(cid), timeout=self.rec.cfg.host_timeout_s)

    def kill(self, cid: str) -> None:
        import ray

        ray.get(self.rec.host.actor.kill.remote(cid), timeout=self.rec.cfg.host_timeout_s)


class _RemoteSandbox:
    """`recorder.sandbox` of a remote trajectory: exec on its host, and what the chaos injector reads."""

    def __init__(self, rec: "RemoteRecorder"):
        self.rec = rec
        self.backend = _HostBackend(rec)

    @property
    def container_id(self) -> str:
        return self.rec.container_id

    @property
    def sandbox_id(self) -> str:
        return self.rec.trajectory_id

    @property
    def name(self) -> str:
        return f"{self.rec.trajectory_id}@{self.rec.host.node}"

    def exec(self, command: Any, timeout: Optional[float] = None) -> Any:
        t = self.rec.cfg.exec_timeout_s if timeout is None else timeout
        return self.rec._call("exec", command, t, timeout=t)


class RemoteRecorder:
    """The driver's handle on a trajectory whose sandbox runs on another node (the recorder interface)."""

    def __init__(self, tid: str, hosts: SandboxHosts, spec: Any, on_event: Callable[[dict], None]):
        self.trajectory_id = tid
        self.hosts = hosts
        self.cfg = hosts.cfg
        self.spec = spec
        self.on_event = on_event
        self.first: tuple[list[int], list] = ([], [])
        self.latest = 0
        self.host = hosts.pick()
        self.sandbox = _RemoteSandbox(self)
        self.container_id = ""
        self._call("open", spec, timeout=self.cfg.exec_timeout_s)
        self.on_event({"subject": tid, "kind": "placed", "reason": f"sandbox on node {self.host.node}",
                       "node": self.host.node, "container": self.container_id[:12]})

    def _call(self, method: str, *args: Any, timeout: float) -> Any:
        """A host call bounded by `timeout` + sandbox.host_timeout_s; HostLost when the host does not answer."""
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError

        h = self.host
        if h.lost:
            raise HostLost(f"node {h.node} is lost")
        try:
            out, events, cid = ray.get(getattr(h.actor, method).remote(self.trajectory_id, *args),
                                       timeout=timeout + self.cfg.host_timeout_s)
        except (ActorDiedError, ActorUnavailableError, RayActorError, GetTimeoutError) as e:
            self.hosts.mark_lost(h)
            raise HostLost(f"node {h.node} did not answer {method}: {type(e).__name__}") from None
        if cid:
            self.container_id = cid
        for rec in events:
            self.on_event(rec)
        return out

    def start(self, token_ids: list[int], messages: list, checkpoint: bool = True) -> None:
        self.first = (list(token_ids), list(messages))
        self._call("call", "start", list(token_ids), list(messages), checkpoint,
                   timeout=self.cfg.checkpoint_timeout_s)

    def begin_action(self, action: Any) -> None:
        self._call("call", "begin_action", action, timeout=0.0)

    def commit(self, token_ids: list[int], messages: list, result: Any = None) -> int:
        self.latest = self._call("call", "commit", token_ids, messages, result, timeout=0.0)
        return self.latest

    def checkpoint(self, boundary: Optional[int] = None) -> Optional[CheckpointTaken]:
        return self._call("checkpoint", boundary, timeout=self.cfg.checkpoint_timeout_s)

    def recover(self, reason: str = "environment failure") -> RemoteRollback:
        """On the trajectory's node when it answers; else on another node, from the shared checkpoint store."""
        restore_bound = self.cfg.restore_timeout_s * self.cfg.restore_retries + self.cfg.checkpoint_timeout_s
        if not self.host.lost:
            try:
                rb = self._call("recover", reason, timeout=restore_bound)
                self.container_id, self.latest = rb.container, rb.boundary
                return rb
            except HostLost:
                pass
        old = self.host
        self.host = self.hosts.pick(exclude=old)
        self.hosts.release(old)
        rb = self._call("resume", f"{reason}; node {old.node} lost", self.first, self.spec, timeout=restore_bound)
        if rb.failed_boundary < 0:  # nothing was stored: every committed action is redone
            rb.failed_boundary, rb.discarded_actions = self.latest, self.latest
        self.latest, self.container_id = rb.boundary, rb.container
        self.on_event({"subject": self.trajectory_id, "kind": "moved", "reason": f"from node {old.node} to "
                       f"{self.host.node}", "node": self.host.node, "from_node": old.node, "boundary": rb.boundary})
        return rb

    def close(self) -> None:
        try:
            if not self.host.lost:
                self._call("close", timeout=self.cfg.exec_timeout_s)
        except HostLost:
            pass
        finally:
            self.hosts.release(self.host)


def placement_problems(cfg: Any, loop_cfg: Any) -> list[str]:
    """Recipe keys that cannot work with sandboxes on every node (named at start-up)."""
    if cfg.sandbox.placement != "spread":
        return []
    out = []
    if loop_cfg.shared_prefix_turns > 0:
        out.append("loop.shared_prefix_turns: > 0 needs belayer.sandbox.placement=driver (a shared prefix reaches "
                   "the members' sandboxes by fork or replay on one node)")
    if cfg.chaos.enabled and cfg.chaos.kind in ("sandbox_kill_checkpoint", "sandbox_kill_restore"):
        out.append(f"belayer.chaos.kind: {cfg.chaos.kind} needs belayer.sandbox.placement=driver (the fault is "
                   "delivered inside the driver's container backend)")
    return out
