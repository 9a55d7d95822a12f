"""No false hang alarm over a long prefill on real SGLang (CPU): a 6k-token prompt joins an engine that is
streaming other requests, through Belayer's token-level client with the default progress knobs.

A long prefill silences every other stream on its engine until the prefill is done: exactly what a hang
looks like to a detector that only watches tokens. Belayer's progress tracker knows the prompt length of
each request it sent (`monitor.progress.prefill_s_per_1k_tokens`), so it waits that silence out. This
script shows it on SGLang 0.5.23 on CPU, with a small model built here (the tiny test model's context is
only 4096 tokens): the streams' longest silence while the prompt is prefilled, the long request's time to
its first token, and every progress suspicion of the (healthy) engine.

Last line: RESULT false_alarms=.. suspicions=.. prompt_tokens=.. ttft_s=.. max_silence_s=.. floor_s=..
  false_alarms: SUSPECT or DEAD transitions from token progress on the healthy engine (goal 0);
  suspicions: SUSPECT or DEAD transitions from any signal (probes included);
  max_silence_s: the longest gap between two chunks of the streaming requests while the long prompt ran;
  floor_s: the silence that alone would count as a hang without the prefill allowance (monitor floor).
Needs .venv-sglang (bash .ci/setup.sh --sglang). Usage: python bench/long_prefill.py [--quick] [--tokens N] [--override KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from belayer_plugin.config import cache_dir, load_belayer_config  # noqa: E402
from belayer_plugin.events import EventLog  # noqa: E402
from belayer_plugin.fleet.manager import FleetManager  # noqa: E402
from belayer_plugin.generation.resumable import FleetSelector, ResumableGenerator  # noqa: E402
from belayer_plugin.ray_cluster import init_ray  # noqa: E402
from detection import _progress_alarms  # noqa: E402  (the same count of suspicions as the detection bench)

# Big enough that a 6k-token prefill takes seconds on CPU, with room for it in the context.
MODEL = dict(hidden_size=256, num_layers=4, num_heads=8, max_positions=16384)


def ensure_model(root: Path) -> str:
    """A small random Qwen2 with a 16k context, built once under the cache dir."""
    from belayer_plugin.engines.tiny_model import make_tiny

    p = root / "long-qwen2-{hidden_size}x{num_layers}".format(**MODEL)
    if not (p / "model.safetensors").exists():
        tmp = p.with_name(p.name + f".tmp{random.randint(0, 1 << 30)}")
        make_tiny(tmp, **MODEL)
        tmp.rename(p)  # a half-built model directory is never served
    return str(p)


async def main_async(args) -> None:
    overrides = ["belayer.engines.kind=sglang", "belayer.engines.num_engines=1", "belayer.use_fault_tolerance=true",
                 "belayer.shadow.num_standby=0", "belayer.engines.startup_timeout_s=300",
                 "belayer.monitor.probe_timeout_s=5", "belayer.recovery.stall_timeout_s=120"] + args.override
    cfg, _ = load_belayer_config("fleet_demo", overrides)
    model = ensure_model(cache_dir(cfg))
    init_ray(cfg.ray)
    run_dir = Path(tempfile.mkdtemp(prefix="belayer-bench-prefill-"))
    fm = FleetManager(cfg, run_dir, EventLog(run_dir / "events.jsonl"), model_path=model)
    await fm.start()
    gen = ResumableGenerator(FleetSelector(fm), cfg.recovery, fm.events)
    rng = random.Random(0)
    long_prompt = [rng.randrange(3, 512) for _ in range(args.tokens)]
    stop = asyncio.Event()
    chunk_times: list[float] = []
    m = cfg.monitor.progress
    try:
        async def stream(i: int) -> None:  # keeps a request streaming until told to stop
            while not stop.is_set():
                await gen.generate(f"load{i}-{time.time()}", [54 + i, 280, 487], {
                    "max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True},
                    on_progress=lambda log, seg: chunk_times.append(time.monotonic()))

        loaders = [asyncio.create_task(stream(i)) for i in range(2)]
        while len(chunk_times) < 4 * m.min_gaps:  # watched: the tracker has seen enough gaps
            await asyncio.sleep(0.05)  # the load's own progress; bounded by the check below
            if any(t.done() for t in loaders):
                raise RuntimeError(f"load failed: {[t.exception() for t in loaders if t.done()]}")
        t_watch = time.time()
        t0 = time.monotonic()
        first: list[float] = []
        _, resp = await gen.generate("long", long_prompt, {"max_new_tokens": 8, "temperature": 0.0},
                                     on_progress=lambda log, seg: first or first.append(time.monotonic()))
        t_end = time.monotonic()
        await asyncio.sleep(2 * cfg.monitor.probe_interval_s)  # the monitor's next rounds see the aftermath
        stop.set()
        await asyncio.wait_for(asyncio.gather(*loaders), 120)
        alarms = _progress_alarms(fm, t_watch)
        # Any suspicion at all (a readiness probe that timed out behind the prefill would be one too).
        suspicions = [e for e in fm.events.events if e.t >= t_watch and e.kind == "transition"
                      and e.to_state in ("SUSPECT", "DEAD")]
        during = [b - a for a, b in zip(chunk_times, chunk_times[1:]) if a >= t0 - 1 and b <= t_end + 1]
        ttft = first[0] - t0
        print(f"SGLang CPU, 1 engine streaming 2 requests; a {args.tokens}-token prompt: first token after "
              f"{ttft:.2f} s, all {len(resp['output_ids'])} tokens after {t_end - t0:.2f} s; longest silence of the "
              f"streams meanwhile {max(during):.2f} s (progress floor {m.floor_s} s, allowance "
              f"{m.prefill_s_per_1k_tokens} s per 1k prompt tokens); progress suspicions: {len(alarms)}, any "
              f"suspicion: {len(suspicions)} " + str([(e.subject, e.to_state, e.reason) for e in suspicions]))
        print(f"RESULT false_alarms={len(alarms)} suspicions={len(suspicions)} prompt_tokens={args.tokens} "
              f"ttft_s={ttft:.2f} max_silence_s={max(during):.2f} floor_s={m.floor_s}")
    finally:
        stop.set()
        await gen.aclose()
        await fm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a 3000-token prompt")
    ap.add_argument("--tokens", type=int, default=0, help="prompt tokens (default 6000)")
    ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                    help="a recipe override, e.g. belayer.monitor.progress.prefill_s_per_1k_tokens=0 (the "
                         "counterfactual: without the prefill allowance the same silence is an alarm)")
    args = ap.parse_args()
    args.tokens = args.tokens or (3000 if args.quick else 6000)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
