"""What a chunk per token costs a request on one engine: plain vs streamed, side by side in one run.

The fault-tolerant client streams (a chunk per token, so a kill regenerates nothing); a plain client sends one
non-streaming POST. Sequential requests on one engine server (`--engine cpu`, Belayer's CPU engine, or
`--engine sglang`, real SGLang on this CPU from .venv-sglang), interleaved round by round:

- plain: one non-streaming POST through a keep-alive aiohttp session;
- stream: the callback stream reader (`generation/stream_reader.py`) with 100 ms coalesced reads, a chunk
  per token (`stream_interval` 1, Belayer's default);
- final_only: the same reader with `stream_interval` past the request's length (the engine sends only the
  final chunk): what streaming costs without the chunk per token.

What it does not cover: SGLang on a GPU node (there its chunks are built in the tokenizer manager's process,
beside a scheduler that does not wait for them; on this 2-core VM its processes share the cores), concurrent
requests, and the sandbox work of a training step (`overhead.py` measures that).

Last line: RESULT plain_ms=.. stream_ms=.. final_only_ms=.. stream_pct=.. final_only_pct=.. tokens=.. rounds=..
Usage: python bench/stream_chunks.py [--quick] [--engine cpu|sglang] [--tokens N] [--rounds N] [--logprobs]
                                    [--override KEY=VALUE ...]  (SGLang's recipe, e.g. its extra_args)
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


def _start(engine: str, port: int, log_path: Path, overrides: list[str]) -> subprocess.Popen:
    """One engine server on 127.0.0.1:`port`, in its own process group."""
    if engine == "sglang":
        from belayer_plugin.config import load_belayer_config
        from belayer_plugin.engines.sglang import launch_sglang_server, sglang_available
        from belayer_plugin.fleet.launch import resolve_model_path

        cfg, _ = load_belayer_config("fleet_demo", ["belayer.engines.kind=sglang", *overrides])
        if not sglang_available(cfg.engines):
            sys.exit("sglang: .venv-sglang not built (bash .ci/setup.sh --sglang)")
        return launch_sglang_server(cfg.engines, resolve_model_path(cfg), "127.0.0.1", port, log_path)
    from belayer_plugin.engines.tiny_model import ensure_tiny

    model = str(ensure_tiny(Path(os.environ.get("BELAYER_CACHE_DIR", ROOT / ".cache" / "belayer")) / "tiny-qwen2"))
    with open(log_path, "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "belayer_plugin.engines.cpu_server", "--model-path", model,
                                 "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})


async def run(engine: str, tokens: int, rounds: int, logprobs: bool, overrides: list[str]) -> dict:
    import aiohttp

    from belayer_plugin.engines.launch import free_port
    from belayer_plugin.generation.stream_reader import read_stream

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start(engine, port, Path(tempfile.mkdtemp(prefix="belayer-bench-chunks-")) / "engine.log", overrides)
    sp = {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    payload = {"input_ids": [54, 280, 487], "sampling_params": sp, "return_logprob": logprobs}
    final_only = {**payload, "sampling_params": {**sp, "stream_interval": tokens + 1}}
    try:
        async with aiohttp.ClientSession() as s:
            await _wait_ready(s, url, proc, 300 if engine == "sglang" else 120)

            async def plain() -> None:
                async with s.post(f"{url}/generate", json=payload) as r:
                    assert len((await r.json())["output_ids"]) == tokens

            async def stream(body: dict) -> None:
                await read_stream(url, body, 60, 60, lambda data, done, n: None, coalesce_s=0.1)

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
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        try:  # SGLang's scheduler and detokenizer are children in the same group
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return {k: statistics.median(v) * 1000 for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--engine", choices=["cpu", "sglang"], default="cpu")
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--logprobs", action="store_true", help="ask for logprobs, as the main job does")
    ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                    help="a recipe override for the SGLang server, e.g. belayer.engines.sglang.extra_args=[--incremental-streaming-output]")
    args = ap.parse_args()
    if args.override and args.engine != "sglang":
        ap.error("--override applies to --engine sglang")
    rounds = args.rounds or (10 if args.quick else 40)
    ms = asyncio.run(run(args.engine, args.tokens, rounds, args.logprobs, args.override))
    pct = {k: 100.0 * (ms[k] / ms["plain"] - 1) for k in ("stream", "final_only")}
    print(f"{args.engine} engine, {args.tokens} tokens{' with logprobs' if args.logprobs else ''}, median of {rounds} sequential requests "
          f"per arm: plain {ms['plain']:.1f} ms | streamed, a chunk per token {ms['stream']:.1f} ms "
          f"({pct['stream']:+.1f}%) | streamed, final chunk only {ms['final_only']:.1f} ms ({pct['final_only']:+.1f}%)")
    print(f"RESULT plain_ms={ms['plain']:.1f} stream_ms={ms['stream']:.1f} final_only_ms={ms['final_only']:.1f} "
          f"stream_pct={pct['stream']:.1f} final_only_pct={pct['final_only']:.1f} tokens={args.tokens} rounds={rounds} engine={args.engine}")


if __name__ == "__main__":
    main()
