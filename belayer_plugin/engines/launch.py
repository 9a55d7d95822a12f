"""How an engine's server process is started: the same interface for the CPU engine and real SGLang."""

from __future__ import annotations

import socket
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from belayer_plugin.config import EnginesConfig


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on `host`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def engine_host(configured: str) -> str:
    """The address an engine's server binds and names in its URL: `engines.host` when set, else the address
    of the node it runs on as Ray's control store registered it (127.0.0.1 on Belayer's loopback local cluster,
    the node's own address on a multi-node cluster), so that the router and the driver on another node reach
    it; 127.0.0.1 outside Ray. Never a wildcard: a server listens on one address."""
    if configured:
        return configured
    import ray

    if not ray.is_initialized():
        return "127.0.0.1"
    # Not ray.util.get_node_ip_address(): in a process without Ray's node object it answers with the interface
    # that routes to 8.8.8.8 (this VM's eth0), not the address the node is registered under (CI saw engines of
    # a loopback cluster advertise eth0's address).
    node_id = ray.get_runtime_context().get_node_id()
    for n in ray.nodes():
        if n.get("NodeID") == node_id and n.get("NodeManagerAddress"):
            return str(n["NodeManagerAddress"])
    return ray.util.get_node_ip_address()


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
