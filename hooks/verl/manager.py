"""Belayer's agent loop managers: what switches Belayer on in verl 0.9.1 from the recipe alone.

verl builds its agent loop manager from `actor_rollout_ref.rollout.agent.agent_loop_manager_class`, passing the
LLM client the trainer made (`LLMServerManager.get_client()`: verl's `LLMServerClient`, or
`FullyAsyncLLMServerClient` in the async v1 modes). Belayer's managers are verl's own classes with three
additions, and nothing else:
- the client becomes `BelayerLLMServerClient` over the same load balancer (token-level resume; in async modes
  weight-sync aborts are waited out, as verl's FullyAsyncLLMServerClient does);
- `rollout.full_determinism` reaches Belayer's balancer (verl passes it only to its built-in one);
- the trainer's replicas (verl's vLLMReplica / SGLangReplica or Belayer's kind) heal themselves: a lifecycle
  call that verl's own CheckpointEngineManager makes (sleep, wake_up, abort, resume, kv cache) first restarts
  a replica whose server actor died, through verl's own `launch_servers` with a fresh server list
  (`recovery.guard_replica`); before each rollout, restarted replicas that serve the current weights are
  re-admitted (v1 has no checkpoint manager option; the legacy trainer also has
  `BelayerCheckpointEngineManager`).
- per-step recovery metrics (`take_step_metrics`, names `belayer/...`) reach verl's own step metrics and its
  Tracking logger: the legacy manager adds them to `generate_sequences`' `meta_info["timing"]`, the v1 trainer
  reads them through `BelayerReplayBuffer` (hooks/verl/step_metrics.py says where verl picks them up).
With `belayer.use_fault_tolerance=false` they hand verl's own client through untouched and do nothing else.

- v1 trainer (`trainer.use_v1=true`, verl's default): `belayer_plugin.hooks.verl.manager.BelayerAgentLoopManager`
  (verl's AgentLoopManagerTQ: needs the TransferQueue package, as verl's v1 trainer itself does);
- legacy trainer: `belayer_plugin.hooks.verl.manager.BelayerLegacyAgentLoopManager` (verl's AgentLoopManager).

Owns: the agent loop managers a recipe names. Must not: hold recovery logic (hooks/verl/recovery.py does).
"""

from __future__ import annotations

import logging
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopManager
from verl.utils.ray_utils import auto_await
from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient, LLMServerClient

from belayer_plugin.config import BelayerConfig
from belayer_plugin.hooks._config import belayer_section
from belayer_plugin.hooks.verl.client import BelayerLLMServerClient
from belayer_plugin.hooks.verl.recovery import ReplicaRecovery, set_current_recovery
from belayer_plugin.metrics import StepMetrics

log = logging.getLogger("belayer.hooks.verl")

_current: Any = None  # this (trainer) process's manager, for BelayerReplayBuffer


def current_manager() -> Any:
    """The Belayer agent loop manager built last in this process (None before one is built)."""
    return _current


def belayer_client(llm_client: LLMServerClient, cfg: BelayerConfig) -> LLMServerClient:
    """The client Belayer's managers use in place of `llm_client` (itself when fault tolerance is off)."""
    if not cfg.use_fault_tolerance or isinstance(llm_client, BelayerLLMServerClient):
        return llm_client
    partial = isinstance(llm_client, FullyAsyncLLMServerClient)
    at = getattr(llm_client.config, "async_training", None)
    if partial and at is not None and not at.get("partial_rollout", True):
        partial = False  # verl drops aborted samples then (FullyAsyncLLMServerClient's should_retry)
    return BelayerLLMServerClient(llm_client.config, llm_client._load_balancer, partial_rollout=partial)


