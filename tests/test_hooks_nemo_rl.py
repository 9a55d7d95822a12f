"""The NeMo-RL hook against NeMo-RL's real classes (source: ../shared/upstream/nemo-rl, see its SNAPSHOT.md),
a real Belayer fleet underneath (CPU engines speaking SGLang's native API, the real sglang-router) and real kills.

Real NeMo-RL code run here: SGLangGeneration (subclassed; its generate(), generate_one_sample(), _build_sampling_params,
HttpClient and AsyncLoopThread), RayVirtualCluster and its placement group, grpo.refit_policy_generation (the whole
tagged sequence), FlattenedTensorBucket, register_env / ENV_REGISTRY / ACTOR_ENVIRONMENT_REGISTRY / create_env,
NeMo-RL's config loader on examples/configs/grpo_math_1B_sglang.yaml.
Replaced on CPU (GPU only): NVTX range markers around generate() (no-ops; upstream.cpu_nvtx_markers); the policy's `stream_weights_via_http` (CUDA IPC handles) by
hooks/nemo_rl/cpu_policy.CpuStreamingPolicy posting the tensors themselves to the same endpoint
(/update_weights_from_tensor) with the same fields, weight_version included.
Not verified: real SGLang under NeMo-RL, CUDA IPC into a Belayer-launched engine, the GPU effect of placement.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from belayer_plugin.config import ConfigError
from tests.conftest import belayer_cfg  # noqa: F401  (keeps the cache dir env set)

REPO = Path(__file__).resolve().parents[1]
NEMO_RL = REPO.parent / "shared" / "upstream" / "nemo-rl"
PROMPTS = [[54, 280, 487, 423, 442], [60, 61, 62], [100, 200, 300, 400]]
KNOBS = {"shadow": {"num_standby": 0, "shared_weights": False},
         "engines": {"kind": "cpu", "flush_cache_timeout_s": 30},
         # readiness probes generous enough for a loaded 2-core machine; kills here are found by Ray liveness
         "monitor": {"probe_interval_s": 0.5, "probe_timeout_s": 5, "failure_threshold": 3, "boot_grace_s": 0,
                     "liveness_timeout_s": 2},
         "restart": {"backoff_initial_s": 0, "backoff_max_s": 0, "max_restarts": 1, "window_s": 600,
                     "min_healthy_engines": 1}}


@pytest.fixture(scope="session")
def nrl():
    """NeMo-RL's modules, imported once per session (grpo alone takes ~8 s)."""
    if not (NEMO_RL / "nemo_rl").is_dir():
        pytest.skip(f"NeMo-RL source not found at {NEMO_RL} (see .ci/setup_nemo_rl.sh)")
    os.environ.setdefault("BELAYER_NEMO_RL", str(NEMO_RL))
    from belayer_plugin.hooks.nemo_rl.upstream import cpu_nvtx_markers, import_grpo

    grpo = import_grpo()
    cpu_nvtx_markers()  # NeMo-RL's generate() pushes NVTX ranges: a CPU build of torch refuses them
    import nemo_rl.models.generation.sglang.sglang_generation as sg

    return grpo, sg


def _gen_cfg(model: str, ft, knobs=None, num_gpus: int = 2, **server) -> dict:
    """`policy.generation` as NeMo-RL builds it for SGLang (configure_generation_config sets _pad_token_id)."""
    return {"backend": "sglang", "max_new_tokens": 12, "temperature": 1.0, "top_p": 1.0, "top_k": None,
            "stop_token_ids": None, "stop_strings": None, "_pad_token_id": 0, "colocated": {"enabled": True},
            "sglang_cfg": {"model_path": model, "context_length": 512, "use_fault_tolerance": ft,
                           "belayer": knobs if knobs is not None else KNOBS,
                           "sglang_server_config": {"needs_offload": True, "num_gpus": num_gpus,
                                                    "num_gpus_per_engine": 1, "sglang_server_concurrency": 8,
                                                    **server}}}


