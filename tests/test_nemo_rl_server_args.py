"""The SGLang servers Belayer starts under NeMo-RL get NeMo-RL's own server arguments (issue 42, item 1).

For NeMo-RL's recipe examples/configs/grpo_math_1B_sglang.yaml (source: ../shared/upstream/nemo-rl, loaded as
examples/run_grpo.py loads it, with recipes/nemo_rl/belayer.yaml on top) and a tp_size=2 / needs_offload /
cpu_weight_backup variant, the command each engine actor would run (launch.server_command, under the Ray
runtime_env the hook gives that actor) is parsed back with SGLang's own argparse (.venv-sglang, when it exists)
and compared key by key with what NeMo-RL itself would start that engine with: NeMo-RL's
SGLangGeneration._start_engines is run with its Ray calls recorded (which rank, base_gpu_id, bundle and
environment it gives each worker), then SGLangGenerationWorker._compute_server_args for that worker.
Nothing here needs a GPU: commands are built, no server is started. The GPU ids NeMo-RL's probe task would
report (get_reordered_bundle) are given.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
NEMO_RL = REPO.parent / "shared" / "upstream" / "nemo-rl"
SGLANG_PY = REPO / ".venv-sglang" / "bin" / "python"
WORKER = "nemo_rl.models.generation.sglang.sglang_worker.SGLangGenerationWorker"
NEMO_RL_SGLANG_PY = "/opt/nemo-rl/venvs/sglang/bin/python"  # what NeMo-RL's registry is made to name here

# Server arguments Belayer owns, so they differ from NeMo-RL's on purpose:
BELAYER_OWNED = {
    "host": "Belayer picks the host and port of every server it starts (it restarts servers on fresh ports)",
    "port": "as host",
    "nccl_port": "NeMo-RL allocates it for engines spanning nodes; a single-node engine's server picks its own",
    "dist_init_addr": "NeMo-RL's rendezvous for engines spanning nodes; single-node engines meet on 127.0.0.1",
}
# NeMo-RL's server arguments that the SGLang in .venv-sglang (a newer SGLang than NeMo-RL pins) no longer
# knows: its argparse cannot read them back, so for these the flag itself is checked.
NOT_IN_LOCAL_SGLANG = {"disable_piecewise_cuda_graph", "cuda_graph_bs", "cuda_graph_max_bs"}
CPU_FLAGS = ("--device cpu", "torch_native", "--max-total-tokens", "--cuda-graph-backend-decode",
             "--cuda-graph-backend-prefill", "--dtype float32")


@pytest.fixture(scope="module")
def sg():
    if not (NEMO_RL / "nemo_rl").is_dir():
        pytest.skip(f"NeMo-RL source not found at {NEMO_RL} (see .ci/setup_nemo_rl.sh)")
    os.environ.setdefault("BELAYER_NEMO_RL", str(NEMO_RL))
    from belayer_plugin.hooks.nemo_rl.upstream import import_grpo

    import_grpo()  # NeMo-RL's config modules need the TypedDict alias below Python 3.12
    import nemo_rl.models.generation.sglang.sglang_generation as m

    return m


@pytest.fixture
def nemo_rl_python(sg, monkeypatch):
    """NeMo-RL's actor environment registry names a plain interpreter for SGLangGenerationWorker (as with
    NEMO_RL_PY_EXECUTABLES_SYSTEM=1), so that resolving it builds no uv venv."""
    from nemo_rl.distributed.ray_actor_environment_registry import ACTOR_ENVIRONMENT_REGISTRY

    monkeypatch.setitem(ACTOR_ENVIRONMENT_REGISTRY, WORKER, NEMO_RL_SGLANG_PY)
    return NEMO_RL_SGLANG_PY


def _recipe(overrides: list[str], belayer_engines: dict | None = None) -> dict:
    """NeMo-RL's grpo_math_1B_sglang.yaml + recipes/nemo_rl/belayer.yaml, as examples/run_grpo.py loads a recipe."""
    from nemo_rl.utils.config import load_config, parse_hydra_overrides, register_omegaconf_resolvers
    from omegaconf import OmegaConf

    from belayer_plugin.config import recipes_dir

    register_omegaconf_resolvers()
    cfg = load_config(NEMO_RL / "examples" / "configs" / "grpo_math_1B_sglang.yaml")
    cfg = OmegaConf.merge(cfg, OmegaConf.load(recipes_dir() / "nemo_rl" / "belayer.yaml"))
    if belayer_engines:
        knobs = {"belayer": {"engines": belayer_engines}}
        cfg = OmegaConf.merge(cfg, {"policy": {"generation": {"sglang_cfg": knobs}}})
    if overrides:
        cfg = parse_hydra_overrides(cfg, overrides)
    return OmegaConf.to_container(cfg, resolve=True)


