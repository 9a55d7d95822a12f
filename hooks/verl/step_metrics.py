"""Belayer's per-step recovery metrics in verl 0.9.1's own step metrics, logged by verl's `Tracking` logger
(wandb / tensorboard / mlflow / console ...), with no trainer code.

Where the counts come from: Belayer's balancer actor counts evictions of admitted servers (deaths) and
collects what the clients in verl's AgentLoopWorker actors report (requests resumed, tokens saved, requests
failed) and what `belayer_sandbox_agent` reports (env restores, checkpoints and their time); the agent loop
manager's `ReplicaRecovery` events (trainer process) give replica restarts and retirements.
`BelayerManagerMixin.take_step_metrics()` merges both and resets them: every value is the delta since the
previous take (see belayer_plugin/metrics.StepMetrics), zeros for a step without a fault.

How verl picks them up (verl 0.9.1, read from its source):
- legacy trainer (`trainer.use_v1=false`, verl/trainer/ppo/ray_trainer.py): `fit()` does
  `timing_raw.update(combined_gen_output.meta_info["timing"])` after `async_rollout_manager.generate_sequences`
  (line 1518), then `metrics.update(compute_timing_metrics(batch=batch, timing_raw=timing_raw))` (line 1783;
  verl/trainer/ppo/metric_utils.py line 645 names every entry `timing_s/<key>`) and
  `logger.log(data=metrics, step=self.global_steps)` (line 1802). Belayer's legacy manager puts the take into
  that `meta_info["timing"]`, so the logger gets `timing_s/belayer/<name>` (as verl's own
  `timing_s/agent_loop/num_preempted/max`).
- v1 trainer (verl/trainer/ppo/v1/trainer_base.py): `_step_once` does
  `batch, off_policy_metrics = self.replay_buffer.sample(...)` then `metrics.update(off_policy_metrics)`
  (lines 567-572); `step()` reduces the iterations with `MetricsAggregator` (line 559) and `fit()` calls
  `self.logger.log(data=metrics, step=self.global_steps)` (line 514). The replay buffer class is verl's
  extension point `trainer.v1.sampler.custom_sampler.{path,name}` (`_build_replay_buffer`, line 139):
  `BelayerReplayBuffer` is verl's ReplayBuffer (ReplayBufferAsync in the async modes) whose `sample()` adds
  the take, so the logger gets `belayer/<name>`. With `trainer.v1.<mode>.parameter_sync_step` > 1 verl's
  aggregator averages the per-iteration values of a step (the `*_max` ones: their maximum).

Owns: Belayer's metrics in verl's step metrics. Must not: change what verl logs beyond adding Belayer's keys.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from omegaconf import open_dict

from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync  # imports TransferQueue, as v1 does

from belayer_plugin.hooks.verl.manager import current_manager

log = logging.getLogger("belayer.hooks.verl")


class BelayerReplayBuffer(ReplayBuffer):
    """verl's v1 replay buffer (sync mode; ReplayBufferAsync's sampling in the async modes) whose `sample()`
    also returns Belayer's step metrics. Name it in the recipe:
    `trainer.v1.sampler.custom_sampler.path=pkg://belayer_plugin.hooks.verl.step_metrics`,
    `trainer.v1.sampler.custom_sampler.name=BelayerReplayBuffer`.

    Built as verl builds its own buffer: verl gives a custom sampler only the base arguments (no DAPO
    `filter_groups_metric`, `sync_refill_failed_groups`, `train_batch_size`, `gen_batch_size`,
    `max_inflight_gen_batches`: trainer_base.py `_build_replay_buffer`), so the buffer is verl's own
    `_build_replay_buffer` run on the trainer's config without the custom sampler (the trainer is the owner
    of the `refill_fn` verl passes), then given this class. Only a buffer built outside verl's trainer keeps
    the base arguments it was given."""

    def __new__(cls, *args: Any, trainer_mode: str = "sync", refill_fn: Any = None, **kwargs: Any):
        trainer = getattr(refill_fn, "__self__", None)
        if cls is BelayerReplayBuffer and hasattr(trainer, "_build_replay_buffer"):
            return _verls_own(trainer)
        if cls is BelayerReplayBuffer and trainer_mode != "sync":
            cls = BelayerReplayBufferAsync  # as verl's _build_replay_buffer picks its own two
        log.warning("BelayerReplayBuffer built outside verl's trainer: verl's DAPO/refill settings are not known")
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any):
        if getattr(self, "_built_by_verl", False):
            return  # Python calls __init__ again with the custom sampler's reduced arguments: keep verl's
        super().__init__(*args, **kwargs)

    def sample(self, global_steps: int, partition_id: str, batch_size: int):
        batch, metrics = super().sample(global_steps, partition_id, batch_size)
        manager = current_manager()
        if manager is not None and partition_id != "val":
            metrics = {**metrics, **manager.take_step_metrics()}
        return batch, metrics


def _verls_own(trainer: Any) -> "BelayerReplayBuffer":
    """The buffer verl's trainer builds with no custom sampler, as a BelayerReplayBuffer(Async)."""
    view = copy.copy(trainer)  # the buffer is built in the trainer's __init__: a few attributes, shared
    view.config = copy.deepcopy(trainer.config)
    with open_dict(view.config):
        view.config.trainer.v1.sampler.custom_sampler = None
    rb = type(trainer)._build_replay_buffer(view)
    rb.refill_fn = trainer._add_prompts_to_generate  # the trainer's, not the view's (a snapshot of its __init__)
    rb.__class__ = BelayerReplayBufferAsync if isinstance(rb, ReplayBufferAsync) else BelayerReplayBuffer
    rb._built_by_verl = True
    return rb


class BelayerReplayBufferAsync(BelayerReplayBuffer, ReplayBufferAsync):
    """BelayerReplayBuffer over verl's ReplayBufferAsync (colocate_async, separate_async)."""
