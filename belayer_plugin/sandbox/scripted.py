"""A scripted multi-action trajectory with fail-stop fault injection (used by the tests, the soak and the bench).

Each action i tells an in-container daemon to append `a<i>` to a string it holds ONLY in memory, appends
a line to /work/log and rewrites /work/f<i%3>. The golden final state after n actions is known, so a
trial that kills containers at random moments (during actions, checkpoints and restores), optionally
corrupts a published checkpoint, and recovers through TrajectoryRecorder must end in exactly that state:
every action's effect applied once, in order, in memory and on disk.

Owns: the scripted trajectory used by tests, soak and bench. Must not: be used by a trainer's rollouts.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from belayer_plugin.sandbox.base import (
    Backend,
    Sandbox,
    SandboxDead,
    SandboxError,
    SandboxSpec,
    cgroup_pids,
)
from belayer_plugin.sandbox.checkpoint import CheckpointStore
from belayer_plugin.sandbox.policy import CheckpointPolicy
from belayer_plugin.sandbox.trajectory import TrajectoryRecorder

log = logging.getLogger(__name__)

# The daemon keeps the fifo open read-write so no message is lost between reads, and answers `get`
# through a second fifo: callers block on events, never poll.
STATED = r'''mkfifo /tmp/ctl /tmp/reply
s=""
exec 3<>/tmp/ctl
echo ready > /tmp/ready
while :; do
  if read -r cmd arg <&3; then
    case "$cmd" in
      add) s="$s $arg" ;;
      get) echo "mem:$s" > /tmp/reply ;;
    esac
  fi
done
'''


def setup_stated(sb: Sandbox) -> None:
    """Installs and starts the in-memory state daemon; returns once it is listening."""
    sb.write_file("/opt/stated.sh", STATED, 0o755)
    r = sb.exec("mkfifo /tmp/ready && (sh /opt/stated.sh </dev/null >/dev/null 2>&1 &) && cat /tmp/ready", timeout=20)
    if r.exit_code != 0 or r.stdout.strip() != "ready":
        raise SandboxError(f"state daemon did not start: {r}")


def action(i: int) -> dict:
    """The i-th scripted action (1-based): three effects 0.1 s apart, as a tool call takes time to run (an
    exec-phase kill then lands while the command runs, possibly between its effects)."""
    return {"command": f"echo add a{i} > /tmp/ctl && sleep 0.1 && echo a{i} >> /work/log && sleep 0.1 && "
                       f"echo v{i} > /work/f{i % 3}", "timeout": 20}


def tokens(b: int) -> list[int]:
    """The LLM context (token ids) after b actions."""
    return list(range(7 * b + 3))


def messages(b: int) -> list[dict]:
    return [{"role": "user", "content": "task"}] + [{"role": "assistant", "content": f"action {i}"} for i in range(1, b + 1)]


QUERY = "echo get > /tmp/ctl && cat /tmp/reply && echo '--log' && cat /work/log 2>/dev/null; " \
        "for f in 0 1 2; do echo \"--f$f $(cat /work/f$f 2>/dev/null)\"; done"


def query_state(sb: Sandbox, attempts: int = 3) -> str:
    """The sandbox's state as QUERY prints it; raises SandboxDead when the query fails."""
    for _ in range(attempts):
        r = sb.exec(QUERY, timeout=20)
        if r.exit_code != 0:
            raise SandboxDead(f"state query failed: {r}")
        if "--log" in r.stdout:
            return r.stdout
        # Exit 0 without the query's fixed marker: the runtime lost the exec's output stream (seen once with
        # Docker on a loaded 2-core CI run, seed 1011: empty stdout). The query changes no state: ask again.
    return r.stdout


def golden_state(n: int) -> str:
    mem = "mem:" + "".join(f" a{i}" for i in range(1, n + 1))
    log_lines = "".join(f"a{i}\n" for i in range(1, n + 1))
    fs = []
    for f in range(3):
        last = max([i for i in range(1, n + 1) if i % 3 == f], default=None)
        fs.append(f"--f{f} {'v' + str(last) if last else ''}\n")
    return f"{mem}\n--log\n{log_lines}" + "".join(fs)


