"""Ray start-up: a local cluster on loopback with a per-run temp dir, or an existing cluster by address.

Owns: ray.init and its options. Must not: start engines or actors.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from belayer_plugin.config import RayConfig


def init_ray(cfg: RayConfig, **extra: Any) -> Any:
    """Starts or joins Ray according to `cfg`; a no-op when Ray is already initialised."""
    import ray

    if ray.is_initialized():
        return ray.get_runtime_context()
    if cfg.address:
        return ray.init(address=cfg.address, namespace=cfg.namespace, **extra)
    # Without this Ray rewrites 127.0.0.1 to the first interface's address, and the cluster listens there.
    # Ray reads the variable when it is imported: set it for the processes it starts, and patch the
    # constant in this (already importing) process.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0":
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
    # Ray's socket paths must stay under 108 bytes: keep the per-run temp dir short.
    tmp = cfg.tmp_dir or tempfile.mkdtemp(prefix="belayer-ray-", dir="/tmp")
    kwargs: dict[str, Any] = dict(
        namespace=cfg.namespace, include_dashboard=cfg.include_dashboard, _temp_dir=tmp,
        _node_ip_address="127.0.0.1", log_to_driver=False, configure_logging=True, logging_level="warning",
    )
    if cfg.include_dashboard:
        kwargs["dashboard_host"] = "127.0.0.1"
    if cfg.num_cpus:
        kwargs["num_cpus"] = cfg.num_cpus
    kwargs.update(extra)
    return ray.init(**kwargs)