class BelayerManagerMixin:
    """The additions (see the module doc) over a verl agent loop manager class."""

    def __init__(self, config: Any, llm_client: LLMServerClient, *args: Any, **kwargs: Any):
        self.belayer = belayer_section(config.get("belayer"))
        super().__init__(config, belayer_client(llm_client, self.belayer), *args, **kwargs)
        self.recovery = None
        self.replicas: list = []
        if self.belayer.use_fault_tolerance:
            from belayer_plugin.hooks.verl.replica import replicas_in_process

            self.recovery = ReplicaRecovery(self.belayer, getattr(self.llm_client, "_load_balancer", None))
            # both trainers build their replicas (LLMServerManager) before the agent loop manager: those are
            # this run's; replicas another manager of this process claimed before are not
            self.replicas = [r for r in replicas_in_process() if getattr(r, "belayer_owner", None) is None]
            for r in self.replicas:
                r.belayer_owner = id(self)
                self.recovery.guard(r)  # verl's own replica kinds: heal inside verl's checkpoint manager calls
        set_current_recovery(self.recovery)  # the legacy trainer's BelayerCheckpointEngineManager uses it
        self.step_metrics = StepMetrics()  # this process's share; the balancer holds the workers' share
        if self.recovery is not None:
            self.recovery.events.subscribe(self.step_metrics.on_event)
        global _current
        _current = self

    @classmethod
    @auto_await
    async def create(cls, *args: Any, **kwargs: Any):
        instance = cls(*args, **kwargs)
        await instance._init_agent_loop_workers()
        await instance.configure_balancer()
        return instance

    async def configure_balancer(self) -> None:
        """Hands the trainer's `belayer.use_fault_tolerance` and `rollout.full_determinism` to Belayer's balancer
        (verl gives a router plugin neither, and overrides never reach the router YAML). With fault tolerance on,
        a balancer that is not Belayer's is refused here, at start-up, rather than at the first request."""
        lb = getattr(self.llm_client, "_load_balancer", None)
        if lb is None:
            return
        try:
            configure = lb.configure
        except AttributeError:  # a Ray actor handle has exactly its class's methods
            if self.belayer.use_fault_tolerance:
                raise ValueError(
                    "belayer.use_fault_tolerance=true needs Belayer's load balancer, and this run's router is "
                    f"{_actor_class(lb)}: set actor_rollout_ref.rollout.router_config_path="
                    "${belayer_recipe:verl/router.yaml} (recipes/verl/belayer.yaml has the line)") from None
            return
        await configure.remote(use_fault_tolerance=self.belayer.use_fault_tolerance,
                               full_determinism=bool(self.rollout_config.get("full_determinism", False)))

    @auto_await
    async def take_step_metrics(self) -> dict[str, float]:
        """Belayer's recovery metrics since the previous call, `belayer/<name>` (deltas; {} with fault
        tolerance off): this process's replica restarts and retirements, plus the balancer's deaths and the
        workers' resumed requests, saved tokens, failed requests, env restores and checkpoints."""
        if not self.belayer.use_fault_tolerance:
            return {}
        lb = getattr(self.llm_client, "_load_balancer", None)
        try:
            take = lb.take_step_metrics
        except AttributeError:
            take = None  # not Belayer's balancer: this process's counts only
        if take is not None:
            self.step_metrics.add(await take.remote())
        return self.step_metrics.take()

    async def heal_replicas(self) -> int:
        """Restarts dead replicas of this process and admits those that serve the current weights."""
        if self.recovery is None or not self.replicas:
            return 0
        return await self.recovery.heal_in_place(self.replicas)


def _actor_class(handle: Any) -> str:
    """The class name of a Ray actor handle (or the handle's type where it is not an actor)."""
    desc = getattr(handle, "_ray_actor_creation_function_descriptor", None)
    return getattr(desc, "class_name", None) or type(handle).__name__


class BelayerLegacyAgentLoopManager(BelayerManagerMixin, AgentLoopManager):
    """verl's AgentLoopManager (legacy trainer, `trainer.use_v1=false`) with Belayer's additions."""

    @auto_await
    async def generate_sequences(self, prompts: Any) -> Any:
        await self.heal_replicas()
        out = await super().generate_sequences(prompts)
        # verl's ray_trainer.fit merges meta_info["timing"] into the step's metrics as timing_s/<key> and logs
        # them with its Tracking logger (see hooks/verl/step_metrics.py). Validation rollouts (meta_info
        # "validate", ray_trainer._validate) do not log it: their counts stay for the next training step.
        if not (prompts.meta_info or {}).get("validate", False):
            out.meta_info.setdefault("timing", {}).update(await self.take_step_metrics())
        return out


def _v1_class() -> type:
    from verl.trainer.ppo.v1 import AgentLoopManagerTQ  # imports transfer_queue, as verl's v1 trainer does

    class BelayerAgentLoopManager(BelayerManagerMixin, AgentLoopManagerTQ):
        """verl's AgentLoopManagerTQ (v1 trainer, verl's default) with Belayer's additions."""

        def generate_sequences(self, prompts: Any) -> None:
            auto_await(self.heal_replicas)()
            return super().generate_sequences(prompts)

    BelayerAgentLoopManager.__module__ = __name__
    return BelayerAgentLoopManager


_lazy: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    # the v1 class only when asked for (verl's loader does getattr on this module): TransferQueue stays optional
    if name == "BelayerAgentLoopManager":
        if name not in _lazy:
            _lazy[name] = _v1_class()
        return _lazy[name]
    raise AttributeError(name)
