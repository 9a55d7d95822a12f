"""A sandbox environment for NeMo-RL, registered through its environment registry (nemo_rl/environments/utils.py:
`register_env(name, actor_class_fqn)`, `create_env` builds `actor_class.options(...).remote(env_config)`).

`step(message_log_batch, metadata)` runs the last assistant message's ```bash block in the trajectory's
sandbox as one TrajectoryRecorder action and returns the output as the next observation. The checkpoint
policy snapshots the sandbox between actions (full_checkpoint). When the sandbox fails, the recorder restores
the newest usable checkpoint (full_restore). NeMo-RL's interface lets an environment append observations but
not truncate the message log, so prefix consistency is kept this way: if the restore reached the last
committed boundary (or replayed committed actions exactly, for environments declared deterministic), the
failed action is reported as not applied and the episode goes on; otherwise the episode ends with
`metadata["belayer"]["inconsistent"] = True` and reward 0, so the sample can be dropped, never trained on a
context that disagrees with the environment.

Owns: the NeMo-RL sandbox environment. Must not: choose engines.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

from belayer_plugin.config import BelayerConfig
from belayer_plugin.hooks._config import belayer_section

COMMAND = re.compile(r"```(?:bash|sh)\s*\n(.*?)```", re.S)
SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
ENV_NAME = "belayer_sandbox"
ACTOR_FQN = "belayer_plugin.hooks.nemo_rl.env.SandboxEnvironmentActor"


class SandboxEnvironment:
    """NeMo-RL EnvironmentInterface shape; `env_config` is the recipe's `belayer` section (validated here)."""

    def __init__(self, env_config: Optional[dict] = None, provider: Optional[Callable] = None):
        self.cfg: BelayerConfig = belayer_section((env_config or {}).get("belayer", env_config))
        self.provider = provider
        self.trajectories: dict[str, Any] = {}  # trajectory id -> (recorder, policy)

    def _open(self, tid: str):
        from belayer_plugin.sandbox.policy import CheckpointPolicy
        from belayer_plugin.sandbox.trajectory import TrajectoryRecorder

        if self.provider is not None:
            sb, store, setup = self.provider(tid, self.cfg)
        else:
            from belayer_plugin.hooks.verl.agent_loop import sandbox_from_config  # noqa: PLC0415

            sb, store, setup = sandbox_from_config(tid, self.cfg)
        sc = self.cfg.sandbox
        rec = TrajectoryRecorder(tid, sb, store, checkpoint_mode=sc.checkpoint_mode,
                                 checkpoint_timeout_s=sc.checkpoint_timeout_s, restore_timeout_s=sc.restore_timeout_s,
                                 restore_retries=sc.restore_retries, deterministic=sc.replay_deterministic,
                                 replay=sc.replay_deterministic, setup=setup)
        rec.start([], [], checkpoint=self.cfg.use_fault_tolerance)
        pol = CheckpointPolicy.from_config(sc.policy, rec.checkpoint, subject=tid)
        self.trajectories[tid] = (rec, pol)
        return rec, pol

    def step(self, message_log_batch: list[list[dict]], metadata: list[dict]) -> Any:
        obs, metas, rewards, done = [], [], [], []
        for log, meta in zip(message_log_batch, metadata):
            o, m, r, d = self._step_one(log, dict(meta or {}))
            obs.append(o), metas.append(m), rewards.append(r), done.append(d)
        return _env_return(obs, metas, rewards, done)

    def _step_one(self, log: list[dict], meta: dict):
        from belayer_plugin.sandbox.base import SandboxError

        tid = meta.setdefault("trajectory_id", f"traj-{id(log):x}")
        rec, pol = self.trajectories.get(tid) or self._open(tid)
        text = str(log[-1].get("content", "")) if log else ""
        found = COMMAND.search(text)
        if found is None or SUBMIT in text:
            self._close(tid)
            return {"role": "environment", "content": ""}, meta, 0.0, True
        sc = self.cfg.sandbox
        command = found.group(1).strip()
        try:
            pol.wait_ready(sc.checkpoint_timeout_s)
            rec.begin_action({"command": command, "timeout": sc.exec_timeout_s})
            res = rec.sandbox.exec(command, timeout=sc.exec_timeout_s)
            b = rec.commit([], [dict(m) for m in log], {"returncode": res.exit_code})
            pol.note_work(0.0, "generation", action_done=True)
            if self.cfg.use_fault_tolerance:
                pol.maybe_checkpoint_async(b)
            return {"role": "environment", "content": f"<returncode>{res.exit_code}</returncode>\n{res.output}"}, meta, 0.0, False
        except SandboxError as e:
            if not self.cfg.use_fault_tolerance:
                raise
            pol.wait_ready(sc.checkpoint_timeout_s)
            rb = rec.recover(f"{type(e).__name__}: {e}")
            pol.reset()
            consistent = rb.boundary == rb.failed_boundary or (sc.replay_deterministic and rb.discarded_actions == 0)
            meta["belayer"] = {"recovered": True, "restored_boundary": rb.boundary,
                               "failed_boundary": rb.failed_boundary, "inconsistent": not consistent}
            if not consistent:
                self._close(tid)
                return {"role": "environment", "content": "environment failure"}, meta, 0.0, True
            return ({"role": "environment", "content": "<returncode>-1</returncode>\nthe environment failed; the command "
                     "was not applied and the environment is as after the previous command"}, meta, 0.0, False)

    def _close(self, tid: str) -> None:
        from belayer_plugin.sandbox.base import SandboxError

        rec, pol = self.trajectories.pop(tid, (None, None))
        if pol is not None:
            pol.close()
        if rec is not None:
            try:
                rec.sandbox.close()
            except SandboxError:
                pass

    def global_post_process_and_metrics(self, batch: Any) -> tuple[Any, dict]:
        return batch, {}

    def shutdown(self) -> None:
        for tid in list(self.trajectories):
            self._close(tid)


