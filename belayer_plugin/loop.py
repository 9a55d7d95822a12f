"""The reference agentic RL loop, driving the lifecycle a trainer drives, on Ray:

    generation (multi-turn rollouts in sandboxes) -> pause + release engine memory -> a GRPO step on the
    learner -> refit every engine to the new weight version -> resume

with Belayer's recovery in every phase when `belayer.use_fault_tolerance` is true, and chaos injected when
`belayer.chaos.enabled` is true. The report says what happened; nothing is claimed that it does not show.

Owns: the order of the lifecycle calls per step and the run's report. Must not: hold fault-tolerance logic
itself (the fleet, the generator and the sandboxes do).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import MISSING, DictConfig

from belayer_plugin.config import BelayerConfig, ConfigError, validate_section
from belayer_plugin.events import EventLog
from belayer_plugin.fleet.launch import make_run_dir
from belayer_plugin.metrics import StepMetrics


@dataclass
class LoopConfig:
    """The reference trainer's own knobs (the `loop:` section of a recipe); values come from the recipe."""

    num_steps: int = field(default=MISSING)
    prompts_per_step: int = field(default=MISSING)
    group_size: int = field(default=MISSING)
    turns: int = field(default=MISSING)
    tokens_per_turn: int = field(default=MISSING)
    temperature: float = field(default=MISSING)
    lr: float = field(default=MISSING)
    seed: int = field(default=MISSING)
    learner_restarts: int = field(default=MISSING)
    step_timeout_s: float = field(default=MISSING)
    shared_prefix_turns: int = field(default=MISSING)  # turns a GRPO group shares before its members diverge
    fork_groups: bool = field(default=MISSING)  # members get the prefix's environment by fork (else by replay)
    # After the last step, recoveries still under way (an engine killed in the last refit, a restart backing
    # off) finish before the fleet is shut down, waited for up to this long; the report's `fleet_at_end` says
    # whether the run ended at full strength (fault tolerance on only).
    end_recovery_timeout_s: float = field(default=MISSING)
    # On a cluster of several nodes (belayer.ray.address): engine i's first incarnation goes to node i mod the
    # number of nodes that can host one (Ray's default fills the driver's node first). Replacements and
    # standbys are Belayer's to place (node exclusion, shadow.placement).
    spread_engines: bool = field(default=MISSING)

    def problems(self) -> list[str]:
        out = []
        if not 0 <= self.shared_prefix_turns < self.turns:
            out.append("shared_prefix_turns: must be >= 0 and < turns")
        for name in ("num_steps", "prompts_per_step", "group_size", "turns", "tokens_per_turn"):
            if getattr(self, name) < 1:
                out.append(f"{name}: must be >= 1")
        if self.temperature < 0 or self.lr <= 0 or self.step_timeout_s <= 0:
            out.append("temperature >= 0, lr > 0 and step_timeout_s > 0 are required")
        if self.end_recovery_timeout_s < 0:
            out.append("end_recovery_timeout_s: must be >= 0")
        return out


