"""Belayer under NeMo-RL's SGLang generation backend (written against nemo_rl/models/generation/sglang/
sglang_generation.py, `SGLangGeneration(cluster, sglang_cfg)`; NeMo-RL is not installable from PyPI, so this
is checked against a stand-in with the same interface, see tests/test_hooks_nemo_rl.py).

`fault_tolerant(SGLangGeneration)` returns a subclass. With `policy.generation.sglang_cfg.use_fault_tolerance`
false it is NeMo-RL's class unchanged. With it true, a Belayer fleet owns the SGLang engines and the
sglang-router (health monitor with Ray liveness in every phase, bounded restarts, confirmed router membership,
weight-version fencing) and the NeMo-RL methods map onto it:

- `finish_generation()`  -> fleet.pause(release_memory=needs_offload): readiness probes stop, Ray liveness
  keeps watching, so a death while training is detected and repaired before the next rollout;
- `prepare_for_generation()` -> fleet.resume() (memory back where released, readiness probes again);
- `get_rollout_engine_urls()` (what NeMo-RL's refit streams weights to) -> fleet.recover_dead() first: it
  waits for recoveries under way and is a no-op (returns at once, resets nothing) when nothing died; then the
  URLs of the serving engines only;
- a dead engine is deregistered from the router (and the removal confirmed) before it is killed; its
  replacement is registered only when HEALTHY at the current weight version;
- `invalidate_kv_cache()` -> /flush_cache on every serving engine; `shutdown()` -> fleet.shutdown();
- `belayer.chaos` (off by default) injects Belayer's chaos kinds into this fleet; the `step` trigger counts
  prepare_for_generation calls, `victim_state` paused/serving follows finish/prepare.
NeMo-RL's own generate path is untouched: it posts to `router_ip:router_port`, which is the fleet's router.
Knobs: `policy.generation.sglang_cfg.belayer` (a `belayer` section over recipes/belayer/default.yaml),
validated at construction with every problem named at once.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse

from belayer_plugin.config import BelayerConfig, ConfigError
from belayer_plugin.hooks._config import belayer_section


def belayer_config_from_sglang_cfg(sglang_cfg: dict) -> BelayerConfig:
    """The toggle and knobs from NeMo-RL's `policy.generation` (SGLangConfig); raises ConfigError naming all."""
    inner = (sglang_cfg or {}).get("sglang_cfg")
    if inner is None:
        raise ConfigError(["policy.generation.sglang_cfg: missing"])
    toggle = inner.get("use_fault_tolerance", False)
    problems = []
    if not isinstance(toggle, bool):
        problems.append(f"policy.generation.sglang_cfg.use_fault_tolerance: must be true or false, got {toggle!r}")
        toggle = False
    section = dict(inner.get("belayer") or {})
    engines = dict(section.get("engines") or {})
    if inner.get("model_path") and not engines.get("model_path"):
        engines["model_path"] = inner["model_path"]  # the policy's model unless the knobs say otherwise
    section["engines"] = engines
    try:
        cfg = belayer_section(section, use_fault_tolerance=toggle, path="policy.generation.sglang_cfg.belayer")
    except ConfigError as e:
        raise ConfigError(problems + list(e.problems)) from None
    if problems:
        raise ConfigError(problems)
    if cfg.use_fault_tolerance and cfg.router.mode != "sglang_router":
        raise ConfigError(["policy.generation.sglang_cfg.belayer.router.mode: NeMo-RL posts to a router; "
                           "must be sglang_router"])
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
        self.belayer = belayer_config_from_sglang_cfg(sglang_cfg)
        if not self.belayer.use_fault_tolerance:
            super().__init__(cluster, sglang_cfg, *args, **kwargs)
            return
        from belayer_plugin.events import EventLog
        from belayer_plugin.fleet.manager import FleetManager

        self.cluster, self.sglang_cfg = cluster, sglang_cfg
        server_cfg = sglang_cfg["sglang_cfg"].get("sglang_server_config") or {}
        self.needs_offload = bool(server_cfg.get("needs_offload", False))
        run_dir = Path(self.belayer.run_dir or "runs/belayer-nemo-rl")
        run_dir.mkdir(parents=True, exist_ok=True)
        self.belayer_events = EventLog(run_dir / "events.jsonl")
        self.belayer_loop = LoopThread()

        async def make() -> FleetManager:  # built on the loop that will run it
            return FleetManager(self.belayer, run_dir, self.belayer_events)

        self.belayer_fleet = self.belayer_loop.run(make(), 30)
        try:
            self.belayer_loop.run(self.belayer_fleet.start(), self.belayer.engines.startup_timeout_s * 2)
        except BaseException:
            self.belayer_loop.run(self.belayer_fleet.shutdown(), 120)
            self.belayer_loop.stop()
            raise
        from belayer_plugin.hooks._chaos import attach_chaos

        self.belayer_step = 0  # rollouts started (the chaos `step` trigger counts these)
        self.belayer_chaos = attach_chaos(self.belayer, self.belayer_fleet)
        u = urlparse(self.belayer_fleet.url)
        self.router_ip, self.router_port = u.hostname, u.port
        self._router_actor = None
        self._init_nemo_rl_client_side(sglang_cfg)

    def _init_nemo_rl_client_side(self, sglang_cfg: dict) -> None:
        """What NeMo-RL's generate path needs besides the router (its own helpers, from its own module)."""
        mro = type(self).__mro__
        mod = sys.modules.get(mro[mro.index(BelayerSGLangMixin) + 1].__module__)  # the wrapped class's module
        if mod is not None and hasattr(mod, "AsyncLoopThread") and hasattr(mod, "HttpClient"):
            self._async_loop = mod.AsyncLoopThread()
            self._http_client = mod.HttpClient(sglang_cfg)

    # ----------------------------------------------------------------- NeMo-RL's interface
    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        if self.belayer_fleet is None:
            return super().prepare_for_generation(*args, **kwargs)
        self.belayer_loop.run(self.belayer_fleet.resume(), 600)
        self.belayer_step += 1
        self._chaos_phase("serving")
        return True

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
        if self.belayer_fleet is None:
            return super().get_rollout_engine_urls()
        self.recover_before_refit()
        return [s.info.url for s in self.belayer_fleet.serving_slots()]

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

        async def flush() -> bool:
            slots = self.belayer_fleet.serving_slots()
            rs = await asyncio.gather(*(s.actor.call.remote("POST", "/flush_cache", None) for s in slots),
                                      return_exceptions=True)
            return all(isinstance(r, dict) and r.get("status") == 200 for r in rs)

        return self.belayer_loop.run(flush(), 120)

    def shutdown(self) -> bool:
        if self.belayer_fleet is None:
            return super().shutdown()
        if self.belayer_chaos is not None:
            self.belayer_chaos.stop()
        try:
            self.belayer_loop.run(self.belayer_fleet.shutdown(), 120)
        finally:
            self.belayer_loop.stop()
            self.belayer_fleet = None
        return True


def fault_tolerant(generation_cls: type) -> type:
    """`fault_tolerant(nemo_rl.models.generation.sglang.sglang_generation.SGLangGeneration)`."""
    return type(f"Belayer{generation_cls.__name__}", (BelayerSGLangMixin, generation_cls),
                {"__module__": __name__, "__doc__": f"{generation_cls.__name__} under a Belayer fleet."})


def patch_nemo_rl() -> type:
    """Makes NeMo-RL construct the fault-tolerant class wherever it imports SGLangGeneration (call before
    building the policy generation, e.g. at the top of your run script). Returns the class."""
    import nemo_rl.models.generation.sglang.sglang_generation as m  # noqa: PLC0415  (NeMo-RL only)

    if not getattr(m.SGLangGeneration, "_belayer", False):
        cls = fault_tolerant(m.SGLangGeneration)
        cls._belayer = True
        m.SGLangGeneration = cls
        for name in ("nemo_rl.models.generation.sglang", "nemo_rl.algorithms.grpo"):
            mod = sys.modules.get(name)
            if mod is not None and hasattr(mod, "SGLangGeneration"):
                setattr(mod, "SGLangGeneration", cls)
    return m.SGLangGeneration
