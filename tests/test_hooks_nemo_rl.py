"""The NeMo-RL hook against a stand-in with SGLangGeneration's interface (NeMo-RL is not installable from PyPI),
a real Belayer fleet underneath (CPU engines, the real sglang-router), and real kills.

Verified here: the toggle and knobs are read from `policy.generation.sglang_cfg` and validated all at once;
toggle off is the wrapped class unchanged; finish_generation pauses with Ray liveness still on (an engine
killed while paused is detected, deregistered from the router, fenced and restarted before the next rollout);
prepare_for_generation resumes; get_rollout_engine_urls recovers first and is a no-op when nothing died;
NeMo-RL's own request shape (its generate_one_sample posts input_ids to router_ip:router_port) gets the same
ids after recovery; the environment registers through a registry with register_env's contract, and its step()
survives a real container kill consistently; recipes/nemo_rl/belayer.yaml validates.
Not verified: NeMo-RL's real classes, its refit (stream_weights_via_http), its rollout loop, create_env's
runtime_env/py_executable handling.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from belayer_plugin.config import ConfigError
from belayer_plugin.hooks.nemo_rl import belayer_config_from_sglang_cfg, fault_tolerant
from tests.conftest import belayer_cfg  # noqa: F401  (keeps the cache dir env set)

PROMPTS = [[54, 280, 487, 423, 442], [60, 61, 62], [100, 200, 300, 400]]
SP = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
KNOBS = {"shadow": {"num_standby": 0, "shared_weights": False},
         "engines": {"kind": "cpu", "num_engines": 2},
         "monitor": {"probe_interval_s": 0.2, "probe_timeout_s": 0.5, "failure_threshold": 2, "boot_grace_s": 0,
                     "liveness_timeout_s": 1},
         "restart": {"backoff_initial_s": 0, "backoff_max_s": 0}}


class StandInSGLangGeneration:
    """NeMo-RL's SGLangGeneration interface (sglang_generation.py), engines elided: what the hook overrides
    records calls; generate_one_sample is NeMo-RL's request shape against router_ip:router_port."""

    def __init__(self, cluster, sglang_cfg):
        self.cluster, self.sglang_cfg, self.calls = cluster, sglang_cfg, ["init"]
        self.router_ip, self.router_port = "127.0.0.1", 1

    def prepare_for_generation(self, *args, **kwargs):
        self.calls.append("prepare")
        return True

    def finish_generation(self, *args, **kwargs):
        self.calls.append("finish")
        return True

    def get_rollout_engine_urls(self):
        self.calls.append("urls")
        return []

    def invalidate_kv_cache(self):
        return True

    def shutdown(self):
        self.calls.append("shutdown")
        return True

    async def generate_one_sample(self, sampling_params, input_ids, index):
        url = f"http://{self.router_ip}:{self.router_port}/generate"
        async with httpx.AsyncClient() as c:
            r = await c.post(url, json={"sampling_params": sampling_params, "return_logprob": True,
                                        "input_ids": input_ids}, timeout=60)
            r.raise_for_status()
            out = r.json()
        toks = [t[1] for t in out["meta_info"]["output_token_logprobs"]]
        return index, toks, [t[0] for t in out["meta_info"]["output_token_logprobs"]], \
            out["meta_info"]["finish_reason"]["type"] == "length"


def _sglang_cfg(model: str, ft, knobs=None) -> dict:
    return {"backend": "sglang", "sglang_cfg": {"model_path": model, "use_fault_tolerance": ft, "tp_size": 1,
                                                "belayer": knobs if knobs is not None else KNOBS,
                                                "sglang_server_config": {"needs_offload": True}}}


def _generate_all(gen) -> list[list[int]]:
    async def go():
        outs = await asyncio.gather(*(gen.generate_one_sample(SP, p, i) for i, p in enumerate(PROMPTS)))
        return [o[1] for o in sorted(outs)]

    return asyncio.run(asyncio.wait_for(go(), 120))


def test_toggle_and_knobs_validated_all_at_once(tiny_model):
    bad = {"monitor": {"probe_interval_s": "soon"}, "restart": {"max_restarts": -1}, "nonsense": 1}
    with pytest.raises(ConfigError) as e:
        belayer_config_from_sglang_cfg(_sglang_cfg(tiny_model, "yes", bad))
    msg = str(e.value)
    assert "use_fault_tolerance" in msg and "probe_interval_s" in msg and "max_restarts" in msg and "nonsense" in msg
    with pytest.raises(ConfigError, match="sglang_router"):
        belayer_config_from_sglang_cfg(_sglang_cfg(tiny_model, True, {**KNOBS, "router": {"mode": "direct"}}))
    cfg = belayer_config_from_sglang_cfg(_sglang_cfg(tiny_model, True))
    assert cfg.use_fault_tolerance and cfg.engines.model_path == tiny_model
    assert not belayer_config_from_sglang_cfg({"sglang_cfg": {"model_path": tiny_model}}).use_fault_tolerance