def _env_return(obs, metas, rewards, done):
    import torch

    try:
        from nemo_rl.environments.interfaces import EnvironmentReturn  # noqa: PLC0415  (NeMo-RL only)
    except ImportError:
        from collections import namedtuple

        EnvironmentReturn = namedtuple("EnvironmentReturn", "observations metadata next_stop_strings rewards "
                                                            "terminateds answers")
    return EnvironmentReturn(obs, metas, [None] * len(obs), torch.tensor(rewards), torch.tensor(done), None)


def _actor_class():
    import ray

    return ray.remote(SandboxEnvironment)


SandboxEnvironmentActor = _actor_class()


def register_environments(register_env: Optional[Callable[[str, str], None]] = None,
                          actor_env_registry: Optional[dict] = None, python_executable: Optional[str] = None) -> str:
    """Registers `belayer_sandbox` with NeMo-RL's environment registry (and the actor's Python environment);
    idempotent. The arguments default to NeMo-RL's own registry functions. Returns the env name."""
    if register_env is None:
        from nemo_rl.environments.utils import ENV_REGISTRY  # noqa: PLC0415  (NeMo-RL only)
        from nemo_rl.environments.utils import register_env as _register

        register_env = None if ENV_NAME in ENV_REGISTRY else _register
    if actor_env_registry is None:
        try:
            from nemo_rl.distributed.ray_actor_environment_registry import ACTOR_ENVIRONMENT_REGISTRY  # noqa: PLC0415
            from nemo_rl.distributed.virtual_cluster import PY_EXECUTABLES  # noqa: PLC0415

            actor_env_registry, python_executable = ACTOR_ENVIRONMENT_REGISTRY, python_executable or PY_EXECUTABLES.SYSTEM
        except ImportError:
            actor_env_registry = None
    if register_env is not None:
        try:
            register_env(ENV_NAME, ACTOR_FQN)
        except ValueError:  # already registered
            pass
    if actor_env_registry is not None:
        actor_env_registry.setdefault(ACTOR_FQN, python_executable)
    return ENV_NAME
