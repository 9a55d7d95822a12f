"""The checkpoint store shared by every node: checked at start-up on a cluster of more than one node.

The store is a directory (`sandbox.checkpoint_dir`) that must be the same shared file system (NFS, CephFS,
Lustre, a cloud file share) on every node: a sandbox whose node died is restored by another node from the
checkpoints its old node published there (atomically, by one rename: sandbox/checkpoint.py). A local path
passes on one node and fails on the next, so `check_shared_store` proves it: the driver writes a probe file
with a random token, a task on every alive node reads it back and writes its own probe beside it, and the
driver reads those. A node that cannot see the driver's probe (its own local directory of that name) or
cannot write, or that does not answer in time, is named in the error.

Owns: proving the checkpoint store (and run directory) is one shared writable directory on every node. Must
not: read or write checkpoints.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path
from typing import Any

PROBE = ".belayer-shared-probe-"


class StoreNotShared(RuntimeError):
    """The checkpoint store is not the same writable directory on every node of the cluster."""

    def __init__(self, root: Path, problems: dict[str, str], what: str = "sandbox.checkpoint_dir",
                 why: str = "a sandbox of a lost node is restored on another from it"):
        self.root, self.problems = root, problems
        super().__init__(f"{what} {root} is not one shared, writable directory on every node ({why}): "
                         + "; ".join(f"node {n}: {p}" for n, p in sorted(problems.items()))
                         + f". Set {what} to a path on a file system every node mounts.")


def _probe_on_node(root: str, token: str) -> tuple[str, str]:
    """Runs on one node: ("", "") when the driver's probe reads back and this node's own probe was written,
    else ("problem", "")."""
    base = Path(root)
    mine = base / f"{PROBE}{token}"
    try:
        seen = mine.read_text()
    except OSError as e:
        return f"cannot read the driver's probe {mine} ({type(e).__name__}: {e}): not the driver's directory", ""
    if seen != token:
        return f"{mine} holds other content than the driver wrote: not the driver's directory", ""
    node_id = _node_id()
    theirs = base / f"{PROBE}{token}-{node_id}"
    try:
        with open(theirs, "w") as f:
            f.write(node_id)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return f"cannot write in {base} ({type(e).__name__}: {e})", ""
    return "", str(theirs)


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def alive_nodes() -> dict[str, str]:
    """{node id: address} of the cluster's alive nodes."""
    import ray

    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}


async def check_shared_store(root: str | Path, timeout_s: float, what: str = "sandbox.checkpoint_dir",
                             why: str = "a sandbox of a lost node is restored on another from it") -> dict[str, str]:
    """Proves that `root` is one shared, writable directory on every alive node of the Ray cluster; returns
    {node address: probe file it wrote}. Raises StoreNotShared (`what` names the setting, `why` the need)
    naming each node that failed (or did not answer within `timeout_s`). On a one-node cluster it only checks
    that the driver can write there."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    base = Path(root)
    base.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    probe = base / f"{PROBE}{token}"
    problems: dict[str, str] = {}
    written: dict[str, str] = {}
    try:
        with open(probe, "w") as f:
            f.write(token)
            f.flush()
            os.fsync(f.fileno())
        nodes = alive_nodes()
        if len(nodes) <= 1:
            return {addr: str(probe) for addr in nodes.values()}
        task = ray.remote(_probe_on_node)
        refs: dict[str, Any] = {
            nid: task.options(num_cpus=0, max_retries=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
                nid, soft=False)).remote(str(base), token) for nid in nodes}

        async def one(nid: str) -> None:
            label = f"{nodes[nid]} ({nid[:8]})"
            try:
                problem, path = await asyncio.wait_for(asyncio.wrap_future(refs[nid].future()), timeout_s)
            except asyncio.TimeoutError:
                ray.cancel(refs[nid], force=True)
                problems[label] = f"no answer within {timeout_s:g} s (sandbox.shared_store_check_timeout_s)"
                return
            except Exception as e:
                problems[label] = f"probe failed: {type(e).__name__}: {str(e)[:200]}"
                return
            if problem:
                problems[label] = problem
            elif not Path(path).is_file() or Path(path).read_text() != nid:
                problems[label] = f"its probe {path} is not visible here: it wrote to a directory of its own"
            else:
                written[nodes[nid]] = path

        await asyncio.gather(*(one(nid) for nid in nodes))
    finally:
        for p in base.glob(f"{PROBE}{token}*"):
            try:
                p.unlink()
            except OSError:
                pass
    if problems:
        raise StoreNotShared(base, problems, what, why)
    return written