def resume_scripted(trajectory_id: str, backend: Any, store: CheckpointStore, n_actions: int,
                    exec_timeout_s: float = 20.0) -> dict:
    """A scripted trajectory whose sandbox and recorder were lost (with their node or process), resumed here from
    `store` and run to `n_actions`: the boundary restored, its context, the state there, the final state, and
    the restore events (`TrajectoryRecorder.resume`)."""
    events: list[dict] = []
    rec, rb = TrajectoryRecorder.resume(trajectory_id, backend, store, exec_timeout_s=exec_timeout_s,
                                        on_event=events.append, setup=setup_stated, checkpoint_mode="full")
    try:
        out = {"boundary": rb.boundary, "token_ids": rb.token_ids, "checkpoint": rb.checkpoint_id,
               "failed_boundary": rb.failed_boundary, "context": [r.token_ids for r in rec.boundaries],
               "state_restored": query_state(rb.sandbox)}
        for i in range(rb.boundary + 1, n_actions + 1):
            rec.begin_action(action(i))
            if rec.sandbox.exec(action(i)["command"]).exit_code != 0:
                raise SandboxError(f"action {i} failed after the resume")
            rec.commit(tokens(i), messages(i))
        out["state_final"] = query_state(rec.sandbox)
        restores = [e for e in events if e["kind"] == "restore"]
        out["restored_events"] = len(restores)
        out["runtime_restored_id"] = restores[0].get("runtime_restored_id") if restores else None
        return out
    finally:
        rec.close()


@dataclass
class Fault:
    phase: str  # "exec" | "checkpoint" | "restore"
    nth: int  # fire on the nth call of that phase (1-based) after arming
    delay_s: float  # kill the container this long after the call began


class FaultyBackend:
    """Delegates to a real backend and SIGKILLs the real container at planned moments."""

    def __init__(self, inner: Backend, faults: list[Fault]):
        self.inner = inner
        self.name = inner.name
        self.faults = list(faults)
        self.counts: dict[str, int] = {}
        self.armed = False
        self.fired: list[Fault] = []  # kills delivered to a running container
        self.missed: list[Fault] = []  # due, but nothing was running to kill (e.g. the call had finished)
        self.seen: set[str] = set()  # every container name/id touched: checked for leftovers at the end
        self._timers: list[threading.Timer] = []
        self._lock = threading.Lock()
        self._active: dict[str, int] = {}  # phase -> calls in progress

    def __getattr__(self, item: str) -> Any:
        return getattr(self.inner, item)

    def arm(self) -> None:
        self.armed = True

    def disarm(self) -> None:
        self.armed = False
        for t in self._timers:
            t.cancel()
        for t in self._timers:
            t.join(timeout=30)

    def _hit(self, phase: str, victims: list[str]) -> None:
        self.seen.update(v for v in victims if v)
        if not self.armed:
            return
        with self._lock:
            self.counts[phase] = self.counts.get(phase, 0) + 1
            due = [f for f in self.faults if f.phase == phase and f.nth == self.counts[phase]]
        for f in due:
            def fire(f: Fault = f) -> None:
                if not self.armed:
                    return
                # Delivery, not intent: only a kill of a container verified running counts as fired.
                hit = self._kill_alive(f, victims)
                # Mid-checkpoint, podman passes through states with nothing to kill (the original dumped and
                # exited, the continuation not yet up): keep trying while that call runs (bounded).
                deadline = time.monotonic() + 1.0
                while not hit and f.phase == "checkpoint" and self._active.get("checkpoint") \
                        and time.monotonic() < deadline and self.armed:
                    time.sleep(0.02)
                    hit = self._kill_alive(f, victims)
                (self.fired if hit else self.missed).append(f)
            t = threading.Timer(f.delay_s, fire)
            t.daemon = True
            self._timers.append(t)
            t.start()

    def _kill_alive(self, f: Fault, victims: list[str]) -> bool:
        """Kills whichever victim is alive now; True when a kill reached a live container."""
        hit = False
        for v in victims:
            if not v:
                continue
            if self.inner.is_running(v):
                self.inner.kill(v)
                hit = True
            elif f.phase == "checkpoint":
                # Mid-dump the runtime refuses `kill` (the container is not "running"), yet its processes
                # live: SIGKILL them directly, as a node fault would.
                full = v if len(v) >= 32 else (self.inner.container_id(v) or "")
                for pid in cgroup_pids(full) if full else []:
                    try:
                        os.kill(pid, signal.SIGKILL)
                        hit = True
                    except ProcessLookupError:
                        pass
        return hit

    def run(self, spec: SandboxSpec, name: str) -> str:
        cid = self.inner.run(spec, name)
        self.seen.update([name, cid])
        return cid

    def create(self, spec: SandboxSpec, name: str) -> str:
        cid = self.inner.create(spec, name)
        self.seen.update([name, cid])
        return cid

    def exec(self, cid: str, argv: list[str], *a: Any, **kw: Any):
        self._hit("exec", [cid])
        return self.inner.exec(cid, argv, *a, **kw)

    def criu_checkpoint(self, cid: str, spec: SandboxSpec, staging: Path, timeout_s: float, new_name: str):
        self._hit("checkpoint", [cid, new_name])
        with self._lock:
            self._active["checkpoint"] = self._active.get("checkpoint", 0) + 1
        try:
            out = self.inner.criu_checkpoint(cid, spec, staging, timeout_s, new_name)
        finally:
            with self._lock:
                self._active["checkpoint"] -= 1
        if out[1]:
            self.seen.add(out[1])
        return out

    def criu_restore(self, ckdir: Path, spec: SandboxSpec, name: str, timeout_s: float) -> str:
        self._hit("restore", [name])
        cid = self.inner.criu_restore(ckdir, spec, name, timeout_s)
        self.seen.add(cid)
        return cid