def _batch(prompts=PROMPTS):
    import torch
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    n = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), n), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
    return BatchedDataDict({"input_ids": ids, "input_lengths": torch.tensor([len(p) for p in prompts])})


def _generated(gen) -> list[list[int]]:
    """NeMo-RL's own generate() (greedy) through the fleet's router: the generated ids per prompt."""
    out = gen.generate(_batch(), greedy=True)
    return [out["output_ids"][i, len(p):len(p) + int(out["generation_lengths"][i])].tolist()
            for i, p in enumerate(PROMPTS)]


def _wait(gen, pred, timeout=60, since=0.0):
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(gen.belayer_events.wait_for(pred, timeout=timeout, since=since))
    finally:
        loop.close()


def _router_urls(gen) -> set[str]:
    r = httpx.get(f"http://{gen.router_ip}:{gen.router_port}/workers", timeout=5).json()
    return {w["url"] for w in r["workers"]}


# ----------------------------------------------------------------- configuration
def test_knobs_and_nemo_rl_topology_validated_all_at_once_with_recipe_paths(nrl, tiny_model):
    from belayer_plugin.hooks.nemo_rl import belayer_config_from_sglang_cfg

    bad = {"monitor": {"probe_interval_s": "soon"}, "restart": {"max_restarts": -1}, "nonsense": 1,
           "engines": {"num_engines": 3}}
    cfg = _gen_cfg(tiny_model, True, bad, needs_offload="yes")
    cfg["sglang_cfg"]["sglang_router_config"] = {"use_external_router": True}
    with pytest.raises(ConfigError) as e:
        belayer_config_from_sglang_cfg(cfg)
    msg = str(e.value)
    for path in ("policy.generation.sglang_cfg.sglang_server_config.needs_offload",
                 "policy.generation.sglang_cfg.sglang_router_config.use_external_router"):
        assert path in msg
    cfg["sglang_cfg"]["sglang_server_config"]["needs_offload"] = True
    cfg["sglang_cfg"]["sglang_router_config"] = {}
    with pytest.raises(ConfigError) as e:
        belayer_config_from_sglang_cfg(cfg)
    msg = str(e.value)
    for path in ("policy.generation.sglang_cfg.belayer.engines.num_engines", "belayer.monitor.probe_interval_s",
                 "belayer.restart.max_restarts", "belayer.nonsense"):
        assert f"policy.generation.sglang_cfg.{path.removeprefix('policy.generation.sglang_cfg.')}" in msg, path
    with pytest.raises(ConfigError, match="use_fault_tolerance"):
        belayer_config_from_sglang_cfg(_gen_cfg(tiny_model, "yes"))
    with pytest.raises(ConfigError, match=r"belayer\.router\.mode"):
        belayer_config_from_sglang_cfg(_gen_cfg(tiny_model, True, {**KNOBS, "router": {"mode": "direct"}}))
    ok = belayer_config_from_sglang_cfg(_gen_cfg(tiny_model, True, num_gpus=4))
    assert ok.use_fault_tolerance and ok.engines.model_path == tiny_model and ok.engines.num_engines == 4
    assert not belayer_config_from_sglang_cfg({"sglang_cfg": {"model_path": tiny_model}}).use_fault_tolerance


def test_nemo_rls_own_sglang_fault_tolerance_beside_belayers_is_refused_at_start_up(nrl, tiny_model):
    from belayer_plugin.config import ConfigError
    from belayer_plugin.hooks.nemo_rl import belayer_config_from_sglang_cfg

    cfg = _gen_cfg(tiny_model, True)
    cfg["sglang_cfg"]["use_faulttolerance"] = True  # NeMo-RL's own switch (its open PR #3613)
    with pytest.raises(ConfigError) as e:
        belayer_config_from_sglang_cfg(cfg)
    assert any("sglang_cfg.use_faulttolerance" in p and "switch one" in p for p in e.value.problems), e.value.problems
    cfg["sglang_cfg"]["use_fault_tolerance"] = False  # Belayer off: NeMo-RL's own is NeMo-RL's business
    assert belayer_config_from_sglang_cfg(cfg).use_fault_tolerance is False