def test_shipped_recipe_validates():
    import yaml

    from belayer_plugin.config import recipes_dir
    from belayer_plugin.hooks._config import belayer_section

    r = yaml.safe_load((recipes_dir() / "nemo_rl" / "belayer.yaml").read_text())
    cfg = belayer_config_from_sglang_cfg(r["policy"]["generation"])
    assert cfg.use_fault_tolerance and cfg.engines.kind == "sglang" and cfg.router.mode == "sglang_router"
    assert belayer_section(r["env"]["belayer_sandbox"]["belayer"]).sandbox.backend == "podman"


def test_toggle_off_is_the_wrapped_class_unchanged(tiny_model):
    gen = fault_tolerant(StandInSGLangGeneration)(None, _sglang_cfg(tiny_model, False))
    assert gen.belayer_fleet is None and gen.calls == ["init"]
    gen.finish_generation()
    gen.prepare_for_generation()
    assert gen.get_rollout_engine_urls() == [] and gen.recover_before_refit() == 0
    gen.shutdown()
    assert gen.calls == ["init", "finish", "prepare", "urls", "shutdown"]


def test_pause_kill_while_training_recover_before_refit_and_router_membership(ray_cluster, tiny_model, tmp_path):
    knobs = {**KNOBS, "run_dir": str(tmp_path), "engines": {**KNOBS["engines"], "cpu_step_delay_ms": 1}}
    gen = fault_tolerant(StandInSGLangGeneration)(None, _sglang_cfg(tiny_model, True, knobs))
    try:
        fm, events = gen.belayer_fleet, gen.belayer_events
        assert "init" not in getattr(gen, "calls", []), "with the toggle on the fleet owns the engines"
        router = f"http://{gen.router_ip}:{gen.router_port}"
        golden = _generate_all(gen)

        # nothing died: recovery before refit is a no-op (returns at once, touches nothing)
        n_events = len(events.events)
        t0 = time.monotonic()
        urls = gen.get_rollout_engine_urls()
        assert gen.recover_before_refit() == 0 and time.monotonic() - t0 < 1.0
        assert sorted(urls) == sorted(s.info.url for s in fm.serving_slots()) and len(urls) == 2
        assert [e for e in events.events[n_events:] if e.component in ("fleet", "restart")] == []

        gen.finish_generation()  # training phase: readiness probes stop, Ray liveness stays on
        assert fm.phase.value == "released"
        victim = fm.slots["engine-0"]
        dead_url = victim.info.url
        since = events.events[-1].t
        os.kill(victim.info.actor_pid, signal.SIGKILL)  # the engine's actor (and so its server) dies mid-training

        def seen(kind, **kw):
            return lambda e: e.kind == kind and e.subject == "engine-0" and all(e.figures.get(k) == v
                                                                                for k, v in kw.items())
        loop = asyncio.new_event_loop()
        try:
            det = loop.run_until_complete(events.wait_for(seen("detected"), timeout=30, since=since))
            loop.run_until_complete(events.wait_for(seen("deregistered"), timeout=30, since=since))
        finally:
            loop.close()
        assert det.figures["phase"] == "released"
        workers = httpx.get(f"{router}/workers", timeout=5).json()
        assert dead_url not in str(workers), "the dead engine is still in the router's table"

        urls = gen.get_rollout_engine_urls()  # before refit: waits for the recovery under way
        assert dead_url not in urls and len(urls) == 2
        assert all(s.health.state.value == "HEALTHY" for s in fm.slots.values())
        assert set(urls) <= {w["url"] for w in httpx.get(f"{router}/workers", timeout=5).json()["workers"]}
        assert gen.verify_weight_versions() == {s: "default" for s in fm.slots}

        gen.prepare_for_generation()
        assert fm.phase.value == "serving"
        assert _generate_all(gen) == golden
        assert gen.invalidate_kv_cache() is True
    finally:
        gen.shutdown()


