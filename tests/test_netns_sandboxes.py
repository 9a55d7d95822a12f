"""Sandboxes on every node (`sandbox.placement: spread`, sandbox/remote.py), on a real multi-node cluster.

A Ray head (node A, the root namespace, where the driver lives) and worker nodes B and C, each in its own network
namespace with its own address (tests/netns_cluster.py). Three scripted trajectories (an in-memory daemon and
files: sandbox/scripted.py) open through SandboxHosts, one per node, each checkpointed (CRIU) at every committed
boundary into the shared store. Node B is lost (every process in its namespace SIGKILLed, its container killed)
while its trajectory's third action runs. Then: B's trajectory continues on another node from the store with the
context of the boundary restored, and all three end in the fault-free final state.

Where each container runs is read from the kernel, not from Belayer: the network namespace of the container's
conmon (`ip netns identify`), which podman started from the node's host actor.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

if __name__ == "__main__":  # run as the scenario's driver: the repository's root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.netns_cluster import netns_cluster, run_driver  # noqa: E402

TAG = "NETNS"
N_ACTIONS = 5  # each trajectory's actions; B is lost during the third of its own


@pytest.fixture(scope="module")
def cluster():
    with netns_cluster(workers=("b", "c")) as c:
        yield c


def _netns_of(cid: str) -> str:
    """The network namespace (by name; "" for the root one) of the container's conmon, by the kernel's account."""
    pid = subprocess.run(["podman", "inspect", "--format", "{{.State.ConmonPid}}", cid], capture_output=True,
                         text=True, timeout=30, check=True).stdout.strip()
    return subprocess.run(["ip", "netns", "identify", pid], capture_output=True, text=True, timeout=30,
                          check=True).stdout.strip()


@pytest.mark.timeout(420)
def test_sandboxes_go_to_every_node_and_a_lost_nodes_trajectory_continues_on_another_from_its_boundary(
        cluster, tmp_path):
    from belayer_plugin.sandbox.scripted import golden_state, tokens

    fig = run_driver(__file__, cluster, tmp_path, TAG, 360, BELAYER_NETNS_SCENARIO="sandboxes")
    print("NETNS_SANDBOXES", {k: v for k, v in fig.items() if k != "final"})
    netns = {n.netns: name for name, n in cluster.nodes.items() if name != "a"}
    ran_on = {tid: netns.get(ns, "a") for tid, ns in fig["netns"].items()}
    assert sorted(ran_on.values()) == ["a", "b", "c"], ran_on  # one trajectory per node, by the kernel's account
    victim = next(t for t, n in ran_on.items() if n == "b")
    assert fig["victim"] == victim and fig["b_killed_processes"] > 0
    mv = fig["moved"]
    assert mv["from_node"] == cluster.nodes["b"].ip and mv["node"] != cluster.nodes["b"].ip, mv
    assert netns.get(fig["netns_after_move"], "a") in ("a", "c")  # the kernel agrees: off B
    # the context goes back to exactly the boundary restored (its checkpoint was published before the loss)
    rb = fig["rollback"]
    assert rb["boundary"] in (2, 3) and rb["token_ids"] == tokens(rb["boundary"]) and rb["checkpoint_id"], rb
    assert fig["lost_calls"] and all("did not answer" in r or "is lost" in r for r in fig["lost_calls"])
    for tid, state in fig["final"].items():
        assert state == golden_state(N_ACTIONS), (tid, state)


async def scenario_sandboxes(cluster, run_dir: Path) -> dict:
    from belayer_plugin.envs.build import ensure_image  # noqa: F401  (the hosts build it on their node)
    from belayer_plugin.sandbox.base import SandboxSpec
    from belayer_plugin.sandbox.podman import PodmanBackend
    from belayer_plugin.sandbox.remote import HostLost, SandboxHosts
    from belayer_plugin.sandbox.scripted import QUERY, STATED, action, messages, tokens
    from belayer_plugin.sandbox.shared_store import alive_nodes
    from tests.conftest import belayer_cfg

    cfg = belayer_cfg("belayer.sandbox.placement=spread", "belayer.sandbox.checkpoint_mode=full",
                      "belayer.sandbox.keep_checkpoints=3", "belayer.sandbox.host_timeout_s=20",
                      "belayer.sandbox.exec_timeout_s=30")
    events: list[dict] = []
    hosts = SandboxHosts(cfg.sandbox, run_dir / "sandbox-checkpoints", events.append)
    fig: dict = {"lost_calls": []}
    try:
        images = await asyncio.to_thread(hosts.start, alive_nodes())
        image = next(iter(images.values()))
        spec = SandboxSpec(image=image, memory_mb=128)
        recs = [await asyncio.to_thread(hosts.recorder, f"traj-{i}", spec, events.append) for i in range(3)]
        fig["netns"] = {r.trajectory_id: await asyncio.to_thread(_netns_of, r.container_id) for r in recs}
        victim = next(r for r in recs if r.host.node == cluster.nodes["b"].ip)
        fig["victim"] = victim.trajectory_id
        daemon = base64.b64encode(STATED.encode()).decode()

        def open_and_run(rec, upto: int) -> None:
            setup = (f"mkdir -p /opt && echo {daemon} | base64 -d > /opt/stated.sh && mkfifo /tmp/ready && "
                     "(sh /opt/stated.sh </dev/null >/dev/null 2>&1 &) && cat /tmp/ready")
            r = rec.sandbox.exec(setup, 20)
            assert r.stdout.strip() == "ready", r
            rec.start(tokens(0), messages(0), checkpoint=True)
            run_actions(rec, 1, upto)

        def run_actions(rec, first: int, last: int) -> None:
            for i in range(first, last + 1):
                rec.begin_action(action(i))
                r = rec.sandbox.exec(action(i)["command"], 20)
                assert r.exit_code == 0, r
                rec.commit(tokens(i), messages(i), r)
                assert rec.checkpoint(i) is not None

        await asyncio.gather(*(asyncio.to_thread(open_and_run, r, 2) for r in recs))
        others = [r for r in recs if r is not victim]
        rest = [asyncio.ensure_future(asyncio.to_thread(run_actions, r, 3, N_ACTIONS)) for r in others]
        # B lost mid-action: the third action's call is in flight when every process of B is SIGKILLed
        victim.begin_action(action(3))
        third = asyncio.ensure_future(asyncio.to_thread(victim.sandbox.exec, action(3)["command"], 20))
        await asyncio.sleep(0.15)  # into the action's 0.2 s of effects (a position, not a synchronisation)
        fig["b_killed_processes"] = await asyncio.to_thread(cluster.kill_node, "b")
        be = PodmanBackend(state_dir=run_dir / "podman-driver")  # B's container has its own netns: killed too
        await asyncio.to_thread(be.kill, victim.container_id)
        t_lost = time.monotonic()
        try:
            r3 = await asyncio.wait_for(third, 120)
            victim.commit(tokens(3), messages(3), r3)  # the action's answer came back before B went
            await asyncio.to_thread(victim.checkpoint, 3)
        except HostLost as e:
            fig["lost_calls"].append(str(e))
        except Exception as e:  # the container died under the action: an environment failure all the same
            fig["lost_calls"].append(f"{type(e).__name__}: {e}"[:300])
        # the agent loop's recovery: B's host answers no more, so the trajectory moves
        rb = await asyncio.wait_for(asyncio.to_thread(victim.recover, "node B lost"), 200)
        fig["recover_s"] = round(time.monotonic() - t_lost, 2)
        fig["rollback"] = {"boundary": rb.boundary, "token_ids": rb.token_ids, "checkpoint_id": rb.checkpoint_id,
                           "node": rb.node}
        fig["moved"] = next(e for e in events if e.get("kind") == "moved")
        fig["netns_after_move"] = await asyncio.to_thread(_netns_of, victim.container_id)
        await asyncio.to_thread(run_actions, victim, rb.boundary + 1, N_ACTIONS)
        await asyncio.wait_for(asyncio.gather(*rest), 200)
        fig["final"] = {r.trajectory_id: (await asyncio.to_thread(r.sandbox.exec, QUERY, 20)).stdout for r in recs}
        fig["events"] = [e.get("kind") for e in events][-40:]
        for r in recs:
            await asyncio.to_thread(r.close)
    finally:
        await asyncio.to_thread(hosts.shutdown)
    json.dumps(fig)  # figures only
    return fig


if __name__ == "__main__":
    os.environ.setdefault("BELAYER_NETNS_SCENARIO", "sandboxes")
    from tests.test_netns_multinode import main

    main(sys.argv[1], {"sandboxes": scenario_sandboxes})