def test_memory_saver_without_a_cpu_weight_backup_is_refused_for_gpu_engines(nrl, tiny_model):
    """NeMo-RL resumes generation without a refit (dynamic sampling); weights the memory saver dropped without a
    backup would come back as garbage under a correct version label."""
    from belayer_plugin.config import ConfigError
    from belayer_plugin.hooks.nemo_rl import belayer_config_from_sglang_cfg

    gpu = {"engines": {"kind": "sglang"}}
    with pytest.raises(ConfigError) as e:
        belayer_config_from_sglang_cfg(_gen_cfg(tiny_model, True, gpu, needs_offload=True, cpu_weight_backup=False))
    assert any("sglang_server_config.cpu_weight_backup" in p for p in e.value.problems), e.value.problems
    ok = belayer_config_from_sglang_cfg(_gen_cfg(tiny_model, True, gpu, needs_offload=True, cpu_weight_backup=True))
    assert ok.engines.sglang.enable_memory_saver is True


def test_shipped_recipe_composes_with_nemo_rls_grpo_sglang_recipe(nrl):
    """recipes/nemo_rl/belayer.yaml over NeMo-RL's own examples/configs/grpo_math_1B_sglang.yaml, loaded with
    NeMo-RL's config loader, validates (every interpolation resolved)."""
    from nemo_rl.utils.config import load_config, register_omegaconf_resolvers
    from omegaconf import OmegaConf

    from belayer_plugin.config import recipes_dir
    from belayer_plugin.hooks._config import belayer_section
    from belayer_plugin.hooks.nemo_rl import belayer_config_from_sglang_cfg

    register_omegaconf_resolvers()  # as examples/run_grpo.py does
    base = load_config(NEMO_RL / "examples" / "configs" / "grpo_math_1B_sglang.yaml")
    composed = OmegaConf.merge(base, OmegaConf.load(recipes_dir() / "nemo_rl" / "belayer.yaml"))
    d = OmegaConf.to_container(composed, resolve=True)
    gen = d["policy"]["generation"]
    cfg = belayer_config_from_sglang_cfg(gen, d["cluster"]["gpus_per_node"])
    assert cfg.use_fault_tolerance and cfg.engines.kind == "sglang" and cfg.router.mode == "sglang_router"
    assert cfg.engines.num_engines == 2 and cfg.engines.model_path == d["policy"]["model_name"]
    assert gen["sglang_cfg"]["sglang_server_config"]["needs_offload"] is True  # NeMo-RL's recipe is untouched
    assert belayer_section(d["env"]["belayer_sandbox"]["belayer"]).sandbox.backend == "podman"


# ----------------------------------------------------------------- construction sites and toggle
def test_patch_rebinds_every_construction_site_once(nrl):
    import nemo_rl.algorithms.ppo as ppo
    import nemo_rl.algorithms.single_controller_utils.setup as sc_setup

    grpo, sg = nrl
    from belayer_plugin.hooks.nemo_rl import patch_nemo_rl

    original = sg.SGLangGeneration
    sites = (sg, grpo, ppo, sc_setup)
    try:
        cls = patch_nemo_rl()
        assert all(m.SGLangGeneration is cls for m in sites), "a construction site still builds NeMo-RL's class"
        assert patch_nemo_rl() is cls and cls.__mro__[2] is original  # idempotent, wraps the real class
        assert issubclass(cls, original)  # refit_policy_generation's isinstance(.., SGLangGeneration) holds
    finally:
        for m in sites:
            m.SGLangGeneration = original