def test_sandbox_environment_registers_through_the_registry_contract():
    from belayer_plugin.hooks.nemo_rl import register_environments
    from belayer_plugin.hooks.nemo_rl.env import ACTOR_FQN

    registry: dict = {}

    def register_env(name, fqn):  # NeMo-RL's contract: ValueError when the name exists
        if name in registry:
            raise ValueError(f"Env name {name} already registered")
        registry[name] = {"actor_class_fqn": fqn}

    actors: dict = {}
    assert register_environments(register_env, actors, "python") == "belayer_sandbox"
    assert register_environments(register_env, actors, "python") == "belayer_sandbox"  # idempotent
    assert registry == {"belayer_sandbox": {"actor_class_fqn": ACTOR_FQN}} and actors == {ACTOR_FQN: "python"}
    from hydra.utils import get_object

    cls = get_object(ACTOR_FQN)  # what NeMo-RL's create_env does with the FQN
    assert hasattr(cls, "options") and hasattr(cls, "remote")


def test_chaos_engine_kill_paused_scenario_through_the_hook(ray_cluster, tiny_model, tmp_path):
    """recipes/chaos/engine_kill_paused.yaml's fault (SIGKILL an engine's server at step 1 while paused with
    memory released), injected by Belayer's ChaosInjector through the hook's `belayer.chaos` section."""
    chaos = {"enabled": True, "scenario": "engine_kill_paused", "kind": "engine_server_kill", "trigger": "step",
             "at": 1, "victim_state": "paused", "count": 1, "probability": 1.0}
    knobs = {**KNOBS, "run_dir": str(tmp_path), "chaos": chaos}
    gen = fault_tolerant(StandInSGLangGeneration)(None, _sglang_cfg(tiny_model, True, knobs))
    try:
        events = gen.belayer_events
        gen.prepare_for_generation()  # step 1
        golden = _generate_all(gen)
        gen.finish_generation()  # the injector fires here
        inject = [e for e in events.events if e.component == "chaos" and e.kind == "inject"]
        assert len(inject) == 1 and inject[0].figures["phase"] == "paused"
        loop = asyncio.new_event_loop()
        try:
            det = loop.run_until_complete(events.wait_for(
                lambda e: e.kind == "detected" and e.component == "monitor", timeout=30, since=inject[0].t))
        finally:
            loop.close()
        assert det.figures["phase"] == "released"
        urls = gen.get_rollout_engine_urls()  # refit: recovery first
        assert len(urls) == 2 and all(s.health.state.value == "HEALTHY" for s in gen.belayer_fleet.slots.values())
        gen.prepare_for_generation()  # step 2
        assert _generate_all(gen) == golden
    finally:
        gen.shutdown()


def test_sandbox_environment_step_survives_a_container_kill_consistently(tmp_path):
    """NeMo-RL's env.step contract on a real podman sandbox: a container killed between actions is restored
    to the last committed boundary; the failed command is reported as not applied and the episode goes on
    with the environment as the message log says."""
    import shutil

    if not shutil.which("podman"):
        pytest.skip("podman not installed (bash .ci/setup_containers.sh)")
    from belayer_plugin.hooks.nemo_rl import SandboxEnvironment
    from belayer_plugin.hooks.verl.agent_loop import sandbox_from_config

    made = []

    def provider(tid, cfg):
        out = sandbox_from_config(tid, cfg)
        made.append(out[0])
        return out

    env = SandboxEnvironment({"belayer": {
        "use_fault_tolerance": True,
        "sandbox": {"backend": "podman", "checkpoint_dir": str(tmp_path / "ck"), "exec_timeout_s": 20,
                    "env_cache_dir": os.path.join(os.environ["BELAYER_CACHE_DIR"], "envs"),
                    "policy": {"enabled": False, "every_n_actions": 1, "async_checkpoint": False}}}}, provider)
    log = [{"role": "user", "content": "log steps"}]
    meta = [{"trajectory_id": "t0"}]

    def act(k):
        log.append({"role": "assistant", "content": f"```bash\necho step{k} >> /root/log && cat /root/log\n```"})
        ret = env.step([log], meta)
        log.append(ret.observations[0])
        meta[0] = ret.metadata[0]
        return ret

    try:
        act(0), act(1)
        made[-1].kill()  # the container dies before the third command
        ret = act(2)
        assert not bool(ret.terminateds[0]) and "not applied" in ret.observations[0]["content"]
        assert ret.metadata[0]["belayer"] == {"recovered": True, "restored_boundary": 2, "failed_boundary": 2,
                                              "inconsistent": False}
        ret = act(2)  # the agent issues it again on the restored environment
        assert ret.observations[0]["content"].endswith("step0\nstep1\nstep2\n")
        log.append({"role": "assistant", "content": "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"})
        assert bool(env.step([log], meta).terminateds[0])
    finally:
        env.shutdown()
