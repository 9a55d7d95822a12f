"""What a chunk per token costs a request on one CPU engine: plain vs streamed, side by side in one run.

The fault-tolerant client streams (a chunk per token, so a kill regenerates nothing); a plain client sends one
non-streaming POST. Sequential requests on one CPU engine server, interleaved round by round:

- plain: one non-streaming POST through a keep-alive aiohttp session;
- stream: the callback stream reader (`generation/stream_reader.py`) with 100 ms coalesced reads, a chunk
  per token (`stream_interval` 1, Belayer's default);
- final_only: the same reader with `stream_interval` past the request's length (the engine sends only the
  final chunk): what streaming costs without the chunk per token.

What it does not cover: SGLang (its chunks are built in the tokenizer manager's process, beside the scheduler),
concurrent requests, and the sandbox work of a training step (`overhead.py` measures that).

Last line: RESULT plain_ms=.. stream_ms=.. final_only_ms=.. stream_pct=.. final_only_pct=.. tokens=.. rounds=..
Usage: python bench/stream_chunks.py [--quick] [--tokens N] [--rounds N] [--logprobs]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


async def _wait_ready(session, url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited with {proc.returncode}")
        try:
            async with session.get(f"{url}/health") as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        await asyncio.sleep(0.1)  # a starting server offers no event to await; the deadline bounds this
    raise TimeoutError(f"{url} not ready within {timeout} s")


async def run(tokens: int, rounds: int, logprobs: bool) -> dict:
    import aiohttp

    from belayer_plugin.engines.launch import free_port
    from belayer_plugin.engines.tiny_model import ensure_tiny
    from belayer_plugin.generation.stream_reader import read_stream

    model = str(ensure_tiny(Path(os.environ.get("BELAYER_CACHE_DIR", ROOT / ".cache" / "belayer")) / "tiny-qwen2"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(Path(tempfile.mkdtemp(prefix="belayer-bench-chunks-")) / "engine.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "belayer_plugin.engines.cpu_server", "--model-path", model,
                             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    sp = {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    payload = {"input_ids": [54, 280, 487], "sampling_params": sp, "return_logprob": logprobs}
    final_only = {**payload, "sampling_params": {**sp, "stream_interval": tokens + 1}}
    try:
        async with aiohttp.ClientSession() as s:
            await _wait_ready(s, url, proc)

            async def plain() -> None:
                async with s.post(f"{url}/generate", json=payload) as r:
                    assert len((await r.json())["output_ids"]) == tokens

            async def stream(body: dict) -> None:
                await read_stream(url, body, 60, 60, lambda data, done: None, coalesce_s=0.1)

            arms = {"plain": plain, "stream": lambda: stream(payload), "final_only": lambda: stream(final_only)}
            for f in arms.values():  # warm-up: first-request costs out of the figures
                await f()
            times: dict[str, list[float]] = {k: [] for k in arms}
            for _ in range(rounds):
                for k, f in arms.items():
                    t = time.perf_counter()
                    await f()
                    times[k].append(time.perf_counter() - t)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
        log.close()
    return {k: statistics.median(v) * 1000 for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--logprobs", action="store_true", help="ask for logprobs, as the main job does")
    args = ap.parse_args()
    rounds = args.rounds or (10 if args.quick else 40)
    ms = asyncio.run(run(args.tokens, rounds, args.logprobs))
    pct = {k: 100.0 * (ms[k] / ms["plain"] - 1) for k in ("stream", "final_only")}
    print(f"{args.tokens} tokens{' with logprobs' if args.logprobs else ''}, median of {rounds} sequential requests "
          f"per arm: plain {ms['plain']:.1f} ms | streamed, a chunk per token {ms['stream']:.1f} ms "
          f"({pct['stream']:+.1f}%) | streamed, final chunk only {ms['final_only']:.1f} ms ({pct['final_only']:+.1f}%)")
    print(f"RESULT plain_ms={ms['plain']:.1f} stream_ms={ms['stream']:.1f} final_only_ms={ms['final_only']:.1f} "
          f"stream_pct={pct['stream']:.1f} final_only_pct={pct['final_only']:.1f} tokens={args.tokens} rounds={rounds}")


if __name__ == "__main__":
    main()