def test_toggle_off_is_nemo_rls_class_unchanged(nrl, tiny_model, ray_cluster):
    _, sg = nrl
    from belayer_plugin.hooks.nemo_rl import fault_tolerant

    cls = fault_tolerant(sg.SGLangGeneration)
    for name in ("generate", "generate_async", "generate_one_sample", "_build_sampling_params"):
        assert getattr(cls, name) is getattr(sg.SGLangGeneration, name), name  # never overridden

    class NoPlacement:  # NeMo-RL's __init__ asks the cluster for its placement groups first: stop it there
        num_gpus_per_node = 2

        def _init_placement_groups(self, **kw):
            raise RuntimeError(f"NeMo-RL's own __init__ ran: {sorted(kw)}")

    with pytest.raises(RuntimeError, match="NeMo-RL's own __init__ ran"):
        cls(cluster=NoPlacement(), sglang_cfg=_gen_cfg(tiny_model, False))
    off = object.__new__(cls)  # the rest of the interface goes to NeMo-RL's methods with the toggle off
    off.needs_offload, off.all_engines, off.num_gpus_per_node, off.num_gpus_per_engine = False, [], 1, 1
    off._router_actor = off._http_client = off._async_loop = None
    assert off.prepare_for_generation(tags=["weights"]) is None and off.finish_generation() is None
    assert off.get_rollout_engine_urls() == [] and off.invalidate_kv_cache() is True and off.recover_before_refit() == 0
    assert off.check_weights("snapshot") == []  # NeMo-RL's own (over its engines: none here)


# ----------------------------------------------------------------- the fleet under the real class
@pytest.fixture(scope="module")
def nrl_cluster(nrl, ray_cluster):
    from nemo_rl.distributed.virtual_cluster import RayVirtualCluster

    c = RayVirtualCluster([2], use_gpus=False, num_gpus_per_node=2, max_colocated_worker_groups=1,
                          name="belayer-test")
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def setup(nrl, nrl_cluster, tiny_model, tmp_path_factory):
    """What GRPO's setup does with the SGLang backend (grpo.py init_sglang and after): construct with keyword
    arguments, finish_generation(), then policy.set_rollout_num_gpus_per_engine(pg.num_gpus_per_engine)."""
    knobs = {**KNOBS, "run_dir": str(tmp_path_factory.mktemp("nemo-rl-run")),
             "engines": {**KNOBS["engines"], "cpu_step_delay_ms": 2},
             "shadow": {**KNOBS["shadow"], "num_standby": 1}}  # a kill is taken over by the standby
    with generation_and_policy(nrl, nrl_cluster, tiny_model, knobs) as both:
        yield both


@contextlib.contextmanager
def generation_and_policy(nrl, cluster, tiny_model: str, knobs: dict):
    """The fault-tolerant SGLangGeneration as GRPO's setup builds it, paused, and the CPU streaming policy."""
    import torch
    from transformers import AutoModelForCausalLM

    from belayer_plugin.hooks.nemo_rl import fault_tolerant
    from belayer_plugin.hooks.nemo_rl.cpu_policy import CpuStreamingPolicy

    _, sg = nrl
    pg = fault_tolerant(sg.SGLangGeneration)(cluster=cluster, sglang_cfg=_gen_cfg(tiny_model, True, knobs))
    try:
        pg.finish_generation()
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        policy = CpuStreamingPolicy(model, world_size=2)
        policy.set_rollout_num_gpus_per_engine(pg.num_gpus_per_engine)
        yield pg, policy
    finally:
        pg.shutdown()


def test_grpo_setup_calls_work_and_engines_and_standby_sit_in_nemo_rls_bundles(setup, nrl_cluster):
    import ray

    pg, policy = setup
    fm = pg.belayer_fleet
    assert pg.num_gpus_per_engine == 1 and policy.num_gpus_per_engine == 1 and len(pg.all_engines) == 2
    assert pg.needs_offload and fm.phase.value == "released" and not fm.monitor._serving.is_set()
    assert pg._router_actor is None and f"http://{pg.router_ip}:{pg.router_port}" == fm.url  # Belayer's router
    # placement: engine i on the bundle NeMo-RL gives engine i, with NeMo-RL's resource share; standby 0 on
    # engine 0's bundle
    assert pg.pg is nrl_cluster.get_placement_groups()[0]
    assert pg.belayer_placement == {"engine-0": 0, "engine-1": 1, "shadow-0": 0}
    pgid = pg.pg.id.hex()
    free = ray.available_resources()
    assert [round(free.get(f"CPU_group_{b}_{pgid}", 0), 2) for b in (0, 1)] == [0.6, 0.8], free


