"""Belayer's typed configuration: dataclasses, Hydra ConfigStore registration, start-up validation.

Defaults live once, in ``recipes/belayer/default.yaml``: the dataclasses here declare names, types and
allowed values but no default values, so a recipe that forgets a key is caught by `validate`, which names
every missing or invalid key at once with its dotted path (a KeyError in the middle of a run is exactly
the bug NeMo-RL's reviewers found when the feature was switched on).

Owns: the config dataclasses, their Hydra registration and validation (every problem at once, with its dotted
path). Must not: hold defaults (recipes/belayer/default.yaml does) or import any other layer.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from belayer_plugin.sandbox.config import SandboxConfig


def _req() -> Any:
    """A required field: its value comes from the recipe."""
    return field(default=MISSING)


def _one_of(*choices: str) -> Any:
    """A required string field restricted to `choices` (OmegaConf has no Literal type)."""
    return field(default=MISSING, metadata={"choices": choices})


@dataclass
class RayConfig:
    address: str = _req()  # "" starts a local cluster on loopback; "auto" or host:port joins one
    num_cpus: int = _req()  # for a local cluster; 0 means what the machine has
    tmp_dir: str = _req()  # "" means a fresh per-run directory
    namespace: str = _req()
    include_dashboard: bool = _req()

    def problems(self) -> list[str]:
        return ["num_cpus: must be >= 0"] if self.num_cpus < 0 else []


@dataclass
class SGLangConfig:
    python: str = _req()  # the interpreter of SGLang's own venv
    device: str = _one_of("cpu", "cuda")
    dtype: str = _req()
    attention_backend: str = _req()  # "" lets SGLang choose (GPU)
    max_total_tokens: int = _req()  # 0 lets SGLang size its KV cache (GPU only: on CPU it over-sizes)
    mem_fraction_static: float = _req()  # 0 lets SGLang choose
    tp_size: int = _req()
    random_seed: int = _req()
    standins_on_path: bool = _req()  # prepend Belayer's import stand-ins (torchvision, vllm) on CPU
    enable_memory_saver: bool = _req()  # GPU only: lets /release_memory_occupation free weights + KV cache
    extra_args: list[str] = _req()

    def problems(self) -> list[str]:
        out = []
        if self.tp_size < 1:
            out.append("tp_size: must be >= 1")
        if not 0 <= self.mem_fraction_static < 1:
            out.append("mem_fraction_static: must be in [0, 1)")
        if self.max_total_tokens < 0:
            out.append("max_total_tokens: must be >= 0")
        return out


@dataclass
class EnginesConfig:
    kind: str = _one_of("cpu", "sglang")
    num_engines: int = _req()
    model_path: str = _req()  # "" means the tiny model built under the cache dir
    # Where an engine's server binds and what its URL names: "" is the address of the node it runs on as Ray
    # knows it (127.0.0.1 on the loopback local cluster), reachable by the router and driver on another node.
    # One address, never a wildcard: 0.0.0.0 would listen everywhere and give a URL no other node can use.
    host: str = _req()
    startup_timeout_s: float = _req()
    shutdown_timeout_s: float = _req()
    torch_threads: int = _req()  # per CPU engine process
    max_running_requests: int = _req()  # CPU engine: requests decoded together
    cpu_step_delay_ms: float = _req()  # CPU engine: emulated per-step latency of a real model (0: none)
    num_cpus_per_engine: float = _req()  # Ray resources an engine actor claims
    num_gpus_per_engine: float = _req()
    flush_cache_timeout_s: float = _req()  # a KV-cache flush is retried this long while requests drain
    drain_timeout_s: float = _req()  # a planned drain waits this long for the engine's requests to move
    # a trainer's weight-stream request (NeMo-RL's refit) an engine has not answered in this long: the engine is
    # fenced and the request absorbed (fleet/refit_gateway.py)
    refit_request_timeout_s: float = _req()
    sglang: SGLangConfig = field(default_factory=SGLangConfig)

    def problems(self) -> list[str]:
        out = []
        if self.num_engines < 1:
            out.append("num_engines: must be >= 1")
        if self.host in ("0.0.0.0", "::", "[::]", "*"):
            out.append(f"host: {self.host!r} is a wildcard: set the address to serve on, or \"\" for the node's own")
        for name in ("startup_timeout_s", "shutdown_timeout_s", "flush_cache_timeout_s", "drain_timeout_s",
                     "refit_request_timeout_s"):
            if getattr(self, name) <= 0:
                out.append(f"{name}: must be > 0")
        if self.torch_threads < 1:
            out.append("torch_threads: must be >= 1")
        if self.cpu_step_delay_ms < 0:
            out.append("cpu_step_delay_ms: must be >= 0")
        if self.max_running_requests < 1:
            out.append("max_running_requests: must be >= 1")
        return out


@dataclass
class RouterConfig:
    mode: str = _one_of("sglang_router", "direct")
    # Where the router (and NeMo-RL's refit gateway) binds and what its URL names: "" is the driver node's own
    # address as Ray knows it (127.0.0.1 on the loopback local cluster), reachable from other nodes. Never a
    # wildcard.
    host: str = _req()
    port: int = _req()  # 0 picks a free port
    prometheus_port: int = _req()  # 0 picks a free port
    policy: str = _one_of("round_robin", "cache_aware", "random", "power_of_two")
    startup_timeout_s: float = _req()
    request_timeout_s: int = _req()
    # Belayer resumes failed requests itself (token level); the router's own retry restarts from token 0.
    disable_retries: bool = _req()
    health_check_interval_s: int = _req()
    # Belayer owns readiness (its own parallel /health_generate probes); the router's checks only need the
    # worker's HTTP front. SGLang's /health generates a token (~1 s on CPU), which delayed every join.
    health_check_endpoint: str = _req()
    membership_timeout_s: float = _req()  # how long a /workers change may take to show up

    def problems(self) -> list[str]:
        out = []
        if self.host in ("0.0.0.0", "::", "[::]", "*"):
            out.append(f"host: {self.host!r} is a wildcard: set the address to serve on, or \"\" for the driver "
                       f"node's own")
        for name in ("port", "prometheus_port"):
            if not 0 <= getattr(self, name) <= 65535:
                out.append(f"{name}: must be a TCP port or 0")
        if self.startup_timeout_s <= 0 or self.membership_timeout_s <= 0:
            out.append("startup_timeout_s and membership_timeout_s: must be > 0")
        return out


@dataclass
class ProgressConfig:
    """Hang detection from token progress (fleet/progress.py): silence beyond an engine's own recent gaps."""

    enabled: bool = _req()
    floor_s: float = _req()  # the least silence that can raise a suspicion
    gap_multiplier: float = _req()  # allowed silence: this x p95 of the engine's recent inter-token gaps
    gap_window: int = _req()  # recent gaps kept per engine
    min_gaps: int = _req()  # gaps an incarnation must stream (after start or resume) before it is watched
    prefill_s_per_1k_tokens: float = _req()  # extra silence per 1000 prompt tokens still awaiting a first token
    confirm_timeout_s: float = _req()  # the immediate /health_generate after a stall; no token and no answer: DEAD
    # An engine that streamed tokens within the last probe interval (and is not silent past its threshold)
    # needs no /health_generate: those tokens are the readiness answer.
    readiness_from_tokens: bool = _req()

    def problems(self) -> list[str]:
        out = []
        for name in ("floor_s", "confirm_timeout_s"):
            if getattr(self, name) <= 0:
                out.append(f"{name}: must be > 0")
        if self.gap_multiplier < 1:
            out.append("gap_multiplier: must be >= 1")
        if self.gap_window < 1:
            out.append("gap_window: must be >= 1")
        if self.min_gaps < 1:
            out.append("min_gaps: must be >= 1")
        if self.prefill_s_per_1k_tokens < 0:
            out.append("prefill_s_per_1k_tokens: must be >= 0")
        return out


