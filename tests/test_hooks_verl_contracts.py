"""verl 0.9.1 server contracts and config-only switches, without engines: how a chunk's stop reason is read
(vLLM's "completed" vs SGLang's reasons), which versions a resumed trajectory reports, full_determinism in the
balancer, the agent loop managers' client swap (v1 and legacy), the verl.plugins entry point and the recipe."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="verl 0.9.1 not installed (bash .ci/setup_verl.sh)")

from omegaconf import OmegaConf  # noqa: E402

from belayer_plugin.hooks.verl.client import Served, _sglang_shaped  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EOS = 7


def _out(ids, reason, steps=3, **extra):
    return {"token_ids": ids, "log_probs": [-0.5] * len(ids), "stop_reason": reason,
            "extra_fields": {"global_steps": steps, **extra}}


def test_vllm_completed_at_a_full_chunk_is_a_length_cut_and_the_request_goes_on():
    # verl's vLLM server says "completed" for both stop and length (vllm_async_server.py)
    full = _sglang_shaped(_out([1, 2, 3, 4], "completed"), 4, frozenset({EOS}))
    assert full["meta_info"]["finish_reason"]["type"] == "length"
    # ...ending on a stop id, or short of the budget, it is a real stop
    assert _sglang_shaped(_out([1, 2, 3, EOS], "completed"), 4, frozenset({EOS}))["meta_info"]["finish_reason"] == \
        {"type": "stop"}
    assert _sglang_shaped(_out([1, 2], "completed"), 4, frozenset({EOS}))["meta_info"]["finish_reason"] == \
        {"type": "stop"}
    # SGLang's server names the reason itself; both name an abort
    assert _sglang_shaped(_out([1, 2, 3, 4], "stop"), 4)["meta_info"]["finish_reason"] == {"type": "stop"}
    assert _sglang_shaped(_out([1, 2], "length"), 4)["meta_info"]["finish_reason"]["type"] == "length"
    for r in ("aborted", "abort"):
        assert _sglang_shaped(_out([1], r), 4)["meta_info"]["finish_reason"]["type"] == "abort"
    assert full["meta_info"]["weight_version"] == "3"


def test_a_trajectory_resumed_across_a_weight_sync_reports_both_versions():
    s = Served(prompt_len=5)
    s.add(0, 8, 3)
    s.add(8, 8, 3)  # same version: one span
    s.add(16, 4, 4)  # after the sync
    s.add(20, 0, 5)  # a chunk that served nothing says nothing
    assert s.spans == [[0, 16, 3], [16, 20, 4]]
    assert s.steps() == (4, 3, 4)
    assert Served().steps() == (None, None, None)


def test_full_determinism_routes_by_request_id_whatever_the_load_and_the_process():
    from belayer_plugin.hooks.verl.balancer import BelayerLoadBalancer

    servers = {f"127.0.0.1:{8000 + i}": object() for i in range(3)}
    rids = [f"req-{i}" for i in range(24)]

    def make(config=None, later=False):
        lb = BelayerLoadBalancer(dict(servers), config if not later else {"belayer": {"use_fault_tolerance": True}})
        if later:  # set from rollout.full_determinism by Belayer's agent loop manager (verl gives plugins no flag)
            lb.set_full_determinism(True)
        return lb

    async def route(order, busy, lb):
        for i in range(busy):  # uneven load, never released: least-in-flight routing would avoid the busy ones
            await lb.acquire_server(request_id=f"load-{i}")
        got = {}
        for rid in order:
            sid, _ = await lb.acquire_server(request_id=rid)
            got[rid] = sid
            lb.release_server(sid)
        return got

    on = {"full_determinism": True, "belayer": {"use_fault_tolerance": True}}
    a = asyncio.run(route(rids, 0, make(on)))
    b = asyncio.run(route(list(reversed(rids)), 10, make(on)))
    assert a == b and len(set(a.values())) == 3
    # the same map in another process (Python's own hash() differs between processes)
    code = ("import asyncio, importlib.util as u\n"  # the module alone: no verl import in the child
            f"spec = u.spec_from_file_location('b', {str(ROOT / 'hooks' / 'verl' / 'balancer.py')!r})\n"
            "m = u.module_from_spec(spec); spec.loader.exec_module(m); B = m.BelayerLoadBalancer\n"
            f"lb = B({{s: None for s in {sorted(servers)!r}}}, {on!r})\n"
            f"print([asyncio.run(lb.acquire_server(request_id=r))[0] for r in {rids!r}])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONHASHSEED": "123"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert eval(out.stdout.strip().splitlines()[-1]) == [a[r] for r in rids]  # noqa: S307  (our own output)
    lb = make(later=True)
    assert asyncio.run(route(rids, 5, lb)) == a and lb.get_status()["full_determinism"]


def _config(ft: bool = True, **rollout):
    return OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "vllm", "response_length": 16,
                                                               "full_determinism": False, **rollout},
                                                   "model": {}},
                             "data": {}, "belayer": {"use_fault_tolerance": ft}})


def test_agent_loop_managers_swap_in_belayers_client_and_leave_verls_alone_when_off():
    from verl.utils.import_utils import load_class_from_fqn
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient, LLMServerClient

    from belayer_plugin.hooks.verl.client import BelayerLLMServerClient

    recipe = OmegaConf.load(ROOT / "recipes" / "verl" / "belayer.yaml")
    v1 = load_class_from_fqn(recipe.actor_rollout_ref.rollout.agent.agent_loop_manager_class, "AgentLoopManager")
    legacy = load_class_from_fqn("belayer_plugin.hooks.verl.manager.BelayerLegacyAgentLoopManager", "m")
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager
    from verl.trainer.ppo.v1 import AgentLoopManagerTQ

    assert issubclass(v1, AgentLoopManagerTQ) and issubclass(legacy, AgentLoopManager)
    for cls in (v1, legacy):
        m = cls(config=_config(), llm_client=LLMServerClient(_config(), None))
        assert type(m.llm_client) is BelayerLLMServerClient and not m.llm_client.partial_rollout
        # async modes build FullyAsyncLLMServerClient: weight-sync aborts are waited out, not failures
        m = cls(config=_config(), llm_client=FullyAsyncLLMServerClient(_config(), None))
        assert m.llm_client.partial_rollout
        off = LLMServerClient(_config(ft=False), None)
        m = cls(config=_config(ft=False), llm_client=off)
        assert m.llm_client is off and m.recovery is None


def test_fault_tolerance_on_refuses_verls_own_router_at_start_up_and_the_trainers_toggle_reaches_belayers(ray_cluster):
    """The router is verl's actor, built by verl's router factory from the router YAML (which the trainer's
    command-line overrides never reach): Belayer's manager must refuse verl's balancer at start-up with fault
    tolerance on, and hand its own toggle to Belayer's balancer whatever the YAML says."""
    import ray
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle

    from belayer_plugin.hooks.verl.manager import BelayerLegacyAgentLoopManager

    @ray.remote(num_cpus=0)
    class Server:
        pass

    servers = {"127.0.0.1:9000": Server.remote()}
    verls = get_router_handle(servers)  # no router_config_path: verl's GlobalRequestLoadBalancer
    belayers = get_router_handle(servers, router_config_path=str(ROOT / "recipes" / "verl" / "router.yaml"))
    try:
        assert ray.get(belayers.get_status.remote(), timeout=60)["use_fault_tolerance"]  # the YAML's value
        m = BelayerLegacyAgentLoopManager(config=_config(), llm_client=LLMServerClient(_config(), verls))
        with pytest.raises(ValueError, match=r"router_config_path=\$\{belayer_recipe:verl/router.yaml\}"):
            asyncio.run(m.configure_balancer())
        off = BelayerLegacyAgentLoopManager(config=_config(ft=False), llm_client=LLMServerClient(_config(), verls))
        asyncio.run(off.configure_balancer())  # off: verl's own router is what verl would use
        for ft in (False, True):
            m = BelayerLegacyAgentLoopManager(config=_config(ft=ft, full_determinism=ft),
                                              llm_client=LLMServerClient(_config(), belayers))
            asyncio.run(m.configure_balancer())
            status = ray.get(belayers.get_status.remote(), timeout=60)
            assert status["use_fault_tolerance"] is ft and status["full_determinism"] is ft
    finally:
        for h in (verls, belayers, *servers.values()):
            ray.kill(h, no_restart=True)


