"""Cold start of one engine: process start to first served token, CPU engine and SGLang on CPU.

Kinds: cpu (Belayer's CPU engine as fleets start it: native_lm's Qwen2 forward, no transformers import),
cpu_transformers (the same server with --model-impl transformers), sglang. Each start also reports the CPU
seconds its leader process spent until it was killed after the first token.
Later benchmarks (shadow handover) compare against these figures.
Usage: python bench/engine_start.py [--quick] [--repeats N] [--kinds cpu,cpu_transformers,sglang]
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


# bench kind -> the CPU engine's --model-impl (through its environment variable)
_CPU_IMPL = {"cpu": "auto", "cpu_transformers": "transformers"}


def cold_start(cfg, model: str, timeout: float, extra_env: dict) -> tuple[float, float]:
    """Seconds from spawning the server to its first generated token, and the CPU seconds it spent."""
    port = free_port()
    argv, env = server_command(cfg.engines, model, "127.0.0.1", port)
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, env={**os.environ, **env, **extra_env}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        took = _first_token(cfg, proc, port, t0, timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # it exited (and was reaped) on its own: that error is the one to see
            pass
    # Reaped here rather than by Popen, for the server's own CPU time (its rusage).
    _, _, ru = os.wait4(proc.pid, 0)
    proc.returncode = -signal.SIGKILL
    return took, ru.ru_utime + ru.ru_stime


def _first_token(cfg, proc: subprocess.Popen, port: int, t0: float, timeout: float) -> float:
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=0)
    p.add_argument("--kinds", default="cpu,cpu_transformers,sglang")
    args = p.parse_args()
    repeats = args.repeats or (2 if args.quick else 5)
    results, cpus = {}, {}
    for kind in args.kinds.split(","):
        extra_env = {"BELAYER_CPU_MODEL_IMPL": _CPU_IMPL[kind]} if kind in _CPU_IMPL else {}
        engine_kind = "cpu" if kind.startswith("cpu") else kind
        cfg, _ = load_belayer_config("fleet_demo", [f"belayer.engines.kind={engine_kind}"])
        if kind == "sglang":
            from belayer_plugin.engines.sglang import sglang_available

            if not sglang_available(cfg.engines):
                print("sglang: .venv-sglang not built (bash .ci/setup.sh --sglang); skipped")
                continue
        model = resolve_model_path(cfg)
        runs = [cold_start(cfg, model, 300, extra_env) for _ in range(repeats)]
        times, cpu = [t for t, _ in runs], [c for _, c in runs]
        results[kind], cpus[kind] = statistics.median(times), statistics.median(cpu)
        print(f"{kind:16s} cold start (process start -> first token): median {results[kind]:.2f} s "
              f"over {repeats}: {', '.join(f'{t:.2f}' for t in times)}; leader CPU median {cpus[kind]:.2f} s")
    figures = " ".join(f"{k}_start_s={v:.2f} {k}_cpu_s={cpus[k]:.2f}" for k, v in results.items())
    if "cpu" in results and "cpu_transformers" in results:
        figures += f" transformers_over_native={results['cpu_transformers'] / results['cpu']:.2f}"
    if "cpu" in results and "sglang" in results:
        figures += f" sglang_over_cpu={results['sglang'] / results['cpu']:.1f}"
    print(f"RESULT {figures}")


if __name__ == "__main__":
    main()