@dataclass
class TrialResult:
    seed: int
    violations: list[str]
    recoveries: int
    faults_planned: int
    faults_fired: int
    corrupted: Optional[str]
    duration_s: float
    events: list[dict] = field(default_factory=list)
    fired_phases: list[str] = field(default_factory=list)  # phases in which a kill actually fired
    missed: int = 0  # planned kills that came due with nothing running to kill

    @property
    def delivered(self) -> bool:
        """Whether a kill reached a running container: a trial without one tested no recovery."""
        return self.faults_fired > 0

    @property
    def recovered_by(self) -> dict[str, int]:
        """How many recoveries came from which kind of checkpoint (see recovery_kinds)."""
        return dict(recovery_kinds(self.events))

    @property
    def criu_restorable(self) -> int:
        """Recoveries that began with a CRIU (full) checkpoint published in this trial: a CRIU restore was
        possible for them."""
        return recoveries_after_full_checkpoint(self.events)


RECOVERY_KINDS = ("criu_full", "fs_only", "rebuild_replay")


def recovery_kinds(events: list[dict]) -> Counter:
    """Each rollback's source, from the events in order: a CRIU restore the runtime reported
    (`runtime_restored_id`), a file-system-only restore, or a rebuild from the base image (then replay)."""
    out: Counter = Counter()
    restored: dict[str, dict] = {}
    for e in events:
        if e.get("kind") == "restore":
            restored[e.get("checkpoint")] = e
        elif e.get("kind") == "rollback":
            r = restored.get(e.get("checkpoint")) if not e.get("from_base_image") else None
            if r is None:
                out["rebuild_replay"] += 1
            elif r.get("mode") == "full" and r.get("runtime_restored_id"):
                out["criu_full"] += 1
            else:
                out["fs_only"] += 1
    return out


def recoveries_after_full_checkpoint(events: list[dict]) -> int:
    """Rollbacks that came after a CRIU checkpoint of the trial was published."""
    seen_full, n = False, 0
    for e in events:
        if e.get("kind") == "checkpoint" and e.get("mode") == "full":
            seen_full = True
        elif e.get("kind") == "rollback" and seen_full:
            n += 1
    return n


def context_violations(boundaries: list[Any], n_actions: int) -> list[str]:
    """The LLM context the recorder holds at the end of a trial against the sandbox's committed actions:
    boundaries 0..n_actions in order, each with the context of exactly its actions (prefix-consistent)."""
    idx = [b.index for b in boundaries]
    if idx != list(range(n_actions + 1)):
        return [f"context boundaries at the end are {idx}, not 0..{n_actions}"]
    bad = [b.index for b in boundaries if b.token_ids != tokens(b.index) or b.messages != messages(b.index)]
    return [f"context at the end differs from the committed actions at boundaries {bad}"] if bad else []