def host_cpu_s() -> Optional[float]:
    """Busy CPU seconds of the whole host since boot, all cores (Linux /proc/stat; None elsewhere). A step's
    difference counts what every process spent on it (engines, router, sandboxes, CRIU, this driver), which
    wall time on shared cores hides in contention."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = v
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _loop_config(recipe: DictConfig) -> LoopConfig:
    return validate_section(LoopConfig, recipe.get("loop"), "loop")


def chaos_problems(cfg: BelayerConfig, lc: Optional[LoopConfig]) -> list[str]:
    """The chaos keys that cannot work with this loop (a trigger position it never reaches...), each with its
    valid range; [] when chaos is off. Checked at start-up and by `belayer config check` (`lc` None: the loop
    section is invalid, the position is not checked)."""
    if not cfg.chaos.enabled:
        return []
    from belayer_plugin.chaos.positions import problems

    return problems(cfg, lc)


def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _refuse_used_run_dir(run_dir: Path) -> None:
    """Raises ConfigError when `run_dir` holds an earlier run: its learner checkpoints would be taken for this
    run's (the loop starts at step 1, the learner would resume at the old run's last step)."""
    ckpts = run_dir / "learner-ckpt"
    used = [p.name for p in (run_dir / "report.json", run_dir / "events.jsonl") if p.exists()]
    if ckpts.is_dir() and any(ckpts.iterdir()):
        used.append("learner-ckpt/")
    if used:
        raise ConfigError([f"belayer.run_dir: {run_dir} holds an earlier run ({', '.join(used)}); give a new or "
                           f"empty directory, or leave it empty for runs/<timestamp>"])


def _engine_nodes(cpus: float, gpus: float) -> dict[str, str]:
    """{node id: address} of the alive nodes whose totals can host one engine (`cpus` CPUs, `gpus` GPUs)."""
    import ray

    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")
            and n.get("Resources", {}).get("CPU", 0) >= cpus and n.get("Resources", {}).get("GPU", 0) >= gpus}


def _spread_first_engines(num_engines: int, nodes: dict[str, str]) -> Callable[[str], dict]:
    """FleetManager.actor_options: the first incarnation of engine i on node i mod len(nodes) ({node id:
    address} of nodes that can host an engine, in address order); {} for any later incarnation, so that Belayer
    places replacements (node exclusion) and standbys (shadow.placement). Hard node affinity: Ray's SPREAD
    strategy and soft affinity both put engines on other nodes than asked in our netns tests (all on one node);
    an engine whose node is gone before it starts fails its start and is placed again by Belayer."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    order = sorted(nodes, key=lambda n: (nodes[n], n))
    first = {f"engine-{i}": order[i % len(order)] for i in range(num_engines)}

    def opts(sid: str) -> dict:
        node = first.pop(sid, None)
        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)} if node else {}

    return opts


def _take_checkpoint(src: Path, run_dir: Path) -> tuple[int, Optional[str]]:
    """Copies the newest complete learner checkpoint of the run in `src` and the weights it produced into
    `run_dir` (where the new learner and a later resume find them); returns (its step, the weights' path).
    (0, None) when `src` holds none: the run starts from the beginning, as the earlier one did."""
    import shutil

    done = sorted((int(p.name.removeprefix("step-")) for p in (src / "learner-ckpt").glob("step-*")
                   if (p / "COMPLETE").exists()), reverse=True)
    for step in done:
        weights = src / "weights" / f"v{step}"
        if not (weights / "config.json").exists():  # written before the checkpoint: absent, the run was damaged
            continue
        shutil.copytree(src / "learner-ckpt" / f"step-{step}", run_dir / "learner-ckpt" / f"step-{step}")
        shutil.copytree(weights, run_dir / "weights" / f"v{step}")
        return step, str(run_dir / "weights" / f"v{step}")
    return 0, None


class RunFailed(RuntimeError):
    """The run could not finish; the report carries what was lost and why."""


