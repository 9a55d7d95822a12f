"""Belayer for NeMo-RL's SGLang generation backend and environment registry (see generation.py, env.py).

    from belayer_plugin.hooks.nemo_rl import patch_nemo_rl, register_environments
    patch_nemo_rl()            # SGLangGeneration becomes the fault-tolerant subclass (toggle in the recipe)
    register_environments()    # env name "belayer_sandbox" in NeMo-RL's ENV_REGISTRY

Toggle per experiment: `policy.generation.sglang_cfg.use_fault_tolerance=true|false`; knobs under
`policy.generation.sglang_cfg.belayer` (recipes/nemo_rl/belayer.yaml).

Owns: the NeMo-RL hook's entry. Must not: hold logic (generation.py and env.py do).
"""

from belayer_plugin.hooks.nemo_rl.generation import (
    BelayerSGLangMixin,
    LoopThread,
    belayer_config_from_sglang_cfg,
    fault_tolerant,
    patch_nemo_rl,
)

__all__ = ["BelayerSGLangMixin", "LoopThread", "belayer_config_from_sglang_cfg", "fault_tolerant", "patch_nemo_rl",
           "register_environments", "SandboxEnvironment"]


def __getattr__(name: str):  # the environment pulls in the sandbox package and Ray actor classes: lazily
    if name in ("register_environments", "SandboxEnvironment", "SandboxEnvironmentActor"):
        from belayer_plugin.hooks.nemo_rl import env

        return getattr(env, name)
    raise AttributeError(name)