def test_refit_follows_tags_adopts_streamed_version_and_counts_one_step(nrl, setup):
    """grpo.refit_policy_generation as NeMo-RL runs it (colocated): tags ["weights"], streaming to
    get_rollout_engine_urls() with weight_version, tags ["kv_cache"]."""
    import torch

    grpo, _ = nrl
    pg, policy = setup
    fm = pg.belayer_fleet
    seen = {}

    def stream(rollout_engine_urls, buffer_size_bytes):  # what the fleet looks like while NeMo-RL streams
        seen.update(phase=fm.phase.value, probing=fm.monitor._serving.is_set(), urls=list(rollout_engine_urls))
        return type(policy).stream_weights_via_http(policy, rollout_engine_urls, buffer_size_bytes)

    pg.prepare_for_generation()
    before = _generated(pg)
    pg.finish_generation()
    step0 = pg.belayer_step
    with torch.no_grad():
        for p in policy.model.parameters():
            p.mul_(1.5)  # "training" changed the policy
    policy.stream_weights_via_http = stream
    try:
        grpo.refit_policy_generation(policy, pg, colocated_inference=True, _refit_buffer_size_gb=0.0005)
    finally:
        del policy.stream_weights_via_http
    assert seen["phase"] == "refit" and seen["probing"] is False, "readiness probes ran while weights streamed"
    # one refit-gateway URL per slot, in slot order, each relaying to that slot's engine (fleet/refit_gateway.py)
    gw = pg.belayer_gateway
    assert seen["urls"] == [f"{gw.url}/slot/engine-0", f"{gw.url}/slot/engine-1"]
    assert gw._pins == {sid: fm.slots[sid].info.url for sid in ("engine-0", "engine-1")}
    assert gw.missed == {} and min(gw.relayed.values()) >= 2, gw.relayed  # buckets, then the cache flush
    assert policy.calls[-3:] == ["offload_before_refit", "stream_weights_via_http", "offload_after_refit"]
    assert fm.weights.version == "1" and fm.phase.value == "serving" and fm.monitor._serving.is_set()
    assert pg.belayer_step == step0 + 1, "the chaos step must count refits, not prepare calls"
    assert pg.verify_weight_versions() == {"engine-0": "1", "engine-1": "1"}  # nothing fenced
    after = _generated(pg)
    assert after != before and all(len(t) == 12 for t in after)
    # the same prompts on each engine directly agree: both serve the streamed weights
    for s in fm.slots.values():
        r = httpx.post(f"{s.info.url}/generate", json={"input_ids": PROMPTS[0], "return_logprob": True,
                       "sampling_params": {"max_new_tokens": 12, "temperature": 0.0}}, timeout=60).json()
        assert [t[1] for t in r["meta_info"]["output_token_logprobs"]] == after[0]
        assert r["meta_info"]["weight_version"] == "1"


def test_generate_one_sample_and_generate_async_go_through_the_router(nrl, setup):
    pg, _ = setup
    sp = pg._build_sampling_params(greedy=True, max_new_tokens=5)

    async def go():
        one = await pg.generate_one_sample(sp, PROMPTS[1], 7)
        outs = [o async for o in pg.generate_async(_batch([PROMPTS[1]]), greedy=True)]
        return one, outs

    one, outs = pg._async_loop.run(go())
    idx, toks, lps, truncated = one
    assert idx == 7 and len(toks) == 5 and len(lps) == 5 and truncated is True
    assert outs[0][1]["output_ids"][0, len(PROMPTS[1]):len(PROMPTS[1]) + 5].tolist() == toks


