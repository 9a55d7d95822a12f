"""Chunked token-level resume on verl's own replicas: what it costs without a fault, what it saves at a kill.

Setup: verl 0.9.1's vLLMReplica x2 in hybrid mode under verl's LLMServerManager and load balancer (Belayer's, from
the recipe), as tests/test_verl_real_replicas.py builds them; the server actor is hooks/verl/standins.py's
VllmServerStandin over a Belayer CPU engine that waits --step-delay-ms per decode step (a real model's step; the
tiny model alone decodes in ~0.5 ms and would make any client look expensive).

1. Fault-free: --requests concurrent greedy requests of --tokens tokens through verl's own LLMServerClient (one
   RPC per request) and through BelayerLLMServerClient at chunk_tokens 32, 64 and 128 (one RPC per chunk, each
   re-prefilling the committed tokens), in interleaved rounds (the order rotates); per chunk size the median
   of the rounds' overheads against verl's client of the same round, with min..max.
2. A kill at 90%: one request of --tokens tokens whose server is SIGKILLed once 90% of its tokens are out (read
   from the server's own served counter, so the kill lands on a chunk boundary at or past 90%). Belayer: kill ->
   finish, resumed on the other replica from the committed tokens. verl: the step fails (verl's client has no
   resume) and the trainer's rerun regenerates the request from its prompt; timed as that request alone on the
   surviving replica (a lower bound: no trainer restart, no other request's loss). The dead replica is restarted
   between repeats through the trainer's own sequence (sleep, weight sync).

CPU figures are indicative only (engine step emulated, 2 cores shared by everything).
Last line: RESULT chunk_overhead_pct=<at the default chunk_tokens> overhead_32=.. overhead_64=.. overhead_128=..
kill_belayer_s=.. kill_verl_s=.. ratio=<verl / belayer kill -> finish>
Usage: python bench/verl_chunks.py [--quick] [--rounds R] [--repeats K] [--tokens T] [--requests N]
       [--step-delay-ms D]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHUNKS = (32, 64, 128)
DEFAULT_CHUNK = 128  # recipes/verl/belayer.yaml


def _prompts(n: int) -> list[list[int]]:
    return [[40 + i, 41 + 2 * i, 300 - i, 77, 12 + i] for i in range(n)]


def _sp(tokens: int) -> dict:
    return {"temperature": 0.0, "max_tokens": tokens, "logprobs": False, "ignore_eos": True}


async def _round(client, prompts: list[list[int]], tokens: int, tag: str) -> tuple[float, list[list[int]]]:
    t0 = time.monotonic()
    outs = await asyncio.gather(*(client.generate(f"{tag}-{i}", prompt_ids=p, sampling_params=_sp(tokens))
                                  for i, p in enumerate(prompts)))
    return time.monotonic() - t0, [list(o.token_ids) for o in outs]


def _client(run, chunk: int):
    from omegaconf import OmegaConf

    from belayer_plugin.hooks.verl.client import BelayerLLMServerClient

    cfg = OmegaConf.create(OmegaConf.to_container(run.cfg, resolve=False))
    cfg.belayer.recovery = OmegaConf.merge(cfg.belayer.recovery, {"chunk_tokens": chunk})
    return BelayerLLMServerClient(cfg, run.lb)


async def _kill_at(run, client, tokens: int, frac: float) -> dict:
    """One request; its server SIGKILLed once `frac` of its tokens are generated (the engine's own counter, so
    the kill lands inside a chunk, not after it). Returns kill -> finish, and verl's rerun of the request."""
    import httpx

    replicas = run.servers.get_replicas()
    urls = [f"http://{r.server_address}" for r in replicas]
    async with httpx.AsyncClient(timeout=10) as h:
        async def generated() -> list[int]:
            return [(await h.get(f"{u}/server_info")).json()["belayer_counters"]["generated_tokens"] for u in urls]

        before = await generated()
        task = asyncio.create_task(client.generate("kill-probe", prompt_ids=_prompts(1)[0],
                                                   sampling_params=_sp(tokens)))
        deadline = time.monotonic() + 300
        while True:
            now = await generated()
            grown = [n - b for n, b in zip(now, before)]
            if sum(grown) >= int(frac * tokens):
                break
            if task.done() or time.monotonic() > deadline:
                raise RuntimeError(f"the request ended before {frac:.0%} of its tokens: {grown}")
            await asyncio.sleep(0.005)  # observing the engines' counters (no event to await), bounded above
    victim = replicas[max(range(len(urls)), key=lambda i: now[i] - before[i])]
    os.kill(await victim.server_handle.pid.remote(), signal.SIGKILL)
    t_kill = time.monotonic()
    out = await asyncio.wait_for(task, 300)
    took = time.monotonic() - t_kill
    # verl's arm: the same request from its prompt on the surviving server (verl's server RPC, as its client
    # sends it), after the step failed
    survivor = next(r for r in replicas if r is not victim).server_handle
    t0 = time.monotonic()
    await survivor.generate.remote(request_id="redo", prompt_ids=_prompts(1)[0], sampling_params=_sp(tokens))
    return {"kill_to_finish_s": took, "rerun_s": time.monotonic() - t0, "ids": list(out.token_ids),
            "resumed_from": out.extra_fields["belayer"]["resumed_from"]}