class ReferenceLoop:
    """One run of the reference loop; `run()` returns the report dict."""

    def __init__(self, cfg: BelayerConfig, recipe: DictConfig, progress: bool = True,
                 on_step: Optional[Callable[["ReferenceLoop", int, str], None]] = None,
                 resume_from: Optional[Path] = None):
        """`on_step(loop, step, "start" | "end")` is called at each step's edges (a bench's CPU accounting).
        `resume_from`: the run directory of an earlier run of the same recipe; this run starts after the step of
        its newest complete learner checkpoint, with that checkpoint and that step's weights (a job restarted
        from its checkpoint, as bench/goodput.py's restart-based arm does)."""
        self.cfg = cfg
        self.on_step = on_step
        self.loop = _loop_config(recipe)
        from belayer_plugin.sandbox.remote import placement_problems

        bad = chaos_problems(cfg, self.loop) + placement_problems(cfg, self.loop)
        if bad:  # before anything starts: a fault that cannot land would be found out only after the run
            raise ConfigError(bad)
        self.run_dir = make_run_dir(cfg)
        _refuse_used_run_dir(self.run_dir)
        # The step this run resumes after (0: from the start) and the weights of that step
        self.resumed_step, self.resumed_weights = (0, None) if resume_from is None else \
            _take_checkpoint(Path(resume_from), self.run_dir)
        self.events = EventLog(self.run_dir / "events.jsonl")
        # Per-step recovery counters, as a trainer's logger would get them (see StepMetrics)
        self.step_metrics = StepMetrics()
        self.events.subscribe(self.step_metrics.on_event)
        self.progress = progress
        self.fleet: Any = None
        self.learner: Any = None
        self.learner_pid: Optional[int] = None
        self.learner_info: dict = {}  # what the newest learner reported on start (its step, what it resumed)
        self.fleet_at_end: dict = {}  # the fleet when the run ended (_settle_fleet)
        self.engine_evidence: dict = {}  # each live engine's own account at the end (_engine_evidence)
        self.sandbox_evidence: dict = {}  # the checkpoint mode asked for and the runtime's CRIU probe
        self.chaos: Any = None
        self.gen: Any = None  # the generation client (closed at clean-up)
        self.sandbox_hosts: Any = None  # sandbox.placement=spread: a sandbox host on every node (sandbox/remote.py)
        self.steps: list[dict] = []
        self.trajectories: list[dict] = []
        self.lost: list[dict] = []

    def _say(self, msg: str) -> None:
        if self.progress:
            print(msg, flush=True)

    async def _new_learner(self) -> None:
        import ray

        from belayer_plugin.learner import Learner

        self.learner = ray.remote(Learner).options(num_cpus=0, max_restarts=0).remote(
            self.fleet.model_path, str(self.run_dir), self.loop.lr, self.loop.seed)
        info = await self.learner.info.remote()
        self.learner_pid = info["pid"]
        self.learner_info = info
        if info["resumed_from"] is not None:
            self.events.emit("learner", "learner", "resumed", f"from the checkpoint of step {info['resumed_from']}",
                             step=info["resumed_from"])

    async def _train(self, step: int, batch: list[dict]) -> dict:
        import ray

        attempts = 0
        while True:
            try:
                return await self.learner.train_step.remote(step, batch)
            except ray.exceptions.RayActorError as e:
                attempts += 1
                self.events.emit("learner", "learner", "died", f"{type(e).__name__} at step {step}", level="warning")
                if not self.cfg.use_fault_tolerance or attempts > self.loop.learner_restarts:
                    raise RunFailed(f"learner died at step {step} "
                                    f"({'fault tolerance off' if not self.cfg.use_fault_tolerance else 'restart budget spent'})") from e
                t0 = time.monotonic()
                await self._new_learner()  # resumes from the newest complete checkpoint (step - 1)
                # What the new learner itself reported (chaos/check.py judges the restart from it): the
                # update it is at, the checkpoint it loaded (None: the initial weights) and those it found.
                info = self.learner_info
                self.events.emit("learner", "learner", "restarted", f"re-running step {step}",
                                 took_s=round(time.monotonic() - t0, 3), step=step,
                                 learner_step=info.get("step"), resumed_from=info.get("resumed_from"),
                                 checkpoints_found=info.get("checkpoints"))

    def _backend(self) -> Any:
        from belayer_plugin.sandbox.factory import make_backend

        return make_backend(self.cfg.sandbox)

    async def run(self) -> dict:
        """Runs every step; returns the report (also written to run_dir/report.json)."""
        from belayer_plugin import report

        t_start = time.time()
        status, error = "ok", None
        try:
            await self._run()
        except Exception as e:  # the report must say what went wrong, typed
            status = "failed"
            error = {"type": type(e).__name__, "message": str(e)[:2000],
                     "traceback": traceback.format_exc()[-4000:]}
            self.events.emit("loop", "run", "failed", f"{type(e).__name__}: {str(e)[:300]}", level="error")
        finally:
            await self._cleanup()
        rep = report.build(self, status, error, time.time() - t_start)
        report.write(rep, self.run_dir, self.events)
        return rep

    async def _run(self) -> None:
        from belayer_plugin.envs.build import ensure_image
        from belayer_plugin.fleet.manager import FleetManager
        from belayer_plugin.generation.resumable import FleetSelector, ResumableGenerator
        from belayer_plugin.ray_cluster import init_ray
        from belayer_plugin.rollout import TASK, run_group
        from belayer_plugin.sandbox.base import Sandbox, SandboxSpec
        from belayer_plugin.sandbox.checkpoint import CheckpointStore

        cfg, lc = self.cfg, self.loop
        init_ray(cfg.ray)
        # Before anything starts: on several nodes, a store that is not shared is a configuration error.
        store_root = Path(cfg.sandbox.checkpoint_dir or self.run_dir / "sandbox-checkpoints")
        store_nodes = await self._check_store(store_root)
        self._say(f"[belayer] run dir {self.run_dir}; fault tolerance {'ON' if cfg.use_fault_tolerance else 'OFF'}; "
                  f"chaos {cfg.chaos.kind + ' @ ' + cfg.chaos.trigger + ' ' + format(cfg.chaos.at, 'g') if cfg.chaos.enabled else 'off'}")
        self.fleet = FleetManager(cfg, self.run_dir, self.events)
        nodes = await asyncio.to_thread(_engine_nodes, cfg.engines.num_cpus_per_engine,
                                        cfg.engines.num_gpus_per_engine)
        if lc.spread_engines and len(nodes) > 1:
            self.fleet.actor_options = _spread_first_engines(cfg.engines.num_engines, nodes)
        t0 = time.monotonic()
        backend = self._backend()
        if cfg.sandbox.placement == "spread":
            from belayer_plugin.sandbox.remote import SandboxHosts
            from belayer_plugin.sandbox.shared_store import alive_nodes

            self.sandbox_hosts = SandboxHosts(cfg.sandbox, store_root, self.events.callback("sandbox"))
            image_ready = asyncio.to_thread(lambda: set(self.sandbox_hosts.start(alive_nodes()).values()).pop())
        else:
            image_ready = asyncio.to_thread(ensure_image, backend, cfg.sandbox.env, cfg.sandbox.env_cache_dir or None)
        # The tokenizer (transformers and torch imports), the learner (torch in its worker) and the sandbox
        # image need only the model's path: they get ready while the engines start, not after (~7 s saved).
        starts = [asyncio.ensure_future(c) for c in (
            image_ready, self.fleet.start(), asyncio.to_thread(_load_tokenizer, self.fleet.model_path), self._new_learner())]
        try:
            image, _, tok, _ = await asyncio.gather(*starts)
        finally:  # a failed start: the others are cancelled and awaited, nothing left unretrieved
            for t in starts:
                t.cancel()
            await asyncio.gather(*starts, return_exceptions=True)
        self._say(f"[belayer] {cfg.engines.num_engines} {cfg.engines.kind} engines"
                  f"{f' + {cfg.shadow.num_standby} standby' if self.fleet.shadows else ''} up in "
                  f"{time.monotonic() - t0:.1f} s; sandbox image {image}")
        recovery = cfg.recovery
        if not cfg.use_fault_tolerance:
            from dataclasses import replace

            recovery = replace(recovery, max_attempts=1)  # no resume: a failed request is lost
        gen: Any
        if not cfg.use_fault_tolerance and not cfg.chaos.enabled and self.fleet.url:
            # Off means off: a plain client through sglang-router, no Belayer code in the request path (the
            # baseline of bench/overhead.py). A chaos run keeps the generator: its token triggers need the
            # tokens as they come and the engine a request runs on, which a plain client never sees.
            from belayer_plugin.generation.plain import PlainGenerator

            gen = PlainGenerator(self.fleet.url, cfg.router.request_timeout_s)
        else:
            gen = ResumableGenerator(FleetSelector(self.fleet), recovery, self.events)
        self.gen = gen
        if cfg.chaos.enabled:
            from belayer_plugin.chaos.injector import ChaosInjector

            self.chaos = ChaosInjector(cfg.chaos, self.events, self.fleet, lambda: self.learner_pid,
                                       lambda: self.learner_info.get("node"))
            backend = self.chaos.wrap_backend(backend)
            gen.observers.append(self.chaos.gen_observer)
            self.events.subscribe(self.chaos.on_event)
            self.chaos.start()
        store = CheckpointStore(store_root, keep=cfg.sandbox.keep_checkpoints)
        try:  # the runtime's own answer on CRIU, for the chaos checks (auto must not fall back where it works)
            criu_problem = backend.criu_problem() if cfg.sandbox.checkpoint_mode == "auto" else None
        except Exception as e:
            criu_problem = f"probe failed: {type(e).__name__}: {e}"
        self.sandbox_evidence = {"checkpoint_mode": cfg.sandbox.checkpoint_mode, "criu_problem": criu_problem,
                                 "store_shared_by": sorted(store_nodes),
                                 "backend": cfg.sandbox.backend}
        spec = SandboxSpec(image=image, cpus=cfg.sandbox.cpus, memory_mb=cfg.sandbox.memory_mb,
                           pids_limit=cfg.sandbox.pids_limit, network=cfg.sandbox.network)

        def factory(tid: str, on_event: Any) -> Any:
            if self.sandbox_hosts is not None:  # a recorder on the least loaded node's sandbox host
                return self.sandbox_hosts.recorder(tid, spec, on_event)
            return Sandbox.create(backend, spec, sandbox_id=tid, exec_timeout_s=cfg.sandbox.exec_timeout_s,
                                  on_event=on_event)

        if self.resumed_weights is not None:
            # A restarted job: the engines started at the initial weights; the learner resumed from the copied
            # checkpoint (its info says which); the engines get that step's weights before the next step.
            if self.learner_info.get("step") != self.resumed_step:
                raise RunFailed(f"resuming after step {self.resumed_step}: the learner resumed at step "
                                f"{self.learner_info.get('step')}")
            await self.fleet.pause(release_memory=True)
            await self.fleet.refit(self.resumed_weights, f"v{self.resumed_step}")
            await self.fleet.resume()
            self.events.emit("loop", "run", "resumed", f"after step {self.resumed_step} of an earlier run",
                             step=self.resumed_step)
            self._say(f"[belayer] resumed after step {self.resumed_step} (learner checkpoint and weights v{self.resumed_step})")
        for step in range(self.resumed_step + 1, lc.num_steps + 1):
            if self.on_step is not None:
                self.on_step(self, step, "start")
            t_step, cpu_host, cpu_driver = time.monotonic(), host_cpu_s(), time.process_time()
            if self.chaos:
                self.chaos.on_phase("serving", step)
            prompts = []
            for p in range(lc.prompts_per_step):
                text = tok.apply_chat_template([{"role": "user", "content": f"{TASK} Episode {step}.{p}"}],
                                               tokenize=False, add_generation_prompt=True)
                prompts.append(tok(text)["input_ids"])
            jobs = [run_group(group_id=f"s{step}-p{p}", first_index=p * lc.group_size, step=step, prompt_ids=ids,
                              tokenizer=tok, gen=gen, sandbox_factory=factory, store=store, cfg=cfg, loop_cfg=lc,
                              events=self.events, chaos=self.chaos) for p, ids in enumerate(prompts)]
            t_gen = time.monotonic()
            groups = await asyncio.wait_for(asyncio.gather(*jobs), lc.step_timeout_s)
            results = [r for g in groups for r in g]
            gen_s = time.monotonic() - t_gen
            done = [r for r in results if not isinstance(r, BaseException)]
            for r in results:
                if isinstance(r, BaseException):
                    self.lost.append({"step": step, "error": f"{type(r).__name__}: {str(r)[:300]}"})
            for r in done:
                self.trajectories.append({"step": step, "id": r.traj_id, "digest": r.digest(), "reward": r.reward,
                                          "actions": len(r.actions), "tokens": len(r.token_ids),
                                          "env_recoveries": r.env_recoveries, "resumed_requests": r.resumed_requests,
                                          "checkpoints": r.checkpoints, "checkpoint_wait_s": round(r.checkpoint_wait_s, 4),
                                          "gen_s": round(r.gen_s, 3), "env_s": round(r.env_s, 3),
                                          "setup_s": round(r.setup_s, 3), "finish_s": round(r.finish_s, 3),
                                          "wall_s": round(r.wall_s, 3),
                                          "final_state": r.final_state})
            self.fleet.raise_if_fatal()  # below the floor: the typed fleet error, not "trajectories lost"
            if len(done) < len(results):
                raise RunFailed(f"step {step}: {len(results) - len(done)} of {len(results)} trajectories lost; "
                                f"first: {self.lost[-1]['error']}")
            # GRPO: advantages normalised within each prompt's group
            batch = []
            by_prompt: dict[int, list[Any]] = {}
            for i, r in enumerate(done):
                by_prompt.setdefault(i // lc.group_size, []).append(r)
            for group in by_prompt.values():
                rs = [r.reward for r in group]
                mu, sd = statistics.fmean(rs), (statistics.pstdev(rs) or 1.0)
                for r in group:
                    batch.append({"token_ids": r.token_ids, "gen_mask": r.gen_mask, "advantage": (r.reward - mu) / sd})
            t_barrier = time.monotonic()
            await self.fleet.pause(release_memory=True)
            if self.chaos:
                self.chaos.on_phase("paused", step)
            t_train = time.monotonic()
            out = await self._train(step, batch)
            if self.chaos:
                self.chaos.on_phase("refit", step)
            t_refit = time.monotonic()
            if cfg.use_fault_tolerance:
                await self.fleet.recover_dead(lc.step_timeout_s)  # a no-op when nothing died
            served = await self.fleet.refit(out["path"], f"v{step}")
            t_resume = time.monotonic()
            await self.fleet.resume()
            t_end, cpu_host_end = time.monotonic(), host_cpu_s()
            rewards = [r.reward for r in done]
            self.steps.append({"step": step, "mean_reward": statistics.fmean(rewards), "loss": out["loss"],
                               "version": f"v{step}", "engines": served, "trajectories": len(done),
                               "gen_s": round(gen_s, 3), "barrier_s": round(t_end - t_barrier, 3),
                               # the barrier's parts: pause (release memory), train, refit, resume
                               "pause_s": round(t_train - t_barrier, 4), "train_s": round(t_refit - t_train, 4),
                               "refit_s": round(t_resume - t_refit, 4), "resume_s": round(t_end - t_resume, 4),
                               "step_s": round(t_end - t_step, 3),
                               # CPU the step cost: this process (the trainer's driver, Belayer's client
                               # and monitor) and the whole host (None where /proc/stat is absent)
                               "cpu_driver_s": round(time.process_time() - cpu_driver, 3),
                               "cpu_host_s": (round(cpu_host_end - cpu_host, 3)
                                              if cpu_host is not None and cpu_host_end is not None else None),
                               "belayer": self.step_metrics.take()})
            if self.on_step is not None:
                self.on_step(self, step, "end")
            self._say(f"[step {step}/{lc.num_steps}] {'#' * step}{'.' * (lc.num_steps - step)} "
                      f"{len(done)} trajectories, mean reward {statistics.fmean(rewards):+.2f}, loss {out['loss']:+.4f}, "
                      f"weights v{step} on {len(served)} engine(s), {time.monotonic() - t_step:.1f} s")
        if cfg.use_fault_tolerance:
            await self._settle_fleet()
            self.fleet.raise_if_fatal()  # below the floor by the end: the typed failure, as after any step
        if self.chaos is not None and self.fleet.shadows is not None and "standby_replaced" in cfg.chaos.expect:
            # A chaos run that expects a standby's replacement shows it through: replacements still starting
            # in the background finish (or fail, reported) before shutdown, however long a start takes on a
            # loaded machine. Other runs do not wait (a start costs ~6 CPU-s that no check looks at).
            pending = [t for t in getattr(self.fleet.shadows, "_tasks", ()) if not t.done()]
            if pending:
                await asyncio.wait(pending, timeout=lc.step_timeout_s)

    async def _check_store(self, root: Path) -> dict[str, str]:
        """On a cluster of several nodes, the run directory (the learner's checkpoints and the weights every
        engine loads at a refit) and the sandbox checkpoint store (a lost node's sandboxes are restored on
        another from it) must each be one shared directory on all of them: proved by a probe from every node,
        else the run stops before anything starts with a ConfigError naming the nodes. Returns {node: probe}."""
        from belayer_plugin.sandbox.shared_store import StoreNotShared, alive_nodes, check_shared_store

        if len(await asyncio.to_thread(alive_nodes)) <= 1:
            return {}
        timeout_s = self.cfg.sandbox.shared_store_check_timeout_s
        problems: list[str] = []
        seen: dict[str, str] = {}
        for path, what, why in ((self.run_dir, "belayer.run_dir", "the learner's weights are loaded from it by "
                                 "every engine"), (root, "sandbox.checkpoint_dir", "a sandbox of a lost node is "
                                 "restored on another from it")):
            try:
                seen = await check_shared_store(path, timeout_s, what, why)
            except StoreNotShared as e:
                problems.append(str(e))
        if problems:
            raise ConfigError(problems)
        self._say(f"[belayer] run dir and sandbox checkpoint store {root}: shared by {len(seen)} nodes "
                  f"({', '.join(sorted(seen))})")
        return seen

    async def _settle_fleet(self) -> None:
        """After the last step: an engine that died late (in the last refit, say) is found, and recoveries
        under way finish before shutdown, bounded by loop.end_recovery_timeout_s; `fleet_at_end` (and the
        report) says whether the run ended at full strength. A run the fleet answered in time costs a
        liveness call per engine."""
        import ray

        from belayer_plugin.fleet.health import Signal, State

        fleet, t0 = self.fleet, time.monotonic()
        timeout = self.loop.end_recovery_timeout_s

        async def check_alive(s: Any) -> None:  # the monitor may not have seen a death of the last moment
            try:
                alive = await asyncio.wait_for(s.actor.server_alive.remote(), self.cfg.monitor.liveness_timeout_s)
            except (asyncio.TimeoutError, ray.exceptions.RayError):
                alive = None  # unreachable is not dead: the monitor's own path decides
            except Exception:
                alive = None
            if alive is False:
                await fleet.report(s.slot_id, Signal.LIVENESS_LOST, "server found dead at the end of the run",
                                   url=s.info.url if s.info is not None else None)

        await asyncio.gather(*(check_alive(s) for s in list(fleet.slots.values())
                               if s.actor is not None and s.health.state in (State.HEALTHY, State.SUSPECT)))

        def pending() -> dict[str, asyncio.Task]:  # a recovery task runs until its events are written
            # (a retired slot's task waits out restart.retire_cooldown_s: minutes, not a recovery under way)
            return {sid: s.recovery for sid, s in fleet.slots.items()
                    if s.recovery is not None and not s.recovery.done() and s.health.state is not State.RETIRED}

        waited_for = sorted(pending())
        deadline = t0 + timeout
        while (tasks := pending()) and fleet.fatal is None and (left_s := deadline - time.monotonic()) > 0:
            await asyncio.wait(list(tasks.values()), timeout=left_s)  # a slot that dies again: a new task
        states = fleet.states()
        serving = sorted(sid for sid, st in states.items() if st == State.HEALTHY.value)
        left = sorted(pending())
        self.fleet_at_end = {
            "full_strength": len(serving) == len(states), "serving": len(serving), "engines": len(states),
            "states": states, "waited_for": waited_for, "still_recovering": left,
            "waited_s": round(time.monotonic() - t0, 3), "timed_out": bool(left)}
        if waited_for or not self.fleet_at_end["full_strength"]:
            full = self.fleet_at_end["full_strength"]
            self.events.emit("loop", "fleet", "end_state",
                             (f"full strength after waiting for the recovery of {', '.join(waited_for)}" if full else
                              f"ended BELOW full strength: {len(serving)} of {len(states)} engines serving"
                              + (f"; still recovering after {timeout:g} s (loop.end_recovery_timeout_s): "
                                 f"{', '.join(left)}" if left else "")),
                             level="info" if full else "warning", **{k: v for k, v in self.fleet_at_end.items()
                                                                     if k != "states"})
            self._say(f"[belayer] fleet at the end: {len(serving)} of {len(states)} engines serving"
                      + (f" (waited {self.fleet_at_end['waited_s']:.1f} s for {', '.join(waited_for)})"
                         if waited_for else "") + ("" if full else " -- BELOW FULL STRENGTH"))
        self.engine_evidence = await self._engine_evidence()

    async def _engine_evidence(self) -> dict:
        """Each live engine server's own account of the run (its /get_server_info): its counters and, on the CPU
        engine, its ledger of the requests it served (prompt and generated tokens per request id). The chaos
        checks read it as evidence that Belayer's own events did not write (belayer_plugin/chaos/check.py)."""
        import httpx

        from belayer_plugin.generation.sglang_http import get_json

        out: dict = {}
        async with httpx.AsyncClient() as client:
            for sid, s in list(self.fleet.slots.items()):
                url = s.info.url if s.info is not None else None
                if not url:
                    continue
                try:
                    info = await get_json(client, url, "/get_server_info", 5.0)
                except Exception as e:
                    out[sid] = {"url": url, "error": f"{type(e).__name__}: {e}"[:300]}
                    continue
                out[sid] = {"url": url, "counters": info.get("belayer_counters"),
                            "requests": info.get("belayer_requests")}
        return out

    async def _cleanup(self) -> None:
        import ray

        if self.chaos is not None:
            self.chaos.stop()
        if self.gen is not None:
            await self.gen.aclose()
        if self.learner is not None:
            try:
                await asyncio.wait_for(self.learner.wait_checkpoint.remote(), 30)
            except Exception:
                pass
            ray.kill(self.learner, no_restart=True)
        if self.sandbox_hosts is not None:
            await asyncio.to_thread(self.sandbox_hosts.shutdown)
        if self.fleet is not None:
            await self.fleet.shutdown()
