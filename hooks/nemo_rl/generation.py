"""Belayer under NeMo-RL's SGLang generation backend (nemo_rl/models/generation/sglang/sglang_generation.py,
`SGLangGeneration(cluster, sglang_cfg)`), checked against NeMo-RL's real classes (tests/test_hooks_nemo_rl.py).

`fault_tolerant(SGLangGeneration)` returns a subclass. With `policy.generation.sglang_cfg.use_fault_tolerance`
false it is NeMo-RL's class unchanged. With it true, a Belayer fleet owns the SGLang engines and the
sglang-router (health monitor with Ray liveness in every phase, bounded restarts, confirmed router membership,
weight-version fencing), NeMo-RL's own workers and router are not started, and:

- the attributes NeMo-RL's code reads are set as SGLangGeneration.__init__ sets them (engine topology such as
  `num_gpus_per_engine`, the placement group and its bundle order, `router_ip`/`router_port` = the fleet's
  router, NeMo-RL's own HTTP client and loop), so `generate()`, `generate_async()` and `generate_one_sample()`
  are NeMo-RL's code, posting to Belayer's router;
- colocated (NeMo-RL runs SGLang colocated only), engine i's actor is scheduled on the bundle NeMo-RL would
  give engine i (same fractional resources), standby k on engine (k mod N)'s bundle;
- refit follows NeMo-RL's tags: `prepare_for_generation(tags=["weights"])` -> weights memory back, readiness
  probes off (Ray liveness stays on); `get_rollout_engine_urls()` -> waits for recoveries under way, then one
  URL per engine slot in slot order (rank r streams to slot r // num_gpus_per_engine; a replacement takes its
  slot's index; a slot without an engine is an error naming it); NeMo-RL streams with `weight_version`;
  `prepare_for_generation(tags=["kv_cache"])` -> the streamed version becomes the fleet's current version
  (verified per engine; any engine not serving it, e.g. one restarted mid-stream, is STALE: not routed, not in
  the router, until a refit streams to it), KV cache back, readiness probes on;
- `finish_generation()` -> fleet.pause(release_memory=needs_offload); `invalidate_kv_cache()` -> /flush_cache
  on every engine, retried while requests drain (bounded by engines.flush_cache_timeout_s);
  `shutdown()` -> fleet.shutdown();
- `get_step_metrics()` -> Belayer's per-step recovery metrics (`belayer/...`), which GRPO logs as
  `train/belayer/...` with the step's metrics;
- `belayer.chaos` (off by default) injects Belayer's chaos kinds; the `step` trigger counts generation phases
  (one per refit), `victim_state` paused/serving follows finish/prepare.
Knobs: `policy.generation.sglang_cfg.belayer` (a `belayer` section over recipes/belayer/default.yaml),
validated at construction with every problem named at once (dotted paths in NeMo-RL's recipe).

SGLang servers (`belayer.engines.kind: sglang`) run with NeMo-RL's own server arguments. Precedence, per key:
1. Belayer's own: model_path, host, port, weight_version (Belayer picks each server's port, which NeMo-RL's
   port allocator would otherwise pick, and tracks weight versions); NeMo-RL's nccl_port and dist_init_addr are
   dropped (see nemo_rl_server_args: single-node engines only).
2. NeMo-RL's: everything `SGLangGenerationWorker._compute_server_args` returns for the engine's rank and
   base_gpu_id (tp/dp/pp/ep sizes, dtype, mem_fraction_static, context_length, enable_memory_saver =
   needs_offload, enable_weights_cpu_backup = cpu_weight_backup, random_seed + rank, skip_server_warmup, ...),
   computed by calling NeMo-RL's method (never a copy) and converted to `sglang.launch_server` flags
   (belayer_plugin.engines.sglang.server_args_argv); each engine actor gets its own in its Ray runtime_env.
3. `belayer.engines.sglang`, only for what NeMo-RL does not set (e.g. attention_backend, which NeMo-RL's
   config declares but does not pass; extra_args, appended last). recipes/belayer/default.yaml's engines.sglang
   is Belayer's CPU set-up (device cpu, float32, torch_native, max_total_tokens 8192, the .venv-sglang venv, the
   import stand-ins on PYTHONPATH) and does not apply here: under NeMo-RL the device is "cuda" (SGLang's
   default, and where NeMo-RL runs SGLang), every other default.yaml value is reset to "SGLang chooses", and the
   interpreter is NeMo-RL's SGLang python (`python: nemo_rl`: what NeMo-RL's actor environment registry names
   for SGLangGenerationWorker, resolved by NeMo-RL's make_actor_runtime_env; or an explicit path).
CPU test mode: `belayer.engines.sglang.device: cpu` keeps Belayer's CPU set-up of default.yaml unchanged
(today's CPU flags, .venv-sglang, stand-ins) and passes none of NeMo-RL's server arguments (its GPU memory
saver, tensor parallelism and weights backup have no CPU path).
GPU placement as NeMo-RL's SGLangGeneration._start_engines does it (unverified on GPU): engine i's base_gpu_id
is the GPU id of the bundle NeMo-RL gives engine i, the actor sets Ray's RAY_EXPERIMENTAL_NOSET_*_VISIBLE_*
flags and carries the driver's CUDA_VISIBLE_DEVICES, so the server sees the same devices as NeMo-RL's worker.
Not carried over: the SGLANG_* environment defaults NeMo-RL writes inline in _start_engines (not callable
without copying them; one of them, SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false, would make /health_generate,
Belayer's readiness probe, answer without generating); set them in the Ray workers' environment if wanted.

Owns: the generation backend that puts a FleetManager under NeMo-RL. Must not: hold fault-tolerance logic of
its own (the fleet and the generator do).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse

from belayer_plugin.config import BelayerConfig, ConfigError
from belayer_plugin.hooks._config import belayer_section

P = "policy.generation.sglang_cfg"
UPSTREAM_FT_KEY = "use_faulttolerance"  # NeMo-RL's own switch in its open SGLang fault-tolerance PR (#3613)
BASE_VERSION = "default"  # what an engine that no refit reached reports (Belayer's engines start with it)
SGLANG_WORKER = "nemo_rl.models.generation.sglang.sglang_worker.SGLangGenerationWorker"
NEMO_RL_PYTHON = "nemo_rl"  # engines.sglang.python: the interpreter NeMo-RL runs SGLangGenerationWorker with
# engines.sglang under NeMo-RL on GPU, before the recipe's own belayer.engines.sglang: none of default.yaml's CPU
# set-up; "", 0 and false let SGLang choose (NeMo-RL's server arguments set the rest, see the module docstring).
NEMO_RL_GPU_SGLANG = {"python": NEMO_RL_PYTHON, "device": "cuda", "dtype": "", "attention_backend": "",
                      "max_total_tokens": 0, "mem_fraction_static": 0, "standins_on_path": False, "extra_args": []}


def nemo_rl_server_args(sglang_cfg: dict, *, rank: int, base_gpu_id: int, num_gpus_per_engine: int,
                        gpus_per_node: int) -> dict[str, Any]:
    """The SGLang server arguments NeMo-RL starts engine `rank` with: its own
    `SGLangGenerationWorker._compute_server_args`, called on the plain class (Ray's actor-class metadata) with the
    attributes its __init__ sets (its __init__ itself is not run: it also patches SGLang's installed files, in
    NeMo-RL's SGLang venv, which it does when NeMo-RL starts a worker), less what Belayer owns.

    base_gpu_id is the physical GPU id NeMo-RL gives the worker; the method maps it through this process's
    CUDA_VISIBLE_DEVICES, which is what the worker sees too (NeMo-RL passes the driver's value to its workers, and
    Belayer's engine actors get the same, see BelayerSGLangMixin.belayer_engine_env)."""
    from nemo_rl.models.generation.sglang.sglang_worker import SGLangGenerationWorker  # noqa: PLC0415

    worker = object.__new__(SGLangGenerationWorker.__ray_metadata__.modified_class)
    worker.gpus_per_node, worker.sglang_cfg, worker.rank = gpus_per_node, sglang_cfg, rank
    worker.base_gpu_id, worker.num_gpus_per_engine = base_gpu_id, num_gpus_per_engine
    # host and port: Belayer's (it picks each server's port; the command sets both). nccl_port and
    # dist_init_addr: NeMo-RL allocates them from its generation port band for multi-node engines, whose node
    # ranks rendezvous at dist_init_addr. A single-node engine (nnodes == 1, all Belayer runs; more is refused
    # in belayer_config_from_sglang_cfg and sglang_server_command) needs neither: SGLang's TP processes then
    # meet at 127.0.0.1 on an nccl_port the server picks free itself, as the SGLang server does on its own.
    kwargs = worker._compute_server_args(dist_init_addr=None, nccl_port=None, host=None, port=None)
    if kwargs.get("nnodes", 1) != 1:
        raise ValueError(f"NeMo-RL's SGLang engine spans {kwargs['nnodes']} nodes; Belayer runs single-node "
                         "engines only")
    for key in ("host", "port", "nccl_port", "dist_init_addr"):
        kwargs.pop(key, None)
    return kwargs


def nemo_rl_sglang_python() -> str:
    """The interpreter NeMo-RL runs its SGLang workers with: NeMo-RL's make_actor_runtime_env for
    SGLangGenerationWorker (its actor environment registry: PY_EXECUTABLES.SGLANG, a `uv run --extra sglang` venv
    that NeMo-RL builds on each node under NEMO_RL_VENV_DIR when missing, as it does before starting its own
    workers; the driver's python with NEMO_RL_PY_EXECUTABLES_SYSTEM=1). Needs Ray up when it builds a venv."""
    from nemo_rl.utils.venvs import make_actor_runtime_env  # noqa: PLC0415

    return make_actor_runtime_env(SGLANG_WORKER)["py_executable"]


def nemo_rl_topology(sglang_cfg: dict, num_gpus_per_node: Optional[int] = None) -> tuple[dict, list[str]]:
    """NeMo-RL's engine topology from `policy.generation` as SGLangGeneration.__init__ computes it, and the
    problems found (dotted paths)."""
    inner = (sglang_cfg or {}).get("sglang_cfg") or {}
    srv = inner.get("sglang_server_config")
    problems: list[str] = []
    if not isinstance(srv, dict):
        return {}, [f"{P}.sglang_server_config: missing"]
    for key in ("num_gpus", "num_gpus_per_engine"):
        v = srv.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            problems.append(f"{P}.sglang_server_config.{key}: must be an integer >= 1, got {v!r}")
    if not isinstance(srv.get("needs_offload"), bool):
        problems.append(f"{P}.sglang_server_config.needs_offload: must be true or false, got {srv.get('needs_offload')!r}")
    if (inner.get("sglang_router_config") or {}).get("use_external_router"):
        problems.append(f"{P}.sglang_router_config.use_external_router: must be false with use_fault_tolerance "
                        "(Belayer owns the router)")
    if problems:
        return {}, problems
    per_engine = srv["num_gpus_per_engine"]
    local = min(per_engine, num_gpus_per_node or per_engine)
    return {"num_gpus_per_engine": per_engine, "num_engines": srv["num_gpus"] // local,
            "needs_offload": srv["needs_offload"]}, []


def nemo_rl_gpu_mode(engines: dict) -> bool:
    """Whether Belayer's SGLang engines run with NeMo-RL's GPU server arguments: `kind: sglang` without the CPU
    test mode (`belayer.engines.sglang.device: cpu`)."""
    return engines.get("kind") == "sglang" and (engines.get("sglang") or {}).get("device", "cuda") != "cpu"


def belayer_config_from_sglang_cfg(sglang_cfg: dict, num_gpus_per_node: Optional[int] = None) -> BelayerConfig:
    """The toggle and knobs from NeMo-RL's `policy.generation` (SGLangConfig); raises ConfigError naming all.
    With the toggle on, the number of engines follows NeMo-RL's topology (a different belayer.engines.num_engines
    is an error). SGLang engines get NeMo-RL's GPU set-up (NEMO_RL_GPU_SGLANG, tp_size, random_seed and
    enable_memory_saver from NeMo-RL's config) under the recipe's belayer.engines.sglang, unless that asks for
    the CPU test mode; see the module docstring for the precedence."""
    inner = (sglang_cfg or {}).get("sglang_cfg")
    if inner is None:
        raise ConfigError([f"{P}: missing"])
    toggle = inner.get("use_fault_tolerance", False)
    problems = []
    if not isinstance(toggle, bool):
        problems.append(f"{P}.use_fault_tolerance: must be true or false, got {toggle!r}")
        toggle = False
    if toggle and inner.get(UPSTREAM_FT_KEY):
        # NeMo-RL's own SGLang fault tolerance (its open PR #3613) would start its RolloutHealthMonitor and restart
        # engines beside Belayer's fleet: two owners of the same engines.
        problems.append(f"{P}.{UPSTREAM_FT_KEY}: NeMo-RL's own SGLang fault tolerance cannot run beside Belayer's "
                        f"({P}.use_fault_tolerance); switch one of them off")
    section = dict(inner.get("belayer") or {})
    engines = dict(section.get("engines") or {})
    if inner.get("model_path") and not engines.get("model_path"):
        engines["model_path"] = inner["model_path"]  # the policy's model unless the knobs say otherwise
    if toggle:
        topo, bad = nemo_rl_topology(sglang_cfg, num_gpus_per_node)
        problems += bad
        if topo:
            n = engines.get("num_engines")
            if n is not None and n != topo["num_engines"]:
                problems.append(f"{P}.belayer.engines.num_engines: {n} differs from NeMo-RL's {topo['num_engines']} "
                                f"(sglang_server_config.num_gpus / num_gpus_per_engine); leave it unset")
            engines["num_engines"] = topo["num_engines"]
            per_node = num_gpus_per_node or topo["num_gpus_per_engine"]
            if nemo_rl_gpu_mode(engines) and topo["num_gpus_per_engine"] > per_node:
                problems.append(f"{P}.sglang_server_config.num_gpus_per_engine: {topo['num_gpus_per_engine']} GPUs "
                                f"span nodes of {per_node}; Belayer runs single-node SGLang engines only")
    if nemo_rl_gpu_mode(engines):
        from_nemo_rl: dict[str, Any] = {}
        if isinstance(inner.get("tp_size"), int) and not isinstance(inner.get("tp_size"), bool):
            from_nemo_rl["tp_size"] = inner["tp_size"]
        if isinstance(inner.get("random_seed"), int) and not isinstance(inner.get("random_seed"), bool):
            from_nemo_rl["random_seed"] = inner["random_seed"]
        needs_offload = (inner.get("sglang_server_config") or {}).get("needs_offload")
        if isinstance(needs_offload, bool):
            from_nemo_rl["enable_memory_saver"] = needs_offload
        if toggle and needs_offload is True and (inner.get("sglang_server_config") or {}).get(
                "cpu_weight_backup") is False:
            # The memory saver drops the weights at every finish_generation; NeMo-RL resumes engines without a
            # refit (dynamic sampling: grpo.py calls prepare_for_generation() with no tags), which would then
            # serve garbage under a correct version label, and so would a replacement Belayer released.
            problems.append(f"{P}.sglang_server_config.cpu_weight_backup: must be true when needs_offload is true "
                            "(weights released without a CPU backup come back as garbage when NeMo-RL resumes "
                            "generation without a refit)")
        # NeMo-RL's server arguments win over all of these per key anyway; these keep the config truthful.
        engines["sglang"] = {**NEMO_RL_GPU_SGLANG, **from_nemo_rl, **(engines.get("sglang") or {})}
    section["engines"] = engines
    try:
        cfg = belayer_section(section, use_fault_tolerance=toggle, path=f"{P}.belayer")
    except ConfigError as e:
        raise ConfigError(problems + list(e.problems)) from None
    if cfg.use_fault_tolerance and cfg.router.mode != "sglang_router":
        problems.append(f"{P}.belayer.router.mode: NeMo-RL posts to a router; must be sglang_router")
    if problems:
        raise ConfigError(problems)
    return cfg


class LoopThread:
    """An asyncio loop in a daemon thread: NeMo-RL's interface is synchronous, the fleet is async."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="belayer-nemo-rl", daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: Optional[float] = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class BelayerSGLangMixin:
    """Put before NeMo-RL's SGLangGeneration in the bases (see `fault_tolerant`)."""

    belayer_fleet: Any = None
    belayer_chaos: Any = None

    def __init__(self, cluster: Any, sglang_cfg: dict, *args: Any, **kwargs: Any):
        per_node = getattr(cluster, "num_gpus_per_node", None)
        self.belayer = belayer_config_from_sglang_cfg(sglang_cfg, per_node)
        if not self.belayer.use_fault_tolerance:
            super().__init__(cluster, sglang_cfg, *args, **kwargs)
            return
        from belayer_plugin.events import EventLog
        from belayer_plugin.fleet.manager import FleetManager

        self._init_nemo_rl_state(cluster, sglang_cfg)
        run_dir = Path(self.belayer.run_dir or "runs/belayer-nemo-rl")
        run_dir.mkdir(parents=True, exist_ok=True)
        self.belayer_events = EventLog(run_dir / "events.jsonl")
        from belayer_plugin.metrics import StepMetrics

        self.belayer_step_metrics = StepMetrics()  # deltas per GRPO step, see get_step_metrics
        self.belayer_events.subscribe(self.belayer_step_metrics.on_event)
        self.belayer_loop = LoopThread()

        async def make() -> FleetManager:  # built on the loop that will run it
            fm = FleetManager(self.belayer, run_dir, self.belayer_events)
            fm.actor_options = self.belayer_actor_options
            return fm

        self.belayer_fleet = self.belayer_loop.run(make(), 30)
        try:
            self.belayer_loop.run(self.belayer_fleet.start(), self.belayer.engines.startup_timeout_s * 2)
        except BaseException:
            self.belayer_loop.run(self.belayer_fleet.shutdown(), 120)
            self.belayer_loop.stop()
            self.belayer_fleet = None
            raise
        from belayer_plugin.hooks._chaos import attach_chaos

        self.belayer_step = 0  # generation phases begun, one per refit (the chaos `step` trigger counts these)
        self.belayer_refit_open = False
        self.belayer_refit_targets: list[str] = []
        self.belayer_refit_lock = threading.Lock()  # for NeMo-RL's coming synchronizer (see below)
        from belayer_plugin.fleet.refit_gateway import RefitGateway
        from belayer_plugin.fleet.router import router_host

        # NeMo-RL's policy workers stream weights to these per-slot URLs; the gateway binds where the router does
        # (the address the trainer's processes already reach Belayer at)
        self.belayer_gateway = RefitGateway(self.belayer_fleet, router_host(self.belayer.router.host),
                                            self.belayer.engines.refit_request_timeout_s)
        self.belayer_loop.run(self.belayer_gateway.start(), 30)
        self.belayer_chaos = attach_chaos(self.belayer, self.belayer_fleet)
        u = urlparse(self.belayer_fleet.url)
        self.router_ip, self.router_port = u.hostname, u.port

    def _init_nemo_rl_state(self, cluster: Any, sglang_cfg: dict) -> None:
        """What SGLangGeneration.__init__ sets and NeMo-RL's code reads, without its workers and router."""
        from nemo_rl.models.generation.sglang.utils.async_utils import AsyncLoopThread  # noqa: PLC0415
        from nemo_rl.models.generation.sglang.utils.http_utils import HttpClient  # noqa: PLC0415

        self.cluster, self.sglang_cfg = cluster, sglang_cfg
        srv = sglang_cfg["sglang_cfg"]["sglang_server_config"]
        self.num_gpus_per_engine = srv["num_gpus_per_engine"]
        self.num_gpus_per_node = getattr(cluster, "num_gpus_per_node", self.num_gpus_per_engine)
        self.all_engines = [None] * self.belayer.engines.num_engines  # NeMo-RL's workers: none (Belayer's own)
        self.rank_offset, self.gpu_offset = 0, 0
        self.needs_offload = srv["needs_offload"]
        self.model_path = sglang_cfg["sglang_cfg"].get("model_path")
        self._router_actor = None
        self._async_loop = AsyncLoopThread()
        self._http_client = HttpClient(sglang_cfg)
        self.pg, self.pg_reordered_bundle_indices, self.pg_reordered_gpu_ids = None, [], []
        self.belayer_placement: dict[str, int] = {}  # actor id -> bundle index it was given
        colocated = (sglang_cfg.get("colocated") or {}).get("enabled", True)
        if cluster is not None and colocated:
            from nemo_rl.distributed.virtual_cluster import get_reordered_bundle  # noqa: PLC0415

            self.pg = cluster._init_placement_groups(strategy="PACK", use_unified_pg=True)[0]
            if cluster.use_gpus:
                self.pg_reordered_bundle_indices, self.pg_reordered_gpu_ids, _ = get_reordered_bundle(self.pg)
            else:  # no GPU ids to order by (NeMo-RL's probe task asks for a GPU share): bundle order
                self.pg_reordered_bundle_indices = list(range(self.pg.bundle_count))
        e = self.belayer.engines
        if e.kind == "sglang" and e.sglang.device != "cpu":
            if not self.pg_reordered_gpu_ids:
                raise ConfigError([f"{P}.belayer.engines.sglang.device: {e.sglang.device} runs NeMo-RL's server "
                                   "arguments, which need the GPU of NeMo-RL's bundle for each engine (a colocated "
                                   "generation on a cluster with use_gpus); device: cpu is the CPU test mode"])
            if e.sglang.python == NEMO_RL_PYTHON:
                e.sglang.python = nemo_rl_sglang_python()

    def belayer_engine_env(self, i: int) -> dict[str, str]:
        """Environment of engine i's actor (and so of its server) with NeMo-RL's GPU server arguments: {} in the
        CPU test mode and for CPU engines. As NeMo-RL's SGLangGeneration._start_engines sets up its worker i
        (unverified on GPU): base_gpu_id = the GPU id of the bundle NeMo-RL gives engine i
        (pg_reordered_gpu_ids[gpu_offset + i * GPUs per engine on a node]), rank = rank_offset + i, Ray told not to
        set the visible devices (NeMo-RL's NOSET list), the driver's CUDA_VISIBLE_DEVICES passed through."""
        e = self.belayer.engines
        if e.kind != "sglang" or e.sglang.device == "cpu":
            return {}
        from belayer_plugin.engines.sglang import SERVER_ARGS_ENV  # noqa: PLC0415
        from nemo_rl.models.generation.sglang.utils.ray_utils import (  # noqa: PLC0415
            NOSET_VISIBLE_DEVICES_ENV_VARS_LIST,
        )

        local = min(self.num_gpus_per_engine, self.num_gpus_per_node)
        base_gpu_id = int(self.pg_reordered_gpu_ids[self.gpu_offset + i * local])
        kwargs = nemo_rl_server_args(self.sglang_cfg, rank=self.rank_offset + i, base_gpu_id=base_gpu_id,
                                     num_gpus_per_engine=self.num_gpus_per_engine,
                                     gpus_per_node=self.num_gpus_per_node)
        env = {name: "1" for name in NOSET_VISIBLE_DEVICES_ENV_VARS_LIST}
        if os.environ.get("CUDA_VISIBLE_DEVICES"):
            env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
        env[SERVER_ARGS_ENV] = json.dumps(kwargs)
        return env

    def belayer_actor_options(self, actor_id: str) -> dict:
        """Ray options for an engine ("engine-i") or standby ("shadow-k") actor: NeMo-RL's bundle for that
        engine, with the resources NeMo-RL's own engine actors take there, and its environment
        (belayer_engine_env: a standby takes engine (k mod N)'s GPU and server arguments); {} when not
        colocated."""
        if self.pg is None:
            return {}
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: PLC0415

        kind, _, idx = actor_id.rpartition("-")
        i = int(idx) % len(self.all_engines) if kind == "shadow" else int(idx)
        local = min(self.num_gpus_per_engine, self.num_gpus_per_node)
        bundle = self.pg_reordered_bundle_indices[self.gpu_offset + i * local]
        self.belayer_placement[actor_id] = bundle
        share = min(0.2, 1 / self.cluster.max_colocated_worker_groups)
        options = {"num_cpus": share, "num_gpus": share if self.cluster.use_gpus else 0,
                   "scheduling_strategy": PlacementGroupSchedulingStrategy(
                       placement_group=self.pg, placement_group_bundle_index=bundle,
                       placement_group_capture_child_tasks=True)}
        env = self.belayer_engine_env(i)
        if env:
            options["runtime_env"] = {"env_vars": env}
        return options

    # ----------------------------------------------------------------- NeMo-RL's interface
    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        if self.belayer_fleet is None:
            return super().prepare_for_generation(*args, **kwargs)
        tags = kwargs.get("tags")
        fm = self.belayer_fleet
        if tags is not None and "weights" in tags and "kv_cache" not in tags:
            # NeMo-RL streams weights next: no readiness probes until the KV cache is back too.
            self.belayer_loop.run(fm.begin_external_refit(), 600)
            self.belayer_refit_open = True
            return True
        if self.belayer_refit_open:
            self.belayer_loop.run(self._adopt_streamed_version(), 600)
            self.belayer_refit_open = False
            self.belayer_loop.run(fm.end_external_refit() if tags is not None and "weights" not in tags
                                  else fm.resume(), 600)
        else:
            self.belayer_loop.run(fm.resume(), 600)
        self.belayer_step += 1
        self._chaos_phase("serving")
        return True

    async def _adopt_streamed_version(self) -> dict[str, str]:
        """The version NeMo-RL streamed (what the refit's engines now report that is neither the fleet's current
        version nor the base one) becomes the fleet's; nothing changes when nothing was streamed."""
        fm = self.belayer_fleet
        reported = {}
        for sid in self.belayer_refit_targets:
            if sid in self.belayer_gateway.missed:
                continue  # missed part of the stream: whatever it reports, it is not the streamed weights
            s = fm.slots[sid]
            try:
                reported[sid] = await asyncio.wait_for(s.actor.weight_version.remote(),
                                                       self.belayer.monitor.liveness_timeout_s * 5)
            except Exception:
                pass  # died after the stream: liveness has it, and it comes back STALE
        new = {v for v in reported.values() if v not in (fm.weights.version, BASE_VERSION)}
        if not new:
            return {}
        # NeMo-RL's versions are counters: with several (never expected), the highest counter wins; the engines
        # reporting anything else leave the router as STALE.
        version = max(new, key=lambda v: (v.isdigit(), int(v) if v.isdigit() else 0, v))
        # an engine that missed part of the stream may report the new version (every bucket carries it) over
        # partial weights: it is never asked, so adopt_version takes it out of the router (STALE)
        return await fm.adopt_version(version, [t for t in self.belayer_refit_targets
                                                if t not in self.belayer_gateway.missed])

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        if self.belayer_fleet is None:
            return super().finish_generation(*args, **kwargs)
        self.belayer_loop.run(self.belayer_fleet.pause(release_memory=self.needs_offload), 600)
        self._chaos_phase("paused")
        return True

    def _chaos_phase(self, phase: str) -> None:
        if self.belayer_chaos is not None:
            self.belayer_chaos.on_phase(phase, self.belayer_step)

    def get_rollout_engine_urls(self) -> list[str]:
        """One URL per engine slot, in slot order (rank r streams to slot r // num_gpus_per_engine): the refit
        gateway's URL for that slot (fleet/refit_gateway.py). An engine that dies or hangs during the stream,
        or a slot without an engine (retired, or still restarting after the wait below), misses this refit
        without failing it: it stays out of the router until a later refit streams to it. Below the healthy
        floor: FleetBelowFloorError."""
        if self.belayer_fleet is None:
            return super().get_rollout_engine_urls()
        self.recover_before_refit()
        self.belayer_fleet.raise_if_fatal()
        targets = list(self.belayer_fleet.slots)
        self.belayer_refit_targets = targets
        return self.belayer_gateway.open(targets)

    def recover_before_refit(self, timeout: Optional[float] = None) -> int:
        """Waits for recoveries under way (a no-op when nothing died); returns how many there were."""
        if self.belayer_fleet is None:
            return 0
        t = timeout or self.belayer.engines.startup_timeout_s * 2
        return self.belayer_loop.run(self.belayer_fleet.recover_dead(t), t + 5)

    def verify_weight_versions(self) -> dict[str, str]:
        """Every serving engine's weight version; a mismatch fences and restarts that engine (never silent)."""
        return self.belayer_loop.run(self.belayer_fleet.verify_versions(), 120)

    def invalidate_kv_cache(self) -> bool:
        if self.belayer_fleet is None:
            return super().invalidate_kv_cache()
        timeout = self.belayer.engines.flush_cache_timeout_s

        async def flush(s: Any) -> bool:
            # SGLang refuses a flush while requests run: the fleet waits for them to drain (as NeMo-RL's refit
            # retries). An engine that died meanwhile is fine: its replacement starts with an empty cache.
            return await self.belayer_fleet.flush_cache(s, timeout) or not s.health.serving

        async def all_() -> bool:
            rs = await asyncio.gather(*(flush(s) for s in self.belayer_fleet.serving_slots()))
            return all(rs)

        return self.belayer_loop.run(all_(), timeout + 30)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # NeMo-RL's single-controller setup may ship the generation object to a Ray actor. With fault tolerance
        # on, this object owns the fleet (its event loop thread, the engine actors' watchers, the refit gateway)
        # in the process that built it: a copy elsewhere would be a second, blind owner. Say so plainly instead
        # of a pickling error about a thread lock.
        if self.belayer_fleet is None:
            return super().__reduce_ex__(protocol)
        raise TypeError("Belayer's fault-tolerant SGLangGeneration runs its engine fleet in the process that built "
                        "it and cannot be sent to another process (a Ray actor): call it from the driver (NeMo-RL's "
                        "GRPO and its HTTPWeightSynchronizer do), or set "
                        f"{P}.use_fault_tolerance=false for this run")

    def check_weights(self, action: str) -> list:
        """NeMo-RL's check_weights (each engine's `/weights_checker`), on every engine slot in slot order: one
        answer per engine; an engine that cannot answer raises, naming its slot (never an empty list)."""
        if self.belayer_fleet is None:
            return super().check_weights(action)
        fm = self.belayer_fleet

        async def one(sid: str) -> Any:
            s = fm.slots[sid]
            if s.info is None or not s.health.running:
                raise RuntimeError(f"Belayer: engine slot {sid} has no engine to check (state "
                                   f"{s.health.state.value})")
            r = await s.actor.call.remote("POST", "/weights_checker", {"action": action})
            if r["status"] != 200:
                raise RuntimeError(f"Belayer: engine slot {sid} ({s.info.url}): /weights_checker answered HTTP "
                                   f"{r['status']}: {str(r['body'])[:300]}")
            return r["body"]

        async def all_() -> list:
            return list(await asyncio.gather(*(one(sid) for sid in fm.slots)))

        return self.belayer_loop.run(all_(), 120)

    # ----------------------------------------------------------------- NeMo-RL's coming SGLang FT interface
    # Assumed from the description of NeMo-RL's open PR #3613 (its files are not in the snapshot Belayer tests
    # against): its weight synchronizer calls recover_updatable_engines() before the first weights-onload RPC and
    # get_updatable_engines_and_lock() for the engines to stream to and a lock that keeps recovery out of the
    # refit. Belayer answers both from its own fleet, so a refit through that synchronizer keeps working.
    def recover_updatable_engines(self) -> int:
        """Waits for the fleet's recoveries under way; returns how many there were."""
        return self.recover_before_refit()

    def get_updatable_engines_and_lock(self) -> tuple[list[str], Any]:
        """The per-slot URLs to stream weights to (get_rollout_engine_urls) and a lock held for the refit."""
        return self.get_rollout_engine_urls(), self.belayer_refit_lock

    def get_step_metrics(self) -> dict[str, float]:
        """Belayer's recovery metrics since the previous call, `belayer/<name>` (deltas: zeros for a step without
        a fault; {} with fault tolerance off). NeMo-RL asks every generation backend for these once per step
        (`if hasattr(policy_generation, "get_step_metrics")`: grpo.py's grpo_train and async_grpo_train, as for
        vLLM's speculative-decoding counters) and logs them with the step's train metrics through its Logger
        (`logger.log_metrics(metrics, step, prefix="train")`): `train/belayer/<name>` in wandb / tensorboard /
        mlflow."""
        if self.belayer_fleet is None:
            parent = getattr(super(), "get_step_metrics", None)
            return parent() if parent is not None else {}
        return self.belayer_step_metrics.take()

    def shutdown(self) -> bool:
        if self.belayer_fleet is None:
            return super().shutdown()
        if self.belayer_chaos is not None:
            self.belayer_chaos.stop()
        try:
            self.belayer_loop.run(self.belayer_gateway.close(), 30)
            self.belayer_loop.run(self.belayer_fleet.shutdown(), 120)
        finally:
            self.belayer_loop.stop()
            self.belayer_fleet = None
        if self.pg is not None:
            self.belayer_placement = {}
        return super().shutdown()  # NeMo-RL's: closes its HTTP client and loop (no workers, no router of its own)


def fault_tolerant(generation_cls: type) -> type:
    """`fault_tolerant(nemo_rl.models.generation.sglang.sglang_generation.SGLangGeneration)`."""
    return type(f"Belayer{generation_cls.__name__}", (BelayerSGLangMixin, generation_cls),
                {"__module__": __name__, "__doc__": f"{generation_cls.__name__} under a Belayer fleet."})


def patch_nemo_rl() -> type:
    """Makes NeMo-RL construct the fault-tolerant class wherever it builds SGLangGeneration (grpo, ppo, the
    single controller's setup, and any module importing it later). Call before building the policy
    generation, e.g. at the top of your run script. Returns the class."""
    import nemo_rl.models.generation.sglang.sglang_generation as m  # noqa: PLC0415  (NeMo-RL only)

    cls = m.SGLangGeneration
    if not getattr(cls, "_belayer", False):
        original = cls
        cls = fault_tolerant(original)
        cls._belayer = True
        m.SGLangGeneration = cls  # modules imported from now on get it
        for name, mod in list(sys.modules.items()):  # and those already imported (grpo, ppo, setup, ...)
            if name.startswith("nemo_rl") and getattr(mod, "SGLangGeneration", None) is original:
                setattr(mod, "SGLangGeneration", cls)
    return cls