def test_plugin_entry_point_registers_belayer_at_import_verl_without_env_vars():
    code = ("import verl\n"
            "from verl.workers.rollout.replica import RolloutReplicaRegistry as R\n"
            "from verl.experimental.agent_loop.agent_loop import _agent_loop_registry as a\n"
            "from omegaconf import OmegaConf\n"
            "from verl.utils.import_utils import load_class_from_fqn as f\n"
            "c = OmegaConf.load(%r)\n"
            "r = c.actor_rollout_ref.rollout\n"
            "print(R.get('belayer').__name__, 'belayer_sandbox_agent' in a, f(r.checkpoint_manager_class, 'x').__name__)\n"
            "print(r.router_config_path)\nprint(r.agent.agent_loop_config_path)\n"
            % str(ROOT / "recipes" / "verl" / "belayer.yaml"))
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_MODULES"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    first, router, loops = out.stdout.strip().splitlines()[-3:]
    assert first.split() == ["BelayerReplica", "True", "BelayerCheckpointEngineManager"]
    assert os.path.isfile(router) and router.endswith("recipes/verl/router.yaml")
    assert os.path.isfile(loops) and loops.endswith("recipes/verl/agent_loops.yaml")
    # verl's own switch turns plugins off: then nothing of Belayer's is registered
    off = subprocess.run([sys.executable, "-c", "import verl\nfrom verl.workers.rollout.replica import "
                          "RolloutReplicaRegistry as R\nprint('belayer' in R._registry)"],
                         capture_output=True, text=True, timeout=180, env={**env, "VERL_USE_EXTERNAL_PLUGINS": "none"})
    assert off.returncode == 0 and off.stdout.strip().splitlines()[-1] == "False"