@dataclass
class MonitorConfig:
    probe_interval_s: float = _req()  # readiness probes (/health_generate), only while serving
    probe_timeout_s: float = _req()
    failure_threshold: int = _req()  # consecutive failed probes before DEAD
    boot_grace_s: float = _req()  # from start or restart until the first HEALTHY (or generated token), never by resume()
    liveness_timeout_s: float = _req()  # bound on one Ray liveness round trip
    progress: ProgressConfig = field(default_factory=ProgressConfig)

    def problems(self) -> list[str]:
        out = []
        for name in ("probe_interval_s", "probe_timeout_s", "liveness_timeout_s"):
            if getattr(self, name) <= 0:
                out.append(f"{name}: must be > 0")
        if self.failure_threshold < 1:
            out.append("failure_threshold: must be >= 1")
        if self.boot_grace_s < 0:
            out.append("boot_grace_s: must be >= 0")
        return out


@dataclass
class RestartConfig:
    max_restarts: int = _req()  # per engine, within window_s
    window_s: float = _req()
    backoff_initial_s: float = _req()
    backoff_max_s: float = _req()
    backoff_multiplier: float = _req()
    min_healthy_engines: int = _req()
    # Node exclusion needs node evidence: engines of this many different slots (sharing no request) dying
    # on one node within shadow.fault_window_s, or Ray reporting the node dead. Never one slot's deaths.
    node_exclusion_slots: int = _req()
    node_exclusion_decay_s: float = _req()  # an excluded node is re-admitted after this long (0: never)
    node_check_timeout_s: float = _req()  # how long a death with an unreachable actor asks Ray about its node
    # A slot retired for its spent budget is tried again (budget renewed) after this long; one retired while its
    # node was excluded waits for the exclusion to lift as well. 0: retired for good.
    retire_cooldown_s: float = _req()

    def problems(self) -> list[str]:
        out = []
        if self.node_exclusion_slots < 2:
            out.append("node_exclusion_slots: must be >= 2 (one slot's deaths are never node evidence)")
        if self.node_exclusion_decay_s < 0 or self.node_check_timeout_s < 0:
            out.append("node_exclusion_decay_s and node_check_timeout_s: must be >= 0")
        if self.retire_cooldown_s < 0:
            out.append("retire_cooldown_s: must be >= 0 (0: a retired slot stays retired)")
        if self.max_restarts < 0:
            out.append("max_restarts: must be >= 0")
        if self.window_s <= 0:
            out.append("window_s: must be > 0")
        if self.backoff_initial_s < 0 or self.backoff_max_s < self.backoff_initial_s:
            out.append("backoff_initial_s/backoff_max_s: need 0 <= initial <= max")
        if self.backoff_multiplier < 1:
            out.append("backoff_multiplier: must be >= 1")
        if self.min_healthy_engines < 0:
            out.append("min_healthy_engines: must be >= 0")
        return out


