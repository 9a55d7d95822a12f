#!/usr/bin/env bash
# NeMo-RL with Belayer: NeMo-RL's own examples/configs/grpo_math_1B_sglang.yaml + recipes/nemo_rl/belayer.yaml,
# composed with NeMo-RL's config loader and validated; then NeMo-RL's GRPO construction site (patched), refit
# (grpo.refit_policy_generation) and batch generation (SGLangGeneration.generate) for 3 steps on CPU, with one
# engine's server SIGKILLed mid-rollout at step 2. EXPECT=survival: every batch completes; the restarted engine
# stays out of the router until the next refit streams to it; then every engine serves the current version and
# greedy outputs agree across engines.
#   FAULT=rollout        (default) the kill above, mid-rollout at step 2
#   FAULT=refit_sigkill  engine-0's server SIGKILLed during step 2's weight stream (once the stream reaches it)
#   FAULT=refit_sigstop  engine-0's server SIGSTOPped during step 2's weight stream (fenced after
#                        engines.refit_request_timeout_s, set to 5 s here)
#   Refit faults: NeMo-RL's refit returns, step 2 generates on engine-1 at version 2 with engine-0 STALE and out of
#   the router, and step 3's refit brings engine-0 back at version 3.
# CPU replacements (README, NeMo-RL section): Belayer's CPU engines for SGLang, the tiny model for the 1B
# policy, CpuStreamingPolicy for the policy's CUDA-IPC weight streaming, no NVTX markers.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${BELAYER_PY:-$ROOT/.venv/bin/python}
NEMO_RL=${BELAYER_NEMO_RL:-$(dirname "$ROOT")/shared/upstream/nemo-rl}
EXPECT=survival
if [ ! -d "$NEMO_RL/nemo_rl" ]; then
  echo "nemo_rl_engine_kill: NeMo-RL source not found at $NEMO_RL -> SKIP"
  exit 0
fi
out=$(mktemp -d /tmp/belayer-nemo-rl-XXXXXX)
cd "$ROOT"
: "${FAULT:=rollout}"
case "$FAULT" in rollout|refit_sigkill|refit_sigstop) ;; *) echo "nemo_rl_engine_kill: FAULT is rollout, refit_sigkill or refit_sigstop" >&2; exit 2 ;; esac
BELAYER_NEMO_RL=$NEMO_RL OUT=$out EXPECT=$EXPECT FAULT=$FAULT "$PY" - "$@" <<'PYEOF'
import os, signal, sys, time
from pathlib import Path

from belayer_plugin.hooks.nemo_rl.upstream import cpu_nvtx_markers, import_grpo, nemo_rl_source

grpo = import_grpo()
cpu_nvtx_markers()
from nemo_rl.models.generation import configure_generation_config
from nemo_rl.utils.config import load_config, parse_hydra_overrides, register_omegaconf_resolvers
from omegaconf import OmegaConf

from belayer_plugin.config import cache_dir, recipes_dir
from belayer_plugin.engines.tiny_model import ensure_tiny
from belayer_plugin.hooks._config import belayer_section
from belayer_plugin.hooks.nemo_rl import belayer_config_from_sglang_cfg, patch_nemo_rl

out = Path(os.environ["OUT"])
tiny = str(ensure_tiny(cache_dir(belayer_section()) / "tiny-qwen2"))
register_omegaconf_resolvers()
cfg = load_config(nemo_rl_source() / "examples" / "configs" / "grpo_math_1B_sglang.yaml")
cfg = OmegaConf.merge(cfg, OmegaConf.load(recipes_dir() / "nemo_rl" / "belayer.yaml"))
# CPU: the tiny model for the 1B policy, Belayer's CPU engines for SGLang servers; command-line overrides last
cpu = [f"policy.model_name={tiny}", f"policy.tokenizer.name={tiny}", "policy.generation.max_new_tokens=16",
       "policy.generation.sglang_cfg.belayer.engines.kind=cpu",
       f"+policy.generation.sglang_cfg.belayer.run_dir={out}",
       "+policy.generation.sglang_cfg.belayer.shadow.shared_weights=false",
       "+policy.generation.sglang_cfg.belayer.monitor.probe_timeout_s=5",
       "+policy.generation.sglang_cfg.belayer.restart.backoff_initial_s=0",
       "+policy.generation.sglang_cfg.belayer.engines.refit_request_timeout_s=5"]
FAULT = os.environ["FAULT"]
cfg = parse_hydra_overrides(cfg, cpu + sys.argv[1:])
master = OmegaConf.to_container(cfg, resolve=True)
gen_cfg = master["policy"]["generation"]
bcfg = belayer_config_from_sglang_cfg(gen_cfg, master["cluster"]["gpus_per_node"])  # raises naming every problem
print(f"composed recipe valid: {bcfg.engines.num_engines} engines, toggle {bcfg.use_fault_tolerance}")

import ray
import torch
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from transformers import AutoModelForCausalLM, AutoTokenizer

from belayer_plugin.hooks.nemo_rl.cpu_policy import CpuStreamingPolicy
from belayer_plugin.ray_cluster import init_ray

init_ray(bcfg.ray)
tok = AutoTokenizer.from_pretrained(tiny)
gen_cfg = configure_generation_config(gen_cfg, tok)
n_gpus = master["cluster"]["gpus_per_node"] * master["cluster"]["num_nodes"]
cluster = RayVirtualCluster([master["cluster"]["gpus_per_node"]] * master["cluster"]["num_nodes"], use_gpus=False,
                            num_gpus_per_node=master["cluster"]["gpus_per_node"], max_colocated_worker_groups=1,
                            name="grpo_policy_cluster")