def test_a_belayer_hook_that_fails_to_import_at_import_verl_is_named_not_swallowed(tmp_path):
    """verl logs a plugin's import failure at debug level: a broken dependency of Belayer's hook (here aiohttp,
    which verl's `import verl` does not import itself) must be printed, and the recipe's first Belayer line must
    fail with that cause, not with OmegaConf's "Unsupported interpolation type"."""
    broken = tmp_path / "aiohttp"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('aiohttp is broken in this environment')\n")
    code = ("import verl\n"
            "from omegaconf import OmegaConf\n"
            "c = OmegaConf.load(%r)\n"
            "print(c.actor_rollout_ref.rollout.router_config_path)\n" % str(ROOT / "recipes" / "verl" / "belayer.yaml"))
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_MODULES"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *filter(None, [env.get("PYTHONPATH")])])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode != 0, out.stdout[-2000:]
    said = "Belayer's verl hook failed to import at `import verl`: ImportError: aiohttp is broken in this environment"
    assert said in out.stderr, out.stderr[-3000:]  # printed at import verl
    # the recipe's first ${belayer_recipe:...} fails with the cause
    assert f"InterpolationResolutionError: RuntimeError raised while resolving interpolation: {said}" in out.stderr
    assert "Unsupported interpolation" not in out.stderr, out.stderr[-3000:]


def test_eos_ids_come_from_the_tokenizer_when_the_model_has_no_generation_config(tiny_model, tmp_path):
    """verl's vLLM server says "completed" for a stop and for a length cut alike: without the model's EOS ids an
    EOS that lands exactly on a chunk boundary reads as a length cut and generation runs past it. A model
    directory without generation_config.json (and a config.json naming no EOS) still has a tokenizer."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from belayer_plugin.hooks.verl.client import BelayerLLMServerClient

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "generation_config.json").unlink(missing_ok=True)
    cfg = json.loads((model / "config.json").read_text())
    cfg.pop("eos_token_id", None)
    (model / "config.json").write_text(json.dumps(cfg))
    want = AutoTokenizer.from_pretrained(str(model)).eos_token_id
    assert want is not None
    client = object.__new__(BelayerLLMServerClient)  # only the config is read: no balancer, no Ray
    client.config = OmegaConf.create({"actor_rollout_ref": {"model": {"path": str(model)}}})
    client._eos = None
    assert client._eos_ids() == frozenset({want})


def test_context_room_follows_verls_server_rules():
    from belayer_plugin.hooks.verl.client import BelayerLLMServerClient

    client = object.__new__(BelayerLLMServerClient)
    client.config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "vllm", "max_model_len": 100}}})
    assert client._context_room(90) == 10 and client._context_room(100) == 0  # vLLM: max_model_len - len
    client.config.actor_rollout_ref.rollout.name = "sglang"
    assert client._context_room(90) == 9  # SGLang: max_model_len - len - 1
    client.config.actor_rollout_ref.rollout.max_model_len = None
    assert client._context_room(90) is None


def test_num_preempted_is_the_servers_own_count_summed_over_chunks_not_a_made_up_zero():
    from belayer_plugin.hooks.verl.client import BelayerLLMServerClient

    s = Served(prompt_len=5)
    chunk = _sglang_shaped(_out([1, 2, 3, 4], "completed"), 4, frozenset({EOS}))
    BelayerLLMServerClient._record(s, 0, {**_out([1, 2, 3, 4], "completed"), "num_preempted": 2}, chunk)
    BelayerLLMServerClient._record(s, 4, {**_out([5, 6, 7, 8], "completed"), "num_preempted": 1}, chunk)
    assert s.num_preempted == 3
    quiet = Served(prompt_len=5)  # servers that do not report it (verl's -1): the request says "not available"
    BelayerLLMServerClient._record(quiet, 0, {**_out([1, 2, 3, 4], "completed"), "num_preempted": -1}, chunk)
    assert quiet.num_preempted is None