@dataclass
class ShadowConfig:
    num_standby: int = _req()
    keep_warm: str = _one_of("refit", "on_handover")  # update standbys at each refit, or at handover
    placement: str = _one_of("any", "spread")  # any: Ray places standbys; spread: the node with the fewest
    handover_timeout_s: float = _req()
    release_memory_when_idle: bool = _req()  # SGLang on GPU: release weights + KV cache while standing by
    shared_weights: bool = _req()  # CPU engine: map weights from a shared-memory holder
    fault_window_s: float = _req()  # deaths of different slots on one node this close together are node evidence
    standby_nice: int = _req()  # a parked standby runs this much nicer (its refits yield the CPU); 0 at handover
    freeze_parked: bool = _req()  # a parked standby's Ray actor is SIGSTOPped between its refits (driver's node)
    freeze_breath_s: float = _req()  # a stopped standby is woken this often for one Ray call (gRPC keepalive)
    rebalance_interval_s: float = _req()  # placement=spread: standbys per node checked this often; 0: never

    def problems(self) -> list[str]:
        out = []
        if self.rebalance_interval_s < 0:
            out.append("rebalance_interval_s: must be >= 0")
        if not 0 <= self.standby_nice <= 19:
            out.append("standby_nice: must be in 0..19")
        if self.freeze_breath_s <= 0:
            out.append("freeze_breath_s: must be > 0")
        if self.num_standby < 0:
            out.append("num_standby: must be >= 0")
        if self.handover_timeout_s <= 0:
            out.append("handover_timeout_s: must be > 0")
        if self.fault_window_s < 0:
            out.append("fault_window_s: must be >= 0")
        return out


