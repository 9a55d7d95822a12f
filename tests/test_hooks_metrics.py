"""Belayer's per-step recovery metrics in the trainers' own step metrics: merging across processes, and verl's v1
route built by verl's own code from the recipe. The real-fault checks are in the engine tests that already run a
fault (no extra engine start): tests/test_hooks_verl_replicas.py (legacy trainer: `timing_s/belayer/...` through
verl's compute_timing_metrics) and tests/test_hooks_nemo_rl.py (NeMo-RL: `get_step_metrics`)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from belayer_plugin.events import EventLog
from belayer_plugin.metrics import STEP_METRICS, StepMetrics

ROOT = Path(__file__).resolve().parents[1]


def test_counts_from_other_processes_merge_as_deltas_maxima_stay_maxima_and_unknown_names_are_refused():
    m = StepMetrics()
    ev = EventLog()
    ev.subscribe(m.on_event)
    ev.emit("verl", "replica-0", "restarted", "incarnation 2")  # a verl replica restarted by ReplicaRecovery
    ev.emit("verl", "replica-0", "evicted", "actor gone")  # counted where it is evicted (the balancer), not here
    m.add({"belayer/engine_deaths_detected": 1, "requests_resumed": 2, "tokens_saved": 16, "detection_s_max": 0.3})
    m.add({"belayer/requests_resumed": 1, "tokens_saved": 8, "detection_s_max": 0.1})
    with pytest.raises(KeyError, match="engine_death"):
        m.add({"engine_death": 1})  # a typo never becomes a silent new series
    got = m.take()
    assert set(got) == {f"belayer/{n}" for n in STEP_METRICS}
    assert got["belayer/cold_restarts"] == 1 and got["belayer/engine_deaths_detected"] == 1
    assert got["belayer/requests_resumed"] == 3 and got["belayer/tokens_saved"] == 24
    assert got["belayer/detection_s_max"] == 0.3
    assert set(m.take().values()) == {0.0}


def _verl_config(ft: bool = True, dapo: bool = False, mode: str = "sync"):
    """verl's own generated ppo_trainer config with recipes/verl/belayer.yaml over it."""
    import verl
    from omegaconf import OmegaConf

    base = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), "trainer", "config",
                                       "_generated_ppo_trainer.yaml"))
    cfg = OmegaConf.merge(base, OmegaConf.load(ROOT / "recipes" / "verl" / "belayer.yaml"))
    OmegaConf.set_struct(cfg, False)
    cfg.belayer.use_fault_tolerance = ft
    cfg.algorithm.filter_groups.enable = dapo
    cfg.trainer.v1.trainer_mode = mode
    return cfg


def test_verl_v1_builds_belayers_replay_buffer_from_the_recipe_with_every_setting_verl_gives_its_own():
    """verl's trainer gives a custom sampler no DAPO / refill settings; the recipe's BelayerReplayBuffer must
    still get exactly what verl's built-in buffer gets for the same config (read from verl's own build)."""
    pytest.importorskip("verl", reason="verl 0.9.1 not installed (bash .ci/setup_verl.sh)")
    pytest.importorskip("transfer_queue", reason="verl's v1 trainer needs TransferQueue (bash .ci/setup_verl.sh)")
    import copy

    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync
    from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from belayer_plugin.hooks.verl.step_metrics import BelayerReplayBuffer, BelayerReplayBufferAsync

    def built(cfg, mode):
        # verl's own PPOTrainer._build_replay_buffer on the mode's trainer class, called as PPOTrainer.__init__ calls it (the trainer's
        # other attributes are not read there)
        trainer = object.__new__(PPOTrainerColocateAsync if mode == "colocate_async" else PPOTrainerSync)
        trainer.config, trainer.trainer_mode = cfg, mode
        return trainer, trainer._build_replay_buffer()

    settings = ("trainer_mode", "max_off_policy_threshold", "max_off_policy_strategy", "filter_groups_metric",
                "train_batch_size", "gen_batch_size", "max_inflight_gen_batches", "sync_refill_failed_groups")
    for mode, dapo, refill, cls, base in (("sync", False, False, BelayerReplayBuffer, ReplayBuffer),
                                          ("sync", True, False, BelayerReplayBuffer, ReplayBuffer),
                                          ("sync", False, True, BelayerReplayBuffer, ReplayBuffer),
                                          ("colocate_async", False, True, BelayerReplayBufferAsync, ReplayBufferAsync)):
        cfg = _verl_config(mode=mode, dapo=dapo)
        cfg.algorithm.filter_groups.max_inflight_gen_batches = 3
        cfg.trainer.v1.sampler.sync_refill_failed_groups = refill
        cfg.data.train_batch_size, cfg.data.gen_batch_size = 8, 12
        trainer, rb = built(cfg, mode)
        assert type(rb) is cls and isinstance(rb, base), type(rb)
        # the mode's own sampling (ReplayBufferAsync.sample in the async modes), with Belayer's metrics added
        assert type(rb).__mro__.index(base) > type(rb).__mro__.index(BelayerReplayBuffer)
        verls = copy.deepcopy(cfg)
        verls.trainer.v1.sampler.custom_sampler = None
        _, want = built(verls, mode)
        assert type(want) is base
        got = {k: getattr(rb, k, None) for k in settings}
        assert got == {k: getattr(want, k, None) for k in settings}, (mode, dapo, refill)
        if dapo:
            assert got["filter_groups_metric"] == "reward" and got["max_inflight_gen_batches"] == 3
        assert rb.refill_fn.__self__ is trainer  # refills go to the trainer itself


def test_verl_managers_take_belayers_step_metrics_as_deltas_and_nothing_when_off():
    pytest.importorskip("verl", reason="verl 0.9.1 not installed (bash .ci/setup_verl.sh)")
    from verl.workers.rollout.llm_server import LLMServerClient

    from belayer_plugin.hooks.verl.manager import BelayerLegacyAgentLoopManager, current_manager

    for ft in (True, False):
        cfg = _verl_config(ft=ft)
        cfg.actor_rollout_ref.rollout.name = "vllm"
        m = BelayerLegacyAgentLoopManager(config=cfg, llm_client=LLMServerClient(cfg, None))
        assert current_manager() is m  # what BelayerReplayBuffer.sample takes the step's metrics from
        if not ft:
            assert m.take_step_metrics() == {}  # off: verl's metrics unchanged
            continue
        m.recovery.events.emit("verl", "replica-1", "restarted", "incarnation 2")
        first = m.take_step_metrics()
        assert first["belayer/cold_restarts"] == 1 and set(first) == {f"belayer/{n}" for n in STEP_METRICS}
        assert set(m.take_step_metrics().values()) == {0.0}, "not a delta per step"
