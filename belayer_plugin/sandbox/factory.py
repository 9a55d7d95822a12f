"""Building sandboxes, recorders and policies from a SandboxConfig (what the CLI and recipes use).

Owns: turning a SandboxConfig into objects. Must not: run sandboxes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional

from belayer_plugin.sandbox.base import Backend, EventSink, Sandbox, SandboxSpec
from belayer_plugin.sandbox.checkpoint import CheckpointStore
from belayer_plugin.sandbox.config import SandboxConfig
from belayer_plugin.sandbox.policy import CheckpointPolicy
from belayer_plugin.sandbox.trajectory import TrajectoryRecorder


def make_backend(cfg: SandboxConfig) -> Backend:
    """The configured container backend (Docker needs a reachable `dockerd --experimental`)."""
    if cfg.backend == "podman":
        from belayer_plugin.sandbox.podman import PodmanBackend

        return PodmanBackend(root=cfg.podman_root or None, criu_path=cfg.criu_path, exec_via=cfg.podman_exec)
    if cfg.backend == "docker":
        from belayer_plugin.sandbox.docker_backend import DockerBackend

        return DockerBackend(cfg.docker_host or None, criu_path=cfg.criu_path)
    raise ValueError(f"unknown sandbox backend {cfg.backend!r}")


def make_spec(cfg: SandboxConfig, image: str) -> SandboxSpec:
    from belayer_plugin.envs.definitions import get_env

    return SandboxSpec(image=image, command=list(get_env(cfg.env).command), cpus=cfg.cpus,
                       memory_mb=cfg.memory_mb, pids_limit=cfg.pids_limit, network=cfg.network)


def open_sandbox(cfg: SandboxConfig, backend: Optional[Backend] = None, sandbox_id: Optional[str] = None,
                 cache_dir: Optional[str | Path] = None, on_event: Optional[EventSink] = None) -> Sandbox:
    """Ensures the env image exists (built once, cached) and starts a sandbox from it."""
    from belayer_plugin.envs.build import ensure_image

    be = backend or make_backend(cfg)
    image = ensure_image(be, cfg.env, cfg.env_cache_dir or cache_dir or None)
    return Sandbox.create(be, make_spec(cfg, image), sandbox_id, cfg.exec_timeout_s, on_event)


def checkpoint_dir(cfg: SandboxConfig, run_dir: Optional[str | Path] = None) -> Path:
    """cfg.checkpoint_dir, else <run_dir>/sandbox-checkpoints, else a per-user cache directory."""
    if cfg.checkpoint_dir:
        return Path(cfg.checkpoint_dir)
    if run_dir:
        return Path(run_dir) / "sandbox-checkpoints"
    return Path(os.path.expanduser("~/.cache/belayer/sandbox-checkpoints"))


def make_recorder(cfg: SandboxConfig, sandbox: Sandbox, trajectory_id: str, run_dir: Optional[str | Path] = None,
                  setup: Optional[Callable[[Sandbox], None]] = None,
                  on_event: Optional[EventSink] = None) -> TrajectoryRecorder:
    from belayer_plugin.envs.definitions import get_env

    store = CheckpointStore(checkpoint_dir(cfg, run_dir), keep=cfg.keep_checkpoints)
    det = get_env(cfg.env).deterministic
    return TrajectoryRecorder(trajectory_id, sandbox, store, checkpoint_mode=cfg.checkpoint_mode,
                              checkpoint_timeout_s=cfg.checkpoint_timeout_s, restore_timeout_s=cfg.restore_timeout_s,
                              restore_retries=cfg.restore_retries, deterministic=det,
                              replay=cfg.replay_deterministic and det, setup=setup, on_event=on_event,
                              skip_unchanged=cfg.policy.skip_unchanged)


def make_policy(cfg: SandboxConfig, recorder: TrajectoryRecorder,
                on_event: Optional[EventSink] = None) -> CheckpointPolicy:
    return CheckpointPolicy.from_config(cfg.policy, recorder.checkpoint, subject=recorder.trajectory_id,
                                        on_event=on_event)