def campaign_violations(results: list["TrialResult"], criu_available: bool, mode: str,
                        wanted: Optional[int] = None) -> list[str]:
    """What fails a campaign beyond its trials' own violations: fewer trials with a kill delivered than
    `wanted` (or, without a target, more undelivered than delivered), and, with CRIU available and full
    checkpoints asked for, no CRIU restore among the recoveries that could have used one (a rebuild from the
    image with replay converges to the same state, so state alone cannot tell)."""
    out = []
    delivered = [r for r in results if r.delivered]
    undelivered = len(results) - len(delivered)
    if wanted is not None and len(delivered) < wanted:
        out.append(f"only {len(delivered)} of {wanted} trials had a kill delivered ({undelivered} undelivered)")
    elif wanted is None and undelivered > len(delivered):
        out.append(f"{undelivered} trials had no kill delivered, {len(delivered)} had one")
    if criu_available and mode in ("full", "auto"):
        restorable = sum(r.criu_restorable for r in delivered)
        criu = sum(r.recovered_by.get("criu_full", 0) for r in delivered)
        if restorable and not criu:
            out.append(f"no recovery came from a CRIU restore ({restorable} came after a CRIU checkpoint; "
                       f"by kind: {dict(sum((Counter(r.recovered_by) for r in delivered), Counter()))})")
    return out


def plan_faults(rng: random.Random, n_actions: int, ck_s: float = 0.5) -> list[Fault]:
    """1-2 kills: during an action or a checkpoint, sometimes followed by one during the restore."""
    faults = [Fault(rng.choice(["exec", "exec", "checkpoint"]), rng.randint(1, n_actions), rng.uniform(0.0, 0.15))]
    if faults[0].phase == "checkpoint":
        faults[0].delay_s = rng.uniform(0.0, ck_s)
    if rng.random() < 0.3:
        faults.append(Fault(rng.choice(["exec", "checkpoint"]), rng.randint(1, n_actions + 2), rng.uniform(0.0, ck_s)))
    if rng.random() < 0.4:
        faults.append(Fault("restore", rng.randint(1, 2), rng.uniform(0.0, 0.4)))
    return faults


def _corrupt(path: Path, rng: random.Random) -> str:
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name != "MANIFEST.json" and p.stat().st_size > 0)
    victim = rng.choice(files)
    size = victim.stat().st_size
    if rng.random() < 0.3:  # truncated, as by a crash mid-write
        os.truncate(victim, rng.randrange(size))
        return f"{victim.relative_to(path)} (truncated)"
    with open(victim, "r+b") as f:
        off = rng.randrange(size)
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))
    return str(victim.relative_to(path))


def corruption_violations(events: list[dict], corrupted: str) -> list[str]:
    """What went wrong with the checkpoint the trial corrupted, judged from the events in order: a restore of
    it after the corruption, or a recovery that went past it without noticing. A restore of it before the
    corruption (it was sound then) is no violation: the full-size soak's first run counted two of those."""
    at = next(i for i, e in enumerate(events) if e.get("kind") == "test_corrupted" and e.get("checkpoint") == corrupted)
    after = events[at + 1:]
    out = []
    if any(e.get("kind") == "restore" and e.get("checkpoint") == corrupted for e in after):
        out.append(f"corrupt checkpoint {corrupted} was restored")
    if not any(e.get("kind") == "checkpoint_corrupt" for e in after):
        # Legit only if the corrupt one was superseded by a newer checkpoint before any recovery.
        rollbacks = [e for e in after if e.get("kind") == "rollback"]
        if rollbacks and rollbacks[0].get("restored_boundary", -1) < int(corrupted[1:7]):
            out.append(f"corrupt checkpoint {corrupted} was not detected")
    return out