VARIANTS = {
    # NeMo-RL's recipe as shipped: 2 GPUs on one node, one GPU per engine
    "grpo_math_1B_sglang": dict(overrides=[], gpu_ids=[0, 1], bundles=[0, 1], cvd=None),
    # tensor parallel engines with the memory saver and the CPU weights backup; 4 GPUs, the driver seeing
    # physical GPUs 4-7 (NeMo-RL maps base_gpu_id through CUDA_VISIBLE_DEVICES), bundles reordered by topology
    "tp2_offload": dict(overrides=["policy.generation.sglang_cfg.tp_size=2",
                                   "policy.generation.sglang_cfg.sglang_server_config.num_gpus_per_engine=2",
                                   "policy.generation.sglang_cfg.sglang_server_config.num_gpus=4",
                                   "policy.generation.sglang_cfg.sglang_server_config.needs_offload=true",
                                   "policy.generation.sglang_cfg.sglang_server_config.cpu_weight_backup=true",
                                   "policy.generation.sglang_cfg.skip_server_warmup=false",
                                   "cluster.gpus_per_node=4"],
                        gpu_ids=[6, 7, 4, 5], bundles=[2, 3, 0, 1], cvd="4,5,6,7"),
}


class _FakePG:
    bundle_count = 4


def _nemo_rl_engines(sg, monkeypatch, gen: dict, gpus_per_node: int, gpu_ids, bundles) -> list[SimpleNamespace]:
    """What NeMo-RL's SGLangGeneration._start_engines gives each worker (rank, base_gpu_id, bundle, actor
    environment, addresses), recorded instead of creating Ray actors, then the server arguments that worker's
    _compute_server_args returns (as its init() calls it, in the worker's environment)."""
    workers: list[SimpleNamespace] = []

    class Recorder:
        @staticmethod
        def options(**options):
            class Handle:
                @staticmethod
                def remote(*args, **kwargs):
                    w = SimpleNamespace(options=options, args=args, kwargs=kwargs, init_kwargs=None)
                    w.init = SimpleNamespace(remote=lambda **kw: setattr(w, "init_kwargs", kw))
                    workers.append(w)
                    return w
            return Handle()

    def addresses(*, local_all_engines, **_):
        return {rank: {"dist_init_addr": f"10.0.0.9:{4100 + rank}", "port": 3000 + rank, "nccl_port": 3500 + rank,
                       "host": "10.0.0.9"} for rank, _ in local_all_engines}, {}

    monkeypatch.setattr(sg, "SGLangGenerationWorker", Recorder)
    monkeypatch.setattr(sg, "_allocate_rollout_engine_addr_and_ports_normal", addresses)
    srv = gen["sglang_cfg"]["sglang_server_config"]
    per_engine = srv["num_gpus_per_engine"]
    fake = SimpleNamespace(num_gpus_per_engine=per_engine, num_gpus_per_node=gpus_per_node, pg=_FakePG(),
                           pg_reordered_bundle_indices=list(bundles), pg_reordered_gpu_ids=list(gpu_ids),
                           all_engines=[None] * (srv["num_gpus"] // min(per_engine, gpus_per_node)),
                           rank_offset=0, gpu_offset=0, cluster=SimpleNamespace(max_colocated_worker_groups=1),
                           sglang_cfg=gen, router_ip="10.0.0.9", router_port=8600)
    sg.SGLangGeneration._start_engines(fake, {})
    from nemo_rl.models.generation.sglang.sglang_worker import SGLangGenerationWorker

    plain = SGLangGenerationWorker.__ray_metadata__.modified_class
    out = []
    for w in workers:
        env = w.options["runtime_env"]["env_vars"]
        worker = object.__new__(plain)  # its __init__ patches SGLang's files; it sets only these attributes
        worker.gpus_per_node, worker.sglang_cfg = w.args
        worker.rank, worker.base_gpu_id = w.kwargs["rank"], w.kwargs["base_gpu_id"]
        worker.num_gpus_per_engine = w.kwargs["num_gpus_per_engine"]
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")  # _to_local_gpu_id reads the worker's own environment
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        if env.get("CUDA_VISIBLE_DEVICES"):
            os.environ["CUDA_VISIBLE_DEVICES"] = env["CUDA_VISIBLE_DEVICES"]
        try:
            kwargs = worker._compute_server_args(w.init_kwargs["dist_init_addr"], w.init_kwargs["nccl_port"],
                                                 w.init_kwargs["host"], w.init_kwargs["port"])
        finally:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            if saved is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
        out.append(SimpleNamespace(rank=w.kwargs["rank"], base_gpu_id=w.kwargs["base_gpu_id"], env=env,
                                   bundle=w.options["scheduling_strategy"].placement_group_bundle_index,
                                   num_gpus=w.options["num_gpus"], py_executable=w.options["runtime_env"].get(
                                       "py_executable"), server_args=kwargs))
    return out


def _belayer_generation(sg, monkeypatch, gen: dict, gpus_per_node: int, gpu_ids, bundles):
    """The hook's SGLangGeneration subclass as its __init__ sets it up before starting the fleet (config, then
    _init_nemo_rl_state with NeMo-RL's placement group), on a cluster reporting `gpu_ids`."""
    import nemo_rl.distributed.virtual_cluster as vc

    from belayer_plugin.hooks.nemo_rl import belayer_config_from_sglang_cfg, fault_tolerant

    monkeypatch.setattr(vc, "get_reordered_bundle", lambda pg, *a, **k: (list(bundles), list(gpu_ids), ()))
    cluster = SimpleNamespace(num_gpus_per_node=gpus_per_node, use_gpus=True, max_colocated_worker_groups=1,
                              _init_placement_groups=lambda **kw: [_FakePG()])
    g = object.__new__(fault_tolerant(sg.SGLangGeneration))
    g.belayer = belayer_config_from_sglang_cfg(gen, gpus_per_node)
    g._init_nemo_rl_state(cluster, gen)
    return g


def _engine_command(g, monkeypatch, actor_id: str, port: int):
    """argv and the server's whole environment, as the engine actor `actor_id` would start its server: the
    actor runs with the hook's runtime_env and calls launch.server_command."""
    from belayer_plugin.engines.launch import server_command

    options = g.belayer_actor_options(actor_id)
    env_vars = (options.get("runtime_env") or {}).get("env_vars") or {}
    with monkeypatch.context() as m:
        for k, v in env_vars.items():
            m.setenv(k, v)
        argv, extra = server_command(g.belayer.engines, g.belayer.engines.model_path, "127.0.0.1", port, "default")
        server_env = {**os.environ, **extra}
    return options, env_vars, argv, server_env


_PARSE = r"""
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
out = []
for argv in json.load(sys.stdin):
    p = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(p)
    ns, unknown = p.parse_known_args(argv)
    out.append({"args": {k: v for k, v in vars(ns).items()}, "unknown": unknown,
                "dests": sorted({a.dest for a in p._actions})})
json.dump(out, sys.stdout, default=repr)
"""


def _parse_with_sglang(argvs: list[list[str]]):
    """SGLang's own argparse (ServerArgs.add_cli_args, as `sglang serve` builds it) on each argv, in .venv-sglang;
    None when that venv is absent."""
    if not SGLANG_PY.exists():
        return None
    r = subprocess.run([str(SGLANG_PY), "-c", _PARSE], input=json.dumps(argvs), capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def _flag_values(argv: list[str], flag: str) -> list[list[str]]:
    """The values after each occurrence of `flag` (up to the next flag)."""
    out = []
    for i, tok in enumerate(argv):
        if tok == flag:
            vals = []
            for t in argv[i + 1:]:
                if t.startswith("--"):
                    break
                vals.append(t)
            out.append(vals)
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_server_args_of_each_engine_are_nemo_rls_own(variant, sg, nemo_rl_python, monkeypatch):
    v = VARIANTS[variant]
    d = _recipe(v["overrides"])
    gen, per_node = d["policy"]["generation"], d["cluster"]["gpus_per_node"]
    if v["cvd"]:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", v["cvd"])
    else:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with monkeypatch.context() as m:
        nemo = _nemo_rl_engines(sg, m, gen, per_node, v["gpu_ids"], v["bundles"])
    g = _belayer_generation(sg, monkeypatch, gen, per_node, v["gpu_ids"], v["bundles"])
    try:
        assert len(g.all_engines) == len(nemo) == g.belayer.engines.num_engines >= 2
        commands = [_engine_command(g, monkeypatch, f"engine-{i}", 31000 + i) for i in range(len(nemo))]
        parsed = _parse_with_sglang([argv[3:] for _, _, argv, _ in commands])
        for i, (ref, (options, env_vars, argv, server_env)) in enumerate(zip(nemo, commands)):
            want = ref.server_args
            assert want["model_path"] == gen["sglang_cfg"]["model_path"] and want["base_gpu_id"] is not None
            # the actor sits on NeMo-RL's bundle for engine i, with NeMo-RL's environment for its worker i
            assert options["scheduling_strategy"].placement_group_bundle_index == ref.bundle
            assert options["num_gpus"] == ref.num_gpus
            for k in [k for k in ref.env if k.startswith("RAY_EXPERIMENTAL_NOSET_") or k == "CUDA_VISIBLE_DEVICES"]:
                assert server_env.get(k) == ref.env[k], k
            if v["cvd"]:
                assert server_env["CUDA_VISIBLE_DEVICES"] == v["cvd"]
            # the interpreter NeMo-RL runs its SGLang worker with
            assert argv[0] == ref.py_executable == nemo_rl_python
            assert argv[1:3] == ["-m", "sglang.launch_server"]
            if parsed is not None:
                got, unknown, dests = parsed[i]["args"], parsed[i]["unknown"], set(parsed[i]["dests"])
                skew = {k for k in want if k not in dests}
                assert skew <= NOT_IN_LOCAL_SGLANG, skew
                expected_unknown = []
                for k in sorted(skew, key=list(want).index):
                    if want[k] is True:
                        expected_unknown.append("--" + k.replace("_", "-"))
                    elif want[k] not in (None, False):
                        expected_unknown += ["--" + k.replace("_", "-"), str(want[k])]
                assert unknown == expected_unknown
            else:  # no SGLang to parse with: the arguments handed to the actor, before conversion
                got = json.loads(env_vars["BELAYER_SGLANG_SERVER_ARGS"])
                skew = set(NOT_IN_LOCAL_SGLANG)
            compared = 0
            for key, value in want.items():
                if key in BELAYER_OWNED or key in skew:
                    continue
                assert got.get(key) == value, f"engine {i}: {key}: Belayer {got.get(key)!r} != NeMo-RL {value!r}"
                compared += 1
            assert compared >= 20
            for key in skew:  # flags the local SGLang cannot read back: present exactly as NeMo-RL sets them
                flag = "--" + key.replace("_", "-")
                assert _flag_values(argv, flag) == ([[]] if want[key] is True else [] if want[key] in (None, False)
                                                    else [[str(want[key])]]), key
            # Belayer's own: its port and host; no NeMo-RL multi-node rendezvous (single-node engines)
            assert want["nnodes"] == 1
            assert _flag_values(argv, "--port") == [[str(31000 + i)]]
            assert _flag_values(argv, "--host") == [["127.0.0.1"]]
            assert "--nccl-port" not in argv and "--dist-init-addr" not in argv
            if parsed is not None:
                assert got["port"] == 31000 + i and got["host"] == "127.0.0.1"
                assert got["nccl_port"] is None and got["dist_init_addr"] is None
            # device cuda: nothing of Belayer's CPU set-up reaches the server
            joined = " ".join(argv)
            for flag in CPU_FLAGS:
                assert flag not in joined, flag
            assert ("--skip-server-warmup" in argv) == bool(want["skip_server_warmup"])
            assert ".venv-sglang" not in joined
            assert "sglang_standins" not in " ".join(str(x) for x in server_env.values())
            assert ".venv-sglang" not in " ".join(str(x) for x in server_env.values())
            assert "SGLANG_USE_CPU_ENGINE" not in server_env or os.environ.get("SGLANG_USE_CPU_ENGINE")
        # per engine: NeMo-RL's rank and GPU, so the arguments differ between engines
        assert len({ref.server_args["base_gpu_id"] for ref in nemo}) == len(nemo)
        # a standby takes engine (k mod N)'s bundle and server arguments
        _, sh_env, sh_argv, _ = _engine_command(g, monkeypatch, "shadow-0", 31000)
        assert sh_argv == commands[0][2] and sh_env == commands[0][1]
    finally:
        g.shutdown()


def test_server_args_tp2_variant_carries_tensor_parallelism_memory_saver_and_weights_backup(sg, nemo_rl_python,
                                                                                            monkeypatch):
    v = VARIANTS["tp2_offload"]
    d = _recipe(v["overrides"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", v["cvd"])
    g = _belayer_generation(sg, monkeypatch, d["policy"]["generation"], d["cluster"]["gpus_per_node"],
                            v["gpu_ids"], v["bundles"])
    try:
        for i, local_gpu in enumerate([2, 0]):  # physical 6 and 4 under CUDA_VISIBLE_DEVICES=4,5,6,7
            _, _, argv, _ = _engine_command(g, monkeypatch, f"engine-{i}", 31000 + i)
            for flag in ("--enable-memory-saver", "--enable-weights-cpu-backup"):
                assert argv.count(flag) == 1, flag
            assert _flag_values(argv, "--tp-size") == [["2"]]
            assert _flag_values(argv, "--base-gpu-id") == [[str(local_gpu)]]
            seed = d["policy"]["generation"]["sglang_cfg"]["random_seed"] + i
            assert _flag_values(argv, "--random-seed") == [[str(seed)]]
            assert "--skip-server-warmup" not in argv
        assert g.belayer.engines.sglang.tp_size == 2 and g.belayer.engines.sglang.device == "cuda"
    finally:
        g.shutdown()


def test_server_args_cpu_test_mode_keeps_belayers_cpu_flags_and_passes_none_of_nemo_rls(sg, monkeypatch):
    """`belayer.engines.sglang.device: cpu` (the CPU test mode): today's CPU command, .venv-sglang, the stand-ins,
    and no NeMo-RL server arguments in the actors' environment."""
    from belayer_plugin.engines.sglang import STANDINS_DIR
    from belayer_plugin.hooks.nemo_rl import belayer_config_from_sglang_cfg, fault_tolerant

    d = _recipe([], belayer_engines={"sglang": {"device": "cpu"}})
    gen = d["policy"]["generation"]
    cluster = SimpleNamespace(num_gpus_per_node=2, use_gpus=False, max_colocated_worker_groups=1,
                              _init_placement_groups=lambda **kw: [SimpleNamespace(bundle_count=2)])
    g = object.__new__(fault_tolerant(sg.SGLangGeneration))
    g.belayer = belayer_config_from_sglang_cfg(gen, 2)
    g._init_nemo_rl_state(cluster, gen)
    try:
        assert g.belayer_engine_env(0) == {}
        options, env_vars, argv, server_env = _engine_command(g, monkeypatch, "engine-0", 31000)
        assert "runtime_env" not in options and env_vars == {}
        joined = " ".join(argv)
        for flag in ("--device cpu", "--attention-backend torch_native", "--max-total-tokens 8192",
                     "--dtype float32", "--skip-server-warmup", "--cuda-graph-backend-decode disabled"):
            assert flag in joined, flag
        assert argv[0].endswith(".venv-sglang/bin/python") and server_env["PYTHONPATH"] == str(STANDINS_DIR)
        for flag in ("--tp-size", "--enable-memory-saver", "--enable-weights-cpu-backup", "--base-gpu-id"):
            assert flag not in argv, flag
    finally:
        g.shutdown()


def test_server_args_shipped_recipe_is_nemo_rls_gpu_setup_and_multi_node_engines_are_refused(sg):
    from belayer_plugin.config import ConfigError
    from belayer_plugin.hooks.nemo_rl import belayer_config_from_sglang_cfg

    d = _recipe([])
    s = belayer_config_from_sglang_cfg(d["policy"]["generation"], d["cluster"]["gpus_per_node"]).engines.sglang
    assert (s.device, s.python, s.dtype, s.attention_backend, s.max_total_tokens, s.standins_on_path) == \
        ("cuda", "nemo_rl", "", "", 0, False)
    assert s.enable_memory_saver is True and s.random_seed == 42 and s.extra_args == []
    d = _recipe(["policy.generation.sglang_cfg.tp_size=4", "cluster.gpus_per_node=2",
                 "policy.generation.sglang_cfg.sglang_server_config.num_gpus=4"])
    with pytest.raises(ConfigError, match="num_gpus_per_engine.*single-node"):
        belayer_config_from_sglang_cfg(d["policy"]["generation"], 2)


def test_server_args_convert_generically_to_launch_server_flags():
    from belayer_plugin.engines.sglang import server_args_argv, sglang_server_command
    from tests.conftest import belayer_cfg

    assert server_args_argv({"tp_size": 2, "trust_remote_code": True, "disable_cuda_graph": False,
                             "max_running_requests": None, "cuda_graph_bs": [1, 2, 4], "lora_paths": [],
                             "mem_fraction_static": 0.6, "json_model_override_args": {"a": 1}}) == \
        ["--tp-size", "2", "--trust-remote-code", "--cuda-graph-bs", "1", "2", "4", "--mem-fraction-static", "0.6",
         "--json-model-override-args", '{"a": 1}']
    cfg = belayer_cfg("belayer.engines.kind=sglang", "belayer.engines.sglang.device=cuda",
                      "belayer.engines.sglang.attention_backend=fa3", "belayer.engines.sglang.max_total_tokens=0",
                      "belayer.engines.sglang.dtype=float16", "belayer.engines.sglang.extra_args=[--log-level,debug]"
                      ).engines
    argv, _ = sglang_server_command(cfg, "/m", "127.0.0.1", 4000, server_kwargs={
        "dtype": "bfloat16", "host": "10.0.0.9", "port": 3000, "model_path": "/other", "tp_size": 2})
    # the trainer's keys win over engines.sglang; host, port, model path stay Belayer's; extra_args come last
    assert _flag_values(argv, "--dtype") == [["bfloat16"]] and _flag_values(argv, "--tp-size") == [["2"]]
    assert _flag_values(argv, "--attention-backend") == [["fa3"]]
    assert _flag_values(argv, "--host") == [["127.0.0.1"]] and _flag_values(argv, "--port") == [["4000"]]
    assert _flag_values(argv, "--model-path") == [["/m"]] and argv[-2:] == ["--log-level", "debug"]
    with pytest.raises(ValueError, match="nnodes"):
        sglang_server_command(cfg, "/m", "127.0.0.1", 4000, server_kwargs={"nnodes": 2})
