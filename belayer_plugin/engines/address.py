"""Where an engine's server listens: the address it binds and names in its URL, and a free port there.

Owns: choosing a host and a port. Must not: start servers or import any other engine module (both the CPU
engine's launch and real SGLang's use it).
"""

from __future__ import annotations

import socket


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