patch_nemo_rl()
t0 = time.monotonic()
pg = grpo.SGLangGeneration(cluster=cluster, sglang_cfg=gen_cfg)  # GRPO's construction site, patched
pg.finish_generation()
policy = CpuStreamingPolicy(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32), world_size=n_gpus)
policy.set_rollout_num_gpus_per_engine(pg.num_gpus_per_engine)
print(f"setup: {time.monotonic() - t0:.1f} s, placement {pg.belayer_placement}")
fm, ev = pg.belayer_fleet, pg.belayer_events
prompts = [tok.encode(p) for p in ("1+1=", "The capital of France is", "Solve 3x=9:", "2*7=")]
ids = torch.full((len(prompts), max(map(len, prompts))), gen_cfg["_pad_token_id"], dtype=torch.long)
for i, p in enumerate(prompts):
    ids[i, :len(p)] = torch.tensor(p)
batch = BatchedDataDict({"input_ids": ids, "input_lengths": torch.tensor([len(p) for p in prompts])})
problems, kill_t = [], None
try:
    for step in (1, 2, 3):
        with torch.no_grad():
            for p in policy.model.parameters():
                p.mul_(1.0 + 0.05 * step)  # "training"
        t = time.monotonic()
        refit_fault = step == 2 and FAULT != "rollout"
        if refit_fault:  # the fault lands once NeMo-RL's stream reaches engine-0 (through Belayer's refit gateway)
            victim = fm.slots["engine-0"]
            since = ev.events[-1].t

            def stream(rollout_engine_urls, buffer_size_bytes, _v=victim.info.pid):
                refs = type(policy).stream_weights_via_http(policy, rollout_engine_urls, buffer_size_bytes)
                loop = __import__("asyncio").new_event_loop()
                loop.run_until_complete(ev.wait_for(lambda e: e.kind == "refit_relayed" and e.subject == "engine-0",
                                                    timeout=120, since=since))
                loop.close()
                global kill_t
                kill_t = time.time()
                os.kill(_v, signal.SIGSTOP)
                if FAULT == "refit_sigkill":
                    os.kill(_v, signal.SIGKILL)
                return refs

            policy.stream_weights_via_http = stream
        try:
            grpo.refit_policy_generation(policy, pg, colocated_inference=True, _refit_buffer_size_gb=0.0001)
        finally:
            policy.__dict__.pop("stream_weights_via_http", None)
        refit_s = time.monotonic() - t
        states = fm.states()
        if refit_fault:
            print(f"step 2: the refit returned in {refit_s:.1f} s; engine-0 missed it: {pg.belayer_gateway.missed}")
            if fm.weights.version != "2" or states["engine-1"] != "HEALTHY" or states["engine-0"] == "HEALTHY" \
                    or "engine-0" not in pg.belayer_gateway.missed:
                problems.append(f"step 2: after a refit fault version {fm.weights.version}, states {states}, "
                                f"missed {pg.belayer_gateway.missed}")
        elif fm.weights.version != str(step) or set(states.values()) != {"HEALTHY"}:
            problems.append(f"step {step}: after refit version {fm.weights.version}, states {states}")
        if step == 2 and FAULT == "rollout":  # mid-rollout: SIGKILL engine-0's server, then generate at once
            victim = fm.slots["engine-0"]
            kill_t = time.time()
            os.killpg(victim.info.pid, signal.SIGKILL)
        t = time.monotonic()
        out_b = pg.generate(batch, greedy=True)
        gen_s = time.monotonic() - t
        lens = out_b["generation_lengths"].tolist()
        if min(lens) < 1:
            problems.append(f"step {step}: empty generations {lens}")
        if step == 2:
            ev_loop = __import__("asyncio").new_event_loop()
            aw = ev_loop.run_until_complete(ev.wait_for(lambda e: e.kind == "awaiting_weights" and e.subject == "engine-0",
                                                        timeout=300, since=kill_t))
            router = {w["url"] for w in __import__("httpx").get(fm.url + "/workers", timeout=5).json()["workers"]}
            s0 = fm.slots["engine-0"]
            if s0.health.state.value != "STALE" or s0.info.url in router:
                problems.append(f"restarted engine-0 is {s0.health.state.value}, in router: {s0.info.url in router}")
            print(f"step 2: engine-0 restarted, STALE and out of the router {aw.t - kill_t:.1f} s after the kill")
        print(f"step {step}: refit {refit_s:.2f} s -> version {fm.weights.version}; generate {gen_s:.2f} s, lengths {lens}")
        pg.finish_generation()
    pg.prepare_for_generation()
    versions = pg.verify_weight_versions()
    if set(versions.values()) != {"3"} or len(versions) != len(fm.slots):
        problems.append(f"final versions {versions}")
    import httpx
    outs = []
    for s in fm.slots.values():
        r = httpx.post(f"{s.info.url}/generate", json={"input_ids": prompts[1], "sampling_params":
                       {"max_new_tokens": 16, "temperature": 0.0}, "return_logprob": True}, timeout=120).json()
        outs.append([t[1] for t in r["meta_info"]["output_token_logprobs"]])
    if any(o != outs[0] for o in outs):
        problems.append(f"engines disagree on greedy output: {outs}")
    restarted = [e for e in ev.events if e.kind == "restarted"]
    if len(restarted) != 1:
        problems.append(f"expected exactly one restart, got {len(restarted)}")
finally:
    pg.shutdown()
    cluster.shutdown()
    ray.shutdown()
print(f"events: {out}/events.jsonl")
for p in problems:
    print("PROBLEM:", p)
print(f"nemo_rl_engine_kill EXPECT={os.environ['EXPECT']} -> {'FAIL' if problems else 'PASS'}")
sys.exit(1 if problems else 0)
PYEOF