def test_invalidate_kv_cache_waits_for_running_requests_to_drain(nrl, setup):
    pg, _ = setup
    sp = pg._build_sampling_params(greedy=True, max_new_tokens=150)
    fut = asyncio.run_coroutine_threadsafe(pg.generate_one_sample(sp, PROMPTS[0], 0), pg._async_loop.loop)
    fm = pg.belayer_fleet
    deadline = time.monotonic() + 30
    while not any(httpx.get(f"{s.info.url}/flush_cache", timeout=5).status_code == 400 for s in fm.serving_slots()):
        assert time.monotonic() < deadline and not fut.done(), "the long request never ran"
        time.sleep(0.02)  # polling the engine's own refusal: there is no event to await from outside
    assert pg.invalidate_kv_cache() is True
    assert fut.done(), "flushed while a request was still running"
    assert len(fut.result()[1]) == 150


def test_engine_handed_over_mid_rollout_stays_stale_until_the_next_refit_streams_to_it(nrl, setup):
    """The standby holds the initial weights (only NeMo-RL has the trained ones): the slot it takes over is STALE,
    out of the router, until NeMo-RL's next refit streams to it (tests/functional/nemo_rl_engine_kill.sh: the
    same for a cold restart)."""
    grpo, _ = nrl
    pg, policy = setup
    fm = pg.belayer_fleet
    events = pg.belayer_events
    pg.get_step_metrics()  # what earlier tests did is in earlier steps
    golden = _generated(pg)
    # a step without a fault: GRPO logs every Belayer metric, all zero
    from belayer_plugin.metrics import STEP_METRICS

    quiet = pg.get_step_metrics()
    assert set(quiet) == {f"belayer/{n}" for n in STEP_METRICS} and set(quiet.values()) == {0.0}, quiet
    victim = fm.slots["engine-0"]
    old_url = victim.info.url
    since = events.events[-1].t
    os.kill(victim.info.actor_pid, signal.SIGKILL)  # mid-rollout: the fleet is serving
    _wait(pg, lambda e: e.kind == "handover" and e.subject == "engine-0", since=since)  # emitted last
    # this step's metrics as grpo.py gets them (policy_generation.get_step_metrics(), logged under train/)
    m = pg.get_step_metrics()
    assert m["belayer/engine_deaths_detected"] == 1 and m["belayer/handovers"] == 1, m
    assert 0 < m["belayer/handover_s_max"] < 60 and m["belayer/cold_restarts"] == 0, m
    assert set(pg.get_step_metrics().values()) == {0.0}, "counts must be per step, not cumulative"
    assert any(e.kind == "awaiting_weights" and e.subject == "engine-0" for e in events.events if e.t >= since)
    assert victim.health.state.value == "STALE" and victim.info.url != old_url
    assert victim.served_version == "default" and fm.weights.version == "1"
    assert victim.info.url not in _router_urls(pg) and old_url not in _router_urls(pg)
    assert [s.slot_id for s in fm.serving_slots()] == ["engine-1"]
    assert _generated(pg) == golden, "the remaining engine serves the current weights"

    pg.finish_generation()
    # the slot replaced during the rollout releases its memory with the others while the trainer trains
    # (read from each server's own /get_server_info)
    released = {sid: httpx.get(f"{s.info.url}/get_server_info", timeout=30).json()["memory_released"]
                for sid, s in fm.slots.items()}
    assert released == {"engine-0": True, "engine-1": True}, released
    pg.get_rollout_engine_urls()
    pins = pg.belayer_gateway._pins
    assert pins == {"engine-0": victim.info.url, "engine-1": fm.slots["engine-1"].info.url}, \
        "the replacement keeps its slot's rank"
    grpo.refit_policy_generation(policy, pg, colocated_inference=True, _refit_buffer_size_gb=0.0005)
    assert fm.weights.version == "2" and fm.states() == {"engine-0": "HEALTHY", "engine-1": "HEALTHY"}
    assert {s.info.url for s in fm.slots.values()} <= _router_urls(pg)
    assert pg.verify_weight_versions() == {"engine-0": "2", "engine-1": "2"}
    r = httpx.post(f"{victim.info.url}/generate", json={"input_ids": PROMPTS[0], "return_logprob": True,
                   "sampling_params": {"max_new_tokens": 12, "temperature": 0.0}}, timeout=60).json()
    assert [t[1] for t in r["meta_info"]["output_token_logprobs"]] == _generated(pg)[0]