@dataclass
class RecoveryConfig:
    """Token-level recovery of in-flight generation requests."""

    mode: str = _one_of("stream", "chunked")
    chunk_tokens: int = _req()  # chunked mode: tokens committed per call
    # Stream mode: the engine sends a chunk every this many tokens (SGLang's per-request stream_interval).
    # 1 commits every token (a kill regenerates nothing); k > 1 costs the client 1/k of the per-chunk work
    # and a kill may regenerate up to k - 1 tokens the engine had not sent yet.
    stream_interval: int = _req()
    # Stream mode, readers that keep only the newest chunk (no per-token observer, no client streaming from the
    # front): the socket is read at most every this many ms or when 64 KiB are waiting, not at every chunk.
    # Tokens wait in the kernel, not on the engine: a kill loses none (the engine's close is read at once).
    # 0: every chunk as it comes.
    stream_coalesce_ms: float = _req()
    max_attempts: int = _req()  # per request, counting the first
    stall_timeout_s: float = _req()  # no new token for this long counts as a failure
    request_timeout_s: float = _req()
    front_host: str = _req()
    front_port: int = _req()
    # A request whose engines died this many times before it got a token from them is poison: it fails with
    # RequestPoisonedError and those deaths are not charged to restart budgets or node health.
    poison_max_deaths: int = _req()
    # A request that finds no serving engine while the fleet is bringing one back (a slot RESTARTING or STALE,
    # or DEAD with its recovery under way: a standby being promoted, a restart backing off) and is not below
    # restart.min_healthy_engines waits for it, keeping its committed tokens, bounded by request_timeout_s
    # (not stall_timeout_s); woken by the fleet's state changes. New requests join that wait while fewer than
    # max_waiting requests wait; the next get 503 with Retry-After: retry_after_s from the front (0: no new
    # request waits). Requests already running always wait.
    max_waiting: int = _req()
    retry_after_s: int = _req()
    # The front's streaming clients get an SSE comment after this long without a token (": waiting for an
    # engine" while their request waits for one), so that they and proxies keep the connection open.
    heartbeat_s: float = _req()

    def problems(self) -> list[str]:
        out = []
        if self.max_waiting < 0:
            out.append("max_waiting: must be >= 0")
        if self.retry_after_s < 1:
            out.append("retry_after_s: must be >= 1 (whole seconds: HTTP's Retry-After)")
        if self.heartbeat_s <= 0:
            out.append("heartbeat_s: must be > 0")
        if self.poison_max_deaths < 1:
            out.append("poison_max_deaths: must be >= 1")
        if self.chunk_tokens < 1:
            out.append("chunk_tokens: must be >= 1")
        if self.stream_interval < 1:
            out.append("stream_interval: must be >= 1")
        if not 0 <= self.stream_coalesce_ms <= 1000:
            out.append("stream_coalesce_ms: must be in [0, 1000]")
        if self.max_attempts < 1:
            out.append("max_attempts: must be >= 1")
        if self.stall_timeout_s <= 0 or self.request_timeout_s <= 0:
            out.append("stall_timeout_s and request_timeout_s: must be > 0")
        return out


@dataclass
class ChaosConfig:
    enabled: bool = _req()  # fault-injection code is imported only when this is true
    scenario: str = _req()  # "" or a scenario name
    kind: str = _req()
    trigger: str = _one_of("time", "step", "token", "action", "none")
    at: float = _req()  # trigger position: seconds, step, token index or action index
    victim_state: str = _one_of("serving", "paused", "refit", "any")
    probability: float = _req()
    count: int = _req()
    seed: int = _req()
    # A signal for a process on another Ray node goes through a task on that node, answered within this long.
    deliver_timeout_s: float = _req()

    # What must have happened for the scenario to count (belayer_plugin.chaos.check asserts each from the
    # report and the event log); names from CHAOS_EXPECTATIONS.
    expect: list[str] = _req()
    # Test-only: a CPU engine started by the fleet SIGKILLs itself on a prompt holding this token id
    # (a deterministic poison request). -1: off; passed to engines only when `enabled`.
    poison_token_id: int = _req()

    def problems(self) -> list[str]:
        out = []
        if not 0 <= self.probability <= 1:
            out.append("probability: must be in [0, 1]")
        if self.deliver_timeout_s <= 0:
            out.append("deliver_timeout_s: must be > 0")
        if self.count < 0:
            out.append("count: must be >= 0")
        for i, name in enumerate(self.expect):
            if name not in CHAOS_EXPECTATIONS:
                out.append(f"expect[{i}]: unknown {name!r}; known: {', '.join(CHAOS_EXPECTATIONS)}")
        return out


