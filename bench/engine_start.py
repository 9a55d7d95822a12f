"""Cold start of one engine: process start to first served token, CPU engine and SGLang on CPU.

Later benchmarks (shadow handover) compare against these figures.
Usage: python bench/engine_start.py [--quick] [--repeats N] [--kinds cpu,sglang]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from belayer_plugin.config import load_belayer_config  # noqa: E402
from belayer_plugin.engines.launch import free_port, server_command  # noqa: E402
from belayer_plugin.fleet.launch import resolve_model_path  # noqa: E402


def cold_start(cfg, model: str, timeout: float) -> float:
    """Seconds from spawning the server to its first generated token."""
    port = free_port()
    argv, env = server_command(cfg.engines, model, "127.0.0.1", port)
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        while time.monotonic() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"{cfg.engines.kind} server exited with {proc.returncode}")
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=30)
                if r.status_code == 200 and r.json()["output_ids"]:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"{cfg.engines.kind} engine not serving after {timeout} s")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=0)
    p.add_argument("--kinds", default="cpu,sglang")
    args = p.parse_args()
    repeats = args.repeats or (2 if args.quick else 5)
    results = {}
    for kind in args.kinds.split(","):
        cfg, _ = load_belayer_config("fleet_demo", [f"belayer.engines.kind={kind}"])
        if kind == "sglang":
            from belayer_plugin.engines.sglang import sglang_available

            if not sglang_available(cfg.engines):
                print("sglang: .venv-sglang not built (bash .ci/setup.sh --sglang); skipped")
                continue
        model = resolve_model_path(cfg)
        times = [cold_start(cfg, model, 300) for _ in range(repeats)]
        results[kind] = statistics.median(times)
        print(f"{kind:7s} cold start (process start -> first token): median {results[kind]:.2f} s "
              f"over {repeats}: {', '.join(f'{t:.2f}' for t in times)}")
    figures = " ".join(f"{k}_start_s={v:.2f}" for k, v in results.items())
    if "cpu" in results and "sglang" in results:
        figures += f" sglang_over_cpu={results['sglang'] / results['cpu']:.1f}"
    print(f"RESULT {figures}")


if __name__ == "__main__":
    main()
