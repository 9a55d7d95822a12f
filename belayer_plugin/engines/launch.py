"""How an engine's server process is started: the same interface for the CPU engine and real SGLang.

Owns: the command line and environment of each engine kind's server. Must not: start or watch processes
(engines/actor.py does); the host and port helpers live in engines/address.py (re-exported here).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from belayer_plugin.engines.address import engine_host, free_port

if TYPE_CHECKING:
    from belayer_plugin.config import EnginesConfig

__all__ = ["cpu_server_command", "engine_host", "free_port", "server_command"]


def cpu_server_command(cfg: "EnginesConfig", model_path: str, host: str, port: int,
                       weight_version: str) -> tuple[list[str], dict[str, str]]:
    """argv and extra environment for Belayer's CPU engine."""
    argv = [sys.executable, "-m", "belayer_plugin.engines.cpu_server", "--model-path", model_path,
            "--host", host, "--port", str(port), "--weight-version", weight_version,
            "--max-running-requests", str(cfg.max_running_requests), "--torch-threads", str(cfg.torch_threads),
            "--step-delay-ms", str(cfg.cpu_step_delay_ms)]
    # One thread per engine: several engines share a few cores, and oversubscription makes them all slow.
    env = {"OMP_NUM_THREADS": str(cfg.torch_threads), "MKL_NUM_THREADS": str(cfg.torch_threads)}
    return argv, env


def server_command(cfg: "EnginesConfig", model_path: str, host: str, port: int,
                   weight_version: str = "default") -> tuple[list[str], dict[str, str]]:
    """argv and extra environment for an engine of kind `cfg.kind`."""
    if cfg.kind == "cpu":
        return cpu_server_command(cfg, model_path, host, port, weight_version)
    if cfg.kind == "sglang":
        from belayer_plugin.engines.sglang import sglang_server_command

        return sglang_server_command(cfg, model_path, host, port, weight_version=weight_version)
    raise ValueError(f"unknown engine kind {cfg.kind!r}")