def test_grpo_asks_the_generation_backend_for_step_metrics_and_logs_them_with_the_train_metrics(nrl):
    """Where Belayer's get_step_metrics() reaches NeMo-RL's Logger (wandb / tensorboard / mlflow), read from
    NeMo-RL's own source: both GRPO loops ask any backend that has it, once per step."""
    import inspect

    grpo, sg = nrl
    for fn, merge, log_call in (
            (grpo.grpo_train, "metrics.update(gen_step_metrics)",
             'logger.log_metrics(metrics, total_steps + 1, prefix="train")'),
            (grpo.async_grpo_train, "metrics.update(policy_generation.get_step_metrics())",
             'logger.log_metrics(metrics, step + 1, prefix="train")')):
        src = inspect.getsource(fn)
        asked = src.index('hasattr(policy_generation, "get_step_metrics")')
        got = src.index("policy_generation.get_step_metrics()", asked)
        merged = src.index(merge, asked)
        assert asked < got and asked < merged and max(got, merged) < src.index(log_call, merged), fn.__name__
    from belayer_plugin.hooks.nemo_rl import fault_tolerant

    assert callable(getattr(fault_tolerant(sg.SGLangGeneration), "get_step_metrics", None))


def test_an_engine_not_serving_the_streamed_version_leaves_the_router_until_a_refit_reaches_it(nrl, setup):
    grpo, _ = nrl
    pg, policy = setup
    fm = pg.belayer_fleet
    e1 = fm.slots["engine-1"]

    def stream(rollout_engine_urls, buffer_size_bytes):
        refs = type(policy).stream_weights_via_http(policy, rollout_engine_urls, buffer_size_bytes)
        import ray

        ray.get(refs)  # then engine-1 "kept" its previous weights: it reports the previous version
        httpx.post(f"{e1.info.url}/update_weight_version", json={"new_version": fm.weights.version}, timeout=10)
        return refs

    pg.finish_generation()
    policy.stream_weights_via_http = stream
    try:
        grpo.refit_policy_generation(policy, pg, colocated_inference=True, _refit_buffer_size_gb=0.0005)
    finally:
        del policy.stream_weights_via_http
    assert fm.weights.version == "3" and fm.states() == {"engine-0": "HEALTHY", "engine-1": "STALE"}
    assert e1.info.url not in _router_urls(pg) and fm.slots["engine-0"].info.url in _router_urls(pg)
    assert any(e.kind == "weight_version_mismatch" and e.subject == "engine-1" for e in pg.belayer_events.events)
    assert all(len(t) == 12 for t in _generated(pg))  # engine-0 alone serves
    pg.finish_generation()
    grpo.refit_policy_generation(policy, pg, colocated_inference=True, _refit_buffer_size_gb=0.0005)
    assert fm.weights.version == "4" and fm.states() == {"engine-0": "HEALTHY", "engine-1": "HEALTHY"}
    assert e1.info.url in _router_urls(pg)


def test_a_retired_slot_misses_the_refit_and_the_fleet_goes_on_at_its_floor(nrl, setup):
    """Retired (budget spent) at the floor: NeMo-RL's refit still streams by rank; the retired slot's share is
    absorbed by the refit gateway and the remaining engine serves the new weights (no RuntimeError)."""
    grpo, _ = nrl
    pg, policy = setup
    fm = pg.belayer_fleet
    since = pg.belayer_events.events[-1].t
    os.kill(fm.slots["engine-0"].info.actor_pid, signal.SIGKILL)  # its restart budget (1) is spent: retired
    _wait(pg, lambda e: e.subject == "engine-0" and e.kind == "transition" and e.to_state == "RETIRED", since=since)
    pg.finish_generation()
    before = fm.weights.version
    grpo.refit_policy_generation(policy, pg, colocated_inference=True, _refit_buffer_size_gb=0.0005)
    assert pg.belayer_gateway.missed == {"engine-0": "no engine to stream to (state RETIRED)"}
    assert fm.weights.version == str(int(before) + 1)
    assert fm.states() == {"engine-0": "RETIRED", "engine-1": "HEALTHY"}
    assert pg.verify_weight_versions() == {"engine-1": fm.weights.version}
    assert all(len(t) == 12 for t in _generated(pg))  # engine-1 alone serves, at the new version


