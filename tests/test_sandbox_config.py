"""SandboxConfig: defaults come from the recipe; problems() names bad fields."""

from __future__ import annotations

import dataclasses

from omegaconf import MISSING

from belayer_plugin.sandbox.config import SandboxConfig, SandboxPolicyConfig


def good() -> SandboxConfig:
    pol = SandboxPolicyConfig(enabled=True, failure_prob=0.02, min_overhead_s=0.05, every_n_actions=0,
                              async_checkpoint=True, cooldown_s=20.0, overhead_ema=0.3, skip_unchanged=True,
                              checkpoint_nice=10)
    return SandboxConfig(backend="podman", env="busybox", network="none", cpus=1.0, memory_mb=512, pids_limit=256,
                         exec_timeout_s=60.0, checkpoint_mode="auto", placement="driver", host_timeout_s=30.0, checkpoint_dir="",
                         shared_store_check_timeout_s=30.0, checkpoint_timeout_s=30.0,
                         restore_timeout_s=60.0, restore_retries=2, keep_checkpoints=2, replay_deterministic=False,
                         criu_path="", env_cache_dir="", docker_host="", podman_root="", podman_exec="runc", policy=pol)


def test_fields_have_no_defaults_in_code():
    for cls in (SandboxConfig, SandboxPolicyConfig):
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(f.type) or f.name == "policy":
                continue
            assert f.default is MISSING, f"{cls.__name__}.{f.name} has a default in code"


def test_valid_config_has_no_problems():
    assert good().problems() == [] and good().policy.problems() == []


def test_problems_name_the_bad_fields():
    c = dataclasses.replace(good(), cpus=0.0, memory_mb=4, keep_checkpoints=0, env="nope", network="weird",
                            restore_timeout_s=0.0)
    text = "\n".join(c.problems())
    for name in ("cpus", "memory_mb", "keep_checkpoints", "env", "network", "restore_timeout_s"):
        assert name + ":" in text
    p = dataclasses.replace(good().policy, failure_prob=1.5, overhead_ema=0.0, checkpoint_nice=25)
    assert any(s.startswith("failure_prob:") for s in p.problems())
    assert any(s.startswith("checkpoint_nice:") for s in p.problems())
    assert any(s.startswith("overhead_ema:") for s in p.problems())


def test_recipe_defaults_validate_and_keep_sandboxes_offline():
    from belayer_plugin.config import load_belayer_config

    cfg, _ = load_belayer_config("fleet_demo")
    assert cfg.sandbox.network == "none"
    assert cfg.sandbox.policy.cooldown_s == 20.0
    assert cfg.sandbox.checkpoint_mode in ("full", "fs_only", "auto")
