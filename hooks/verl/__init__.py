"""Belayer for verl 0.9.1. verl imports it at `import verl` through the `verl.plugins` entry point Belayer
installs (or `VERL_USE_EXTERNAL_MODULES=belayer_plugin.hooks.verl`).

Importing it registers Belayer's parts with verl:
- agent loop managers (`rollout.agent.agent_loop_manager_class`): `manager.BelayerAgentLoopManager` (v1
  trainer) and `manager.BelayerLegacyAgentLoopManager`: switch the rest on from the recipe alone;
- `BelayerCheckpointEngineManager` (`rollout.checkpoint_manager_class`, legacy trainer): dead replicas are
  removed before the next sleep / weight sync, restarted, synced and re-admitted (`ReplicaRecovery`);
- replica kind `belayer` (`rollout.name=belayer`, `BelayerReplica`): verl replicas whose servers are Belayer
  engines;
- `BelayerLoadBalancer`: `router_class` for `actor_rollout_ref.rollout.router_config_path` (evicts dead
  servers, admits recovered ones);
- `BelayerLLMServerClient`: token-level resume (chunked) on RayActorError, for
  `LLMServerManager.get_client(client_cls=...)`;
- agent loop `belayer_sandbox_agent` (`SandboxAgentLoop`): sandbox environments with full_checkpoint /
  full_restore and prefix-consistent rollback;
- `attach_fleet(fleet, balancer)`: the Belayer health monitor and restart policy driving the balancer's
  membership when the rollout servers are Belayer engines.
See recipes/verl/ for what a recipe adds.

Owns: registering Belayer's parts with verl. Must not: change verl's behaviour unless a recipe switches
Belayer on.
"""

from belayer_plugin.hooks.verl.balancer import BelayerLoadBalancer
from belayer_plugin.hooks.verl.client import BalancerSelector, BelayerLLMServerClient
from belayer_plugin.hooks.verl.fleet import FleetBridge, attach_fleet, fleet_servers
from belayer_plugin.hooks.verl.recovery import (
    BelayerCheckpointEngineManager,
    FleetBelowFloorError,
    ReplicaRecovery,
    ReplicaSyncError,
    track_checkpoint_managers,
)
from belayer_plugin.hooks.verl.replica import BelayerReplica, BelayerServer, register as _register_replica

_register_replica()
track_checkpoint_managers()


def router_config_path() -> str:
    """The installed recipes/verl/router.yaml, for `actor_rollout_ref.rollout.router_config_path`."""
    from belayer_plugin.config import recipes_dir

    return str(recipes_dir() / "verl" / "router.yaml")


def _recipe_path(relative: str) -> str:
    from belayer_plugin.config import recipes_dir

    path = recipes_dir() / relative
    if not path.is_file():
        raise FileNotFoundError(f"${{belayer_recipe:{relative}}}: no such Belayer recipe file ({path})")
    return str(path)


def _register_resolver() -> None:
    # verl needs absolute paths (router_config_path, agent_loop_config_path): recipes name Belayer's files as
    # ${belayer_recipe:verl/router.yaml}, resolved in whichever process reads them (all import this module)
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("belayer_recipe", _recipe_path, replace=True)


_register_resolver()


__all__ = ["router_config_path", "BelayerLoadBalancer", "BelayerLLMServerClient", "BalancerSelector", "FleetBridge",
           "attach_fleet", "fleet_servers", "BelayerCheckpointEngineManager", "ReplicaRecovery", "FleetBelowFloorError",
           "ReplicaSyncError",
           "BelayerReplica", "BelayerServer"]

try:  # the agent loop needs the sandbox package; a broken sandbox install must not hide the rest
    from belayer_plugin.hooks.verl.agent_loop import SandboxAgentLoop  # noqa: F401  (registers itself)

    __all__.append("SandboxAgentLoop")
except ImportError as _e:  # pragma: no cover
    import logging

    logging.getLogger("belayer.hooks.verl").warning("belayer_sandbox_agent not registered: %s", _e)