# ----------------------------------------------------------------- chaos through the hook
def test_chaos_engine_kill_paused_scenario_through_the_hook(nrl, ray_cluster, tiny_model, tmp_path):
    """recipes/chaos/engine_kill_paused.yaml's fault (SIGKILL an engine's server at step 1 while paused with
    memory released), injected by Belayer's ChaosInjector through the hook's `belayer.chaos` section."""
    _, sg = nrl
    from belayer_plugin.hooks.nemo_rl import fault_tolerant

    chaos = {"enabled": True, "scenario": "engine_kill_paused", "kind": "engine_server_kill", "trigger": "step",
             "at": 1, "victim_state": "paused", "count": 1, "probability": 1.0}
    knobs = {**KNOBS, "run_dir": str(tmp_path), "chaos": chaos, "restart": {**KNOBS["restart"], "max_restarts": 3}}
    cfg = _gen_cfg(tiny_model, True, knobs)
    cfg["colocated"] = {"enabled": False}
    gen = fault_tolerant(sg.SGLangGeneration)(None, cfg)
    try:
        events = gen.belayer_events
        gen.prepare_for_generation()  # step 1
        golden = _generated(gen)
        gen.finish_generation()  # the injector fires here
        inject = [e for e in events.events if e.component == "chaos" and e.kind == "inject"]
        assert len(inject) == 1 and inject[0].figures["phase"] == "paused"
        det = _wait(gen, lambda e: e.kind == "detected" and e.component == "monitor", timeout=30, since=inject[0].t)
        assert det.figures["phase"] == "released"
        urls = gen.get_rollout_engine_urls()  # refit: recovery first (no refit yet: the base weights are current)
        assert len(urls) == 2 and all(s.health.state.value == "HEALTHY" for s in gen.belayer_fleet.slots.values())
        gen.prepare_for_generation()  # step 2
        assert _generated(gen) == golden
    finally:
        gen.shutdown()


# ----------------------------------------------------------------- environments
def test_sandbox_environment_registers_in_nemo_rls_registries_and_create_env_builds_it(nrl, ray_cluster):
    import ray
    from nemo_rl.distributed.ray_actor_environment_registry import ACTOR_ENVIRONMENT_REGISTRY
    from nemo_rl.distributed.virtual_cluster import PY_EXECUTABLES
    from nemo_rl.environments.utils import ENV_REGISTRY, create_env

    from belayer_plugin.hooks.nemo_rl import register_environments
    from belayer_plugin.hooks.nemo_rl.env import ACTOR_FQN

    try:
        assert register_environments() == "belayer_sandbox"
        assert register_environments() == "belayer_sandbox"  # idempotent (register_env raises on a second call)
        assert ENV_REGISTRY["belayer_sandbox"] == {"actor_class_fqn": ACTOR_FQN}
        assert ACTOR_ENVIRONMENT_REGISTRY[ACTOR_FQN] == PY_EXECUTABLES.SYSTEM
        env = create_env("belayer_sandbox", {"belayer": {"sandbox": {"backend": "podman"}}})
        batch, metrics = ray.get(env.global_post_process_and_metrics.remote({"x": 1}), timeout=120)
        assert batch == {"x": 1} and metrics == {}
        ray.kill(env)
    finally:
        ENV_REGISTRY.pop("belayer_sandbox", None)
        ACTOR_ENVIRONMENT_REGISTRY.pop(ACTOR_FQN, None)


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
