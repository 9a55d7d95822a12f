"""Typed sandbox configuration. Defaults live once, in recipes/belayer/default.yaml under `sandbox:`.

Owns: the sandbox config dataclasses. Must not: hold defaults or import other sandbox modules (config.py
imports it: it is in the base layer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


def _req() -> Any:
    return field(default=MISSING)


def _one_of(*choices: str) -> Any:
    return field(default=MISSING, metadata={"choices": choices})


@dataclass
class SandboxPolicyConfig:
    """Adaptive checkpoint policy: checkpoint when failure_prob x work since the last one > visible overhead."""

    enabled: bool = _req()  # false: checkpoint after every committed action (or never, with every_n_actions=0)
    failure_prob: float = _req()  # probability that the environment fails during one action
    min_overhead_s: float = _req()  # floor of the visible cost of one checkpoint (freeze, CPU contention)
    every_n_actions: int = _req()  # also checkpoint at least every n actions; 0: adaptive decisions only
    async_checkpoint: bool = _req()  # overlap checkpoints with the next LLM generation
    cooldown_s: float = _req()  # after a checkpoint timed out or failed, no new attempt for this long
    overhead_ema: float = _req()  # weight of the newest measurement in the running estimates
    skip_unchanged: bool = _req()  # a boundary with no file-system or process side effect reuses the last checkpoint
    checkpoint_nice: int = _req()  # background checkpoints run this much nicer than the rollout (0: same priority)

    def problems(self) -> list[str]:
        out = []
        if not 0.0 <= self.failure_prob <= 1.0:
            out.append(f"failure_prob: must be in [0, 1], got {self.failure_prob}")
        if self.min_overhead_s < 0:
            out.append("min_overhead_s: must be >= 0")
        if self.every_n_actions < 0:
            out.append("every_n_actions: must be >= 0")
        if self.cooldown_s < 0:
            out.append("cooldown_s: must be >= 0")
        if not 0.0 < self.overhead_ema <= 1.0:
            out.append("overhead_ema: must be in (0, 1]")
        if not 0 <= self.checkpoint_nice <= 19:
            out.append(f"checkpoint_nice: must be in [0, 19], got {self.checkpoint_nice}")
        return out


@dataclass
class SandboxConfig:
    backend: str = _one_of("podman", "docker")
    env: str = _req()  # an environment of belayer_plugin.envs (busybox, python)
    network: str = _req()  # "none" unless a recipe asks for one (podman/docker network mode)
    cpus: float = _req()
    memory_mb: int = _req()
    pids_limit: int = _req()
    exec_timeout_s: float = _req()  # default per-command limit inside the sandbox
    checkpoint_mode: str = _one_of("full", "fs_only", "auto")  # auto: full if CRIU >= 4.2 works, else fs_only
    # "" -> <run_dir>/sandbox-checkpoints. On a cluster of several nodes: a path on a file system every node
    # mounts (NFS, CephFS, ...), so that another node restores a lost node's sandboxes; checked at start-up.
    placement: str = _one_of("driver", "spread")  # spread: a sandbox host on every node (sandbox/remote.py)
    host_timeout_s: float = _req()  # spread: a host silent this long past a call's own bound is lost
    checkpoint_dir: str = _req()
    shared_store_check_timeout_s: float = _req()  # each node's answer to that start-up check (sandbox/shared_store.py)
    checkpoint_timeout_s: float = _req()
    restore_timeout_s: float = _req()
    restore_retries: int = _req()  # attempts per checkpoint before falling back to an older one
    keep_checkpoints: int = _req()  # per trajectory; the previous one stays until a new one is published
    replay_deterministic: bool = _req()  # after a restore, replay logged actions exactly if the env allows
    criu_path: str = _req()  # "" -> /usr/local/sbin/criu, else criu on PATH
    env_cache_dir: str = _req()  # "" -> <cache_dir>/envs
    docker_host: str = _req()  # "" -> $DOCKER_HOST; the Docker backend needs `dockerd --experimental`
    podman_root: str = _req()  # "" -> podman's default storage
    podman_exec: str = _one_of("runc", "podman")  # how commands run in podman's containers (sandbox/podman.py)
    policy: SandboxPolicyConfig = field(default_factory=SandboxPolicyConfig)

    def problems(self) -> list[str]:
        out = []
        known_nets = ("none", "host", "bridge", "slirp4netns", "pasta", "private")
        if self.network not in known_nets and not self.network.startswith(("container:", "ns:")):
            out.append(f"network: {self.network!r} is not one of {list(known_nets)}")
        if self.cpus <= 0:
            out.append(f"cpus: must be > 0, got {self.cpus}")
        if self.memory_mb < 16:
            out.append(f"memory_mb: must be >= 16, got {self.memory_mb}")
        if self.pids_limit < 8:
            out.append(f"pids_limit: must be >= 8, got {self.pids_limit}")
        for name in ("exec_timeout_s", "checkpoint_timeout_s", "restore_timeout_s", "shared_store_check_timeout_s",
                     "host_timeout_s"):
            if getattr(self, name) <= 0:
                out.append(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.restore_retries < 1:
            out.append("restore_retries: must be >= 1")
        if self.keep_checkpoints < 1:
            out.append("keep_checkpoints: must be >= 1 (the previous checkpoint stays until a new one is published)")
        try:
            from belayer_plugin.envs.definitions import ENVS

            if self.env not in ENVS:
                out.append(f"env: unknown environment {self.env!r}; known: {sorted(ENVS)}")
        except ImportError:  # envs not importable: nothing to check against
            pass
        if self.backend == "docker" and self.podman_root:
            out.append("podman_root: set, but backend is docker")
        return out
