"""Belayer for verl 0.9.1, loaded as an external module: `VERL_USE_EXTERNAL_MODULES=belayer_plugin.hooks.verl`.

Importing it registers Belayer's parts with verl:
- `BelayerLoadBalancer`: `router_class` for `actor_rollout_ref.rollout.router_config_path` (evicts dead
  servers, admits recovered ones);
- `BelayerLLMServerClient`: token-level resume (chunked) on RayActorError, for
  `LLMServerManager.get_client(client_cls=...)`;
- agent loop `belayer_sandbox_agent` (`SandboxAgentLoop`): sandbox environments with full_checkpoint /
  full_restore and prefix-consistent rollback;
- `attach_fleet(fleet, balancer)`: the Belayer health monitor and restart policy driving the balancer's
  membership when the rollout servers are Belayer engines.
See recipes/verl/ for what a recipe adds.
"""

from belayer_plugin.hooks.verl.balancer import BelayerLoadBalancer
from belayer_plugin.hooks.verl.client import BalancerSelector, BelayerLLMServerClient
from belayer_plugin.hooks.verl.fleet import FleetBridge, attach_fleet, fleet_servers



def router_config_path() -> str:
    """The installed recipes/verl/router.yaml, for `actor_rollout_ref.rollout.router_config_path`."""
    from belayer_plugin.config import recipes_dir

    return str(recipes_dir() / "verl" / "router.yaml")


__all__ = ["router_config_path", "BelayerLoadBalancer", "BelayerLLMServerClient", "BalancerSelector", "FleetBridge", "attach_fleet",
           "fleet_servers"]

try:  # the agent loop needs the sandbox package; a broken sandbox install must not hide the rest
    from belayer_plugin.hooks.verl.agent_loop import SandboxAgentLoop  # noqa: F401  (registers itself)

    __all__.append("SandboxAgentLoop")
except ImportError as _e:  # pragma: no cover
    import logging

    logging.getLogger("belayer.hooks.verl").warning("belayer_sandbox_agent not registered: %s", _e)