# The recoveries a chaos scenario can require (checked by belayer_plugin.chaos.check).
CHAOS_EXPECTATIONS = (
    "request_resumed_midway",  # a request resumed on another engine from a committed position > 0
    "handover",  # a standby took over the victim's slot
    "engine_replaced",  # the victim's slot got a new engine (handover or cold restart)
    "engine_detected",  # the monitor declared the victim dead
    "standby_replaced",  # the killed standby was replaced by a new one
    "refit_before_serving",  # the victim's replacement loaded the new weights before serving again
    "restored_from_checkpoint",  # the killed sandbox was restored from a checkpoint, not rebuilt
    "criu_restore",  # that restore brought processes back (CRIU), not only the file system
    "restore_retried",  # a killed restore was retried and then succeeded
    "checkpoint_discarded",  # the checkpoint the kill hit failed, was never published, left nothing behind
    "learner_restarted_from_checkpoint",  # a new learner resumed from the last checkpoint
)


@dataclass
class BelayerConfig:
    use_fault_tolerance: bool = _req()
    run_dir: str = _req()  # "" means runs/<timestamp> under the working directory
    cache_dir: str = _req()  # "" means ~/.cache/belayer
    ray: RayConfig = field(default_factory=RayConfig)
    engines: EnginesConfig = field(default_factory=EnginesConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    restart: RestartConfig = field(default_factory=RestartConfig)
    shadow: ShadowConfig = field(default_factory=ShadowConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    chaos: ChaosConfig = field(default_factory=ChaosConfig)

    def problems(self) -> list[str]:
        out = []
        if self.restart.min_healthy_engines > self.engines.num_engines:
            out.append("restart.min_healthy_engines: larger than engines.num_engines")
        return out


class ConfigError(ValueError):
    """A recipe is missing keys or has invalid values; `problems` lists every one with its dotted path."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid Belayer configuration ({len(self.problems)} problem(s)):\n{lines}")


def register_configs() -> None:
    """Registers the schema in Hydra's ConfigStore as group ``belayer``, name ``schema``."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="belayer", name="schema", node=BelayerConfig)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _check_scalar(value: Any, tp: Any) -> Optional[str]:
    """Returns a problem description, or None when `value` fits `tp`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errs = [_check_scalar(value, a) for a in args if a is not type(None)]
        return None if any(e is None for e in errs) else f"expected {_type_name(tp)}, got {value!r}"
    if origin is list:
        if not isinstance(value, (list, tuple, ListConfig)):
            return f"expected a list, got {value!r}"
        (item_tp,) = typing.get_args(tp) or (Any,)
        for i, v in enumerate(value):
            err = _check_scalar(v, item_tp)
            if err:
                return f"item {i}: {err}"
        return None
    if tp is Any:
        return None
    if tp is bool:
        return None if isinstance(value, bool) else f"expected true/false, got {value!r}"
    if tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        return None if ok else f"expected an integer, got {value!r}"
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else f"expected a number, got {value!r}"
    if tp is str:
        return None if isinstance(value, str) else f"expected a string, got {value!r}"
    return None


def _build(cls: type, raw: Any, path: str, problems: list[str]) -> Any:
    """Builds `cls` from a mapping, appending every problem found (with dotted paths) to `problems`."""
    if not isinstance(raw, (dict, DictConfig)):
        problems.append(f"{path}: expected a mapping, got {raw!r}")
        return None
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw.keys():
        if key not in names:
            problems.append(f"{path}.{key}: unknown key (known: {', '.join(sorted(names))})")
    kwargs: dict[str, Any] = {}
    ok = True
    for f in dataclasses.fields(cls):
        dotted = f"{path}.{f.name}"
        tp = hints[f.name]
        if f.name not in raw or raw[f.name] == MISSING:
            if dataclasses.is_dataclass(tp):
                _build(tp, {}, dotted, problems)  # name each leaf key of a missing section
            else:
                problems.append(f"{dotted}: missing")
            ok = False
            continue
        value = raw[f.name]
        if dataclasses.is_dataclass(tp):
            sub = _build(tp, value, dotted, problems)
            ok = ok and sub is not None
            kwargs[f.name] = sub
            continue
        err = _check_scalar(value, tp)
        choices = f.metadata.get("choices")
        if not err and choices and value not in choices:
            err = f"must be one of {list(choices)}, got {value!r}"
        if err:
            problems.append(f"{dotted}: {err}")
            ok = False
            continue
        if isinstance(value, ListConfig):
            value = list(value)
        if tp is float and isinstance(value, int):
            value = float(value)
        kwargs[f.name] = value
    if not ok:
        return None
    obj = cls(**kwargs)
    check = getattr(obj, "problems", None)
    if callable(check):
        problems.extend(f"{path}.{p}" for p in check())
    return obj


def validate_section(cls: type, raw: Any, path: str) -> Any:
    """Validates any config dataclass of the same kind (e.g. a trainer's own section) against `raw`."""
    if isinstance(raw, DictConfig):
        raw = OmegaConf.to_container(raw, resolve=True, throw_on_missing=False)
    problems: list[str] = []
    obj = _build(cls, raw if raw is not None else {}, path, problems)
    if problems:
        raise ConfigError(problems)
    return obj


def validate(raw: Any, path: str = "belayer") -> BelayerConfig:
    """Returns the typed config, or raises ConfigError naming every missing or invalid key at once."""
    if isinstance(raw, DictConfig):
        raw = OmegaConf.to_container(raw, resolve=True, throw_on_missing=False)
    problems: list[str] = []
    cfg = _build(BelayerConfig, raw, path, problems)
    if problems:
        raise ConfigError(problems)
    assert cfg is not None
    return cfg


def recipes_dir() -> Path:
    """The directory holding Belayer's recipes (the installed package's, which is the repo's in dev)."""
    import belayer_plugin.recipes as recipes

    return Path(recipes.__file__).resolve().parent


def load_recipe(recipe: str, overrides: Optional[list[str]] = None) -> DictConfig:
    """Composes a recipe (a name under recipes/, or a path to a YAML file) with Hydra overrides."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    path = Path(recipe)
    if path.suffix in (".yaml", ".yml") and path.exists():
        config_dir, name = path.resolve().parent, path.stem
        # A recipe outside recipes/ still finds the plugin's groups (belayer/default ...).
        search = [f"hydra.searchpath=[file://{recipes_dir()}]"]
    else:
        config_dir, name, search = recipes_dir(), recipe.removesuffix(".yaml"), []
        if not (config_dir / f"{name}.yaml").exists():
            known = sorted(p.relative_to(config_dir).with_suffix("").as_posix() for p in config_dir.rglob("*.yaml"))
            raise ConfigError([f"recipe {recipe!r} not found; known recipes: {', '.join(known)}"])
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name=name, overrides=list(overrides or []) + search)


def load_belayer_config(recipe: str, overrides: Optional[list[str]] = None) -> tuple[BelayerConfig, DictConfig]:
    """Loads a recipe and validates its ``belayer`` section; returns (typed config, whole recipe)."""
    cfg = load_recipe(recipe, overrides)
    if "belayer" not in cfg:
        raise ConfigError(["belayer: missing (add `defaults: [belayer: default, _self_]` to the recipe)"])
    return validate(cfg.belayer), cfg


def cache_dir(cfg: BelayerConfig) -> Path:
    """Where built artifacts (tiny model, env images) are cached."""
    base = cfg.cache_dir or os.environ.get("BELAYER_CACHE_DIR") or str(Path.home() / ".cache" / "belayer")
    return Path(base).expanduser()