def run_trial(backend: Backend, image: str, seed: int, store_root: str | Path, n_actions: int = 5,
              mode: str = "full", corrupt_prob: float = 0.2, max_steps: int = 60) -> TrialResult:
    """One randomized fail-stop trial; returns its violations (empty: converged to the golden state)."""
    rng = random.Random(seed)
    t0 = time.monotonic()
    fb = FaultyBackend(backend, plan_faults(rng, n_actions, 0.7 if backend.name == "podman" else 0.35))
    events: list[dict] = []
    violations: list[str] = []
    tid = f"trial-{seed}-{os.getpid()}"
    corrupt_after = rng.randint(1, n_actions) if rng.random() < corrupt_prob else None
    corrupted: Optional[str] = None
    sb = Sandbox.create(fb, SandboxSpec(image=image, memory_mb=128, pids_limit=64), tid, 20.0, events.append)
    rec: Optional[TrajectoryRecorder] = None
    policy: Optional[CheckpointPolicy] = None
    try:
        setup_stated(sb)
        store = CheckpointStore(Path(store_root) / "ck", keep=2)
        rec = TrajectoryRecorder(tid, sb, store, checkpoint_mode=mode, checkpoint_timeout_s=20,
                                 restore_timeout_s=30, restore_retries=2, setup=setup_stated, on_event=events.append)
        # half the trials have no checkpoint at boundary 0: recovery before the first one rebuilds from the image
        rec.start(tokens(0), messages(0), checkpoint=rng.random() < 0.5)
        policy = CheckpointPolicy(rec.checkpoint, failure_prob=1.0, min_overhead_s=0.0,
                                  every_n_actions=rng.choice([1, 1, 2]), async_checkpoint=rng.random() < 0.7,
                                  cooldown_s=0.0, enabled=False, subject=tid, on_event=events.append)
        fb.arm()
        steps = 0
        final = None
        while True:
            steps += 1
            if steps > max_steps:
                violations.append(f"no convergence after {max_steps} steps")
                break
            try:
                if rec.latest >= n_actions:
                    fb.disarm()
                    policy.wait_ready(timeout=60)
                    final = query_state(rec.sandbox)
                    break
                b = rec.latest + 1
                policy.wait_ready(timeout=60)
                if corrupt_after is not None and corrupted is None and b - 1 >= corrupt_after:
                    ck = rec.ready_checkpoint()
                    if ck is not None:
                        corrupted = ck.id
                        events.append({"kind": "test_corrupted", "checkpoint": ck.id, "file": _corrupt(ck.path, rng)})
                        rec.sandbox.kill()  # make the next action fail so the corrupt checkpoint is met
                a = action(b)
                rec.begin_action(a)
                res = rec.sandbox.exec(a["command"], timeout=a["timeout"])
                if res.exit_code != 0:
                    raise SandboxDead(f"action {b} failed: exit {res.exit_code} {res.stderr.strip()[:100]}")
                rec.commit(tokens(b), messages(b), res.exit_code)
                policy.note_work(0.1, "generation", action_done=True)
                policy.maybe_checkpoint_async(rec.latest)
            except SandboxError as e:
                policy.wait_ready(timeout=60)
                rb = rec.recover(f"{type(e).__name__}: {e}")
                policy.reset()
                if rb.token_ids != tokens(rb.boundary) or rb.messages != messages(rb.boundary):
                    violations.append(f"context after rollback to {rb.boundary} does not match that boundary")
                if rb.boundary > rb.failed_boundary:
                    violations.append(f"rolled forward: {rb.boundary} > failed {rb.failed_boundary}")
        if final is not None and final != golden_state(n_actions):
            violations.append(f"final state differs from golden:\n{final!r}\n!=\n{golden_state(n_actions)!r}")
        if final is not None:  # the LLM context at the end, not only at each rollback
            violations.extend(context_violations(rec.boundaries, n_actions))
        tdir = Path(store_root) / "ck" / tid
        if tdir.is_dir():
            partial = [p.name for p in tdir.iterdir() if p.name.startswith(".staging-")]
            if partial:
                violations.append(f"partial checkpoints left behind: {partial}")
        if corrupted:
            violations.extend(corruption_violations(events, corrupted))
    finally:
        fb.disarm()
        if policy is not None:
            policy.close()
        try:
            (rec.sandbox if rec else sb).close()
        except SandboxError:
            pass
        for ref in list(fb.seen):
            fb.inner.remove(ref)
        for ref in fb.seen:
            if len(ref) >= 32 and cgroup_pids(ref):
                violations.append(f"processes of container {ref[:12]} still running after the trial")
    n_rb = sum(1 for e in events if e.get("kind") == "rollback")
    return TrialResult(seed, violations, n_rb, len(fb.faults), len(fb.fired), corrupted, time.monotonic() - t0, events,
                       [f.phase for f in fb.fired], len(fb.missed))