def _heal(run) -> None:
    """The trainer's own sequence brings the dead replica back (Belayer's guards restart it in sleep, the sync
    loads it, the agent loop manager admits it)."""
    run.ckpt.sleep_replicas()
    run.step += 1
    run.ckpt.update_weights(run.step)
    asyncio.run(run.agents.heal_replicas())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="3 rounds, 2 kill repeats, 128 tokens")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--step-delay-ms", type=float, default=5.0)
    a = p.parse_args(argv)
    if a.quick:
        a.rounds, a.repeats, a.tokens = 3, 2, 128

    from belayer_plugin.engines.tiny_model import ensure_tiny
    from belayer_plugin.hooks.verl.standins import install_server_standin
    from belayer_plugin.ray_cluster import init_ray
    from tests.conftest import belayer_cfg
    from tests.test_hooks_verl_replicas import verl_config
    from tests.test_verl_real_replicas import RealRun

    os.environ.setdefault("BELAYER_CACHE_DIR", str(ROOT / ".cache" / "belayer"))
    model = str(ensure_tiny(Path(os.environ["BELAYER_CACHE_DIR"]) / "tiny-qwen2"))
    install_server_standin("vllm")
    init_ray(belayer_cfg().ray, num_gpus=2)
    cfg = verl_config(model, Path(tempfile.mkdtemp(prefix="belayer-verl-bench-")), legacy=True)
    cfg.actor_rollout_ref.rollout.name = "vllm"
    cfg.actor_rollout_ref.rollout.response_length = a.tokens
    cfg.actor_rollout_ref.rollout.prompt_length = 64
    cfg.actor_rollout_ref.rollout.custom = {"belayer": {"engines": {"cpu_step_delay_ms": a.step_delay_ms,
                                                                    "max_running_requests": 64,
                                                                    "startup_timeout_s": 180}}}
    cfg.belayer.recovery = {**cfg.belayer.recovery, "stall_timeout_s": 60, "request_timeout_s": 600}
    run = RealRun(cfg)
    run.cfg = cfg
    try:
        run.start()
        prompts = _prompts(a.requests)
        verl_client = run.servers.get_client()
        clients = {c: _client(run, c) for c in CHUNKS}
        arms = ["verl", *CHUNKS]
        asyncio.run(_round(verl_client, prompts[:2], 16, "warm"))
        overheads: dict[int, list[float]] = {c: [] for c in CHUNKS}
        for r in range(a.rounds):
            order = arms[r % len(arms):] + arms[:r % len(arms)]
            times, ids = {}, {}
            for arm in order:
                client = verl_client if arm == "verl" else clients[arm]
                times[arm], ids[arm] = asyncio.run(_round(client, prompts, a.tokens, f"r{r}-{arm}"))
            for c in CHUNKS:
                if ids[c] != ids["verl"]:
                    print(f"round {r}: chunk {c} ids differ from verl's client", file=sys.stderr)
                    return 1
                overheads[c].append(100.0 * (times[c] / times["verl"] - 1))
            print(f"round {r}: " + ", ".join(f"{k}={v:.2f}s" for k, v in times.items()), flush=True)
        med = {c: statistics.median(v) for c, v in overheads.items()}
        for c in CHUNKS:
            print(f"chunk_tokens={c}: overhead median {med[c]:+.2f}% (min {min(overheads[c]):+.2f}%, "
                  f"max {max(overheads[c]):+.2f}%, {a.rounds} rounds of {a.requests} x {a.tokens} tokens)")

        ours, verls = [], []
        for k in range(a.repeats):
            res = asyncio.run(_kill_at(run, clients[DEFAULT_CHUNK], a.tokens, 0.9))
            if not res["resumed_from"]:
                print(f"kill {k}: the request was not resumed (the kill missed it)", file=sys.stderr)
                return 1
            ours.append(res["kill_to_finish_s"])
            t = res["rerun_s"]
            verls.append(t)
            print(f"kill {k}: belayer kill->finish {res['kill_to_finish_s']:.2f}s (resumed from "
                  f"{res['resumed_from']}), verl's rerun {t:.2f}s", flush=True)
            _heal(run)
        kb, kv = statistics.median(ours), statistics.median(verls)
        print(f"RESULT chunk_overhead_pct={med[DEFAULT_CHUNK]:.2f} " + " ".join(
            f"overhead_{c}={med[c]:.2f}" for c in CHUNKS) + f" kill_belayer_s={kb:.2f} kill_verl_s={kv:.2f} "
              f"ratio={kv / kb:.2f}")
        return 0
    finally:
        run.close()


if __name__ == "__main__":
    sys.exit(main())
