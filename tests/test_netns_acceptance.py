"""Multi-node acceptance: one node lost and another cut off while requests stream and a sandbox trajectory runs.

A Ray head (node A, the root namespace, where the driver and the router live) and worker nodes B and C, each
in its own network namespace with its own address (tests/netns_cluster.py). Three engines, one per node. While
greedy requests stream through Belayer's fleet and a scripted sandbox trajectory runs on B (a CRIU checkpoint
at every committed boundary, in the shared store):
- node B is lost (every process in its namespace SIGKILLed, its container killed);
- node C's link is dropped once B's engine is detected (its processes live on), and comes back.
Then: every request's ids equal the fault-free run's; the trajectory, resumed on A from the store, ends in the
fault-free final state with the context of the boundary it was restored to; no request segment starts on, and
the router never lists, an incarnation after it was fenced (its deregistration), C's old engine included when
its link returns; every slot ends HEALTHY.

The scenario runs as the cluster's driver subprocess (tests/test_netns_multinode.main). The longer version
(BELAYER_FULL_SUITE=1) keeps C cut off until Ray itself declares it dead, and streams longer.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import pytest

if __name__ == "__main__":  # run as the scenario's driver: the repository's root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.netns_cluster import netns_cluster, run_driver  # noqa: E402

TAG = "NETNS"
FULL = os.environ.get("BELAYER_FULL_SUITE", "") == "1"
N_ACTIONS = 5  # the trajectory's actions; B is lost during the third


@pytest.fixture(scope="module")
def cluster():
    with netns_cluster(workers=("b", "c")) as c:
        yield c


@pytest.mark.timeout(600 if FULL else 360)
def test_a_node_lost_and_another_cut_off_under_load_lose_no_request_and_the_trajectory_ends_as_fault_free(
        cluster, tmp_path):
    from belayer_plugin.sandbox.scripted import golden_state, tokens

    fig = run_driver(__file__, cluster, tmp_path, TAG, 540 if FULL else 320, BELAYER_NETNS_SCENARIO="acceptance",
                     BELAYER_NETNS_HEAL="ray" if FULL else "detected")
    ips = {k: n.ip for k, n in cluster.nodes.items()}
    print("NETNS_ACCEPTANCE", {k: v for k, v in fig.items() if k not in ("traj_b", "traj_a")})
    assert fig["first_hosts"] == {"engine-0": ips["b"], "engine-1": ips["c"], "engine-2": ips["a"]}
    # requests: every one with the fault-free ids, some of them on B's and C's engines before their faults
    assert fig["requests"] > 0 and fig["lost"] == 0, fig
    assert fig["b_killed_processes"] > 0 and fig["detect"]["engine-0"] and fig["detect"]["engine-1"]
    # fencing: nothing routed to a fenced incarnation, C's old engine included after its link returned
    assert fig["fenced"] and ips["c"] in {h for h, _ in fig["fenced"].values()}, fig["fenced"]
    assert fig["routed_after_fence"] == [] and fig["segments_after_fence"] == 0, fig
    healed, end = fig["old_c_engine_tokens"]  # C's old engine by its own counter: killed, or idle since
    assert healed == end, fig["old_c_engine_tokens"]
    assert fig["states"] == {"engine-0": "HEALTHY", "engine-1": "HEALTHY", "engine-2": "HEALTHY"}
    assert not set(fig["final_hosts"].values()) & {ips["b"]}, "an engine still on the lost node"
    assert fig["exclusion_b"].startswith("Ray reports node"), fig["exclusion_b"]
    if FULL:
        assert fig["exclusion_c"].startswith("Ray reports node"), fig
    # the trajectory: started on B, lost with it mid-action, resumed on A from the shared store
    b, a = fig["traj_b"], fig["traj_a"]
    assert b["node"] == ips["b"] and a["node"] == ips["a"]
    assert a["boundary"] in (2, 3) and a["failed_boundary"] >= a["boundary"], a  # the newest that verified
    assert a["token_ids"] == tokens(a["boundary"])  # the LLM context of that very boundary
    if str(a["boundary"]) in b["context"]:  # B answered for it before it was lost: its own context there
        assert a["token_ids"] == b["context"][str(a["boundary"])]
    assert a["state_restored"] == golden_state(a["boundary"])  # memory and files of that boundary (CRIU)
    assert a["state_final"] == golden_state(N_ACTIONS)  # as a fault-free run ends
    assert a["restored_events"] == 1 and a["runtime_restored_id"]


@pytest.mark.timeout(300)
def test_nodes_that_join_get_a_standby_moved_to_them_by_spread_placement(cluster, tmp_path):
    cluster.revive()  # the module's cluster after the acceptance scenario: B lost (its driver's join waits for all)
    fig = run_driver(__file__, cluster, tmp_path, TAG, 260, BELAYER_NETNS_SCENARIO="standbys_join")
    ips = {k: n.ip for k, n in cluster.nodes.items()}
    print("NETNS_STANDBYS", fig)
    assert fig["first"] == [ips["a"], ips["a"]]  # B and C down at the start: both standbys on A
    assert fig["moved"] and fig["moved"]["to"] in (ips["b"], ips["c"]), fig["moved"]
    assert sorted(fig["final"]) == sorted([ips["a"], fig["moved"]["to"]])  # one on A, one on a node that joined
    # by the servers themselves: the moved one answers, the one it replaced on A is gone
    assert fig["moved_answers"] == 200 and fig["stopped_answers"] is None, fig
    assert fig["engine_states"] == {"engine-0": "HEALTHY"}


@pytest.mark.timeout(240)
def test_a_chaos_fault_for_an_engine_on_another_node_is_delivered_there_and_recovered(cluster, tmp_path):
    cluster.revive()
    fig = run_driver(__file__, cluster, tmp_path, TAG, 200, BELAYER_NETNS_SCENARIO="chaos_remote")
    print("NETNS_CHAOS", fig)
    assert fig["inject"]["node"] == fig["node_b"] and fig["inject"]["signal"] == "SIGSTOP"
    assert fig["inject"]["via"] == "a task on its node"  # one machine here: the driver could have reached it too
    assert fig["server_state"] == "T"  # the kernel's word: B's server stopped, by the task on B
    assert fig["detected"] and fig["states"] == {"engine-0": "HEALTHY", "engine-1": "HEALTHY"}
    assert fig["old_server_gone"]  # fenced: the stopped server was killed


# -- the scenarios (in the driver subprocess) ------------------------------------------------------------------


async def scenario_chaos_remote(cluster, run_dir: Path) -> dict:
    """engine_hang from Belayer's chaos injector for an engine on B (the driver on A): the SIGSTOP is sent by a
    task on B to the pid B's actor reported; the fleet detects the hang and replaces the engine."""
    from belayer_plugin.chaos.injector import ChaosInjector
    from belayer_plugin.events import EventLog
    from belayer_plugin.fleet.manager import FleetManager
    from tests.test_netns_multinode import _alive, ev, fleet_cfg, pin_first

    cfg = fleet_cfg("belayer.chaos.enabled=true", "belayer.chaos.kind=engine_hang", "belayer.chaos.trigger=step",
                    "belayer.chaos.at=1", "belayer.chaos.count=1", "belayer.monitor.probe_timeout_s=1.5",
                    "belayer.monitor.failure_threshold=2")
    fm = FleetManager(cfg, run_dir, EventLog(run_dir / "events.jsonl"), model_path=os.environ["BELAYER_TINY"])
    fm.actor_options = pin_first({"engine-0": "b", "engine-1": "a"})
    await fm.start()
    fig: dict = {"node_b": cluster.node_ids()["b"]}
    inj = ChaosInjector(cfg.chaos, fm.events, fm)
    try:
        old_pid = fm.slots["engine-0"].info.pid
        t = time.time()
        await asyncio.to_thread(inj.on_phase, "serving", 1)  # the trigger: step 1 while serving
        inject = await fm.events.wait_for(ev("inject"), 30, since=t)
        fig["inject"] = inject.figures
        fig["server_state"] = Path(f"/proc/{old_pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        det = await fm.events.wait_for(ev("detected", "engine-0"), 60, since=t)
        fig["detected"] = det.reason
        await fm.events.wait_for(ev("registered", "engine-0"), 120, since=t)
        await fm.wait_all_healthy(60)
        fig["states"] = fm.states()
        deadline = time.monotonic() + 20
        while _alive(old_pid) and time.monotonic() < deadline:
            await asyncio.sleep(0.25)  # the fence's kill, then the kernel's reaping: no event for it here
        fig["old_server_gone"] = not _alive(old_pid) or "Z" == Path(f"/proc/{old_pid}/stat").read_text(
        ).rsplit(")", 1)[1].split()[0]
    finally:
        inj.stop()
        await fm.shutdown()
    return fig




async def scenario_standbys_join(cluster, run_dir: Path) -> dict:
    """B and C down; one engine and two standbys spread over what is left (A); B and C join (new Ray nodes):
    the pool moves one standby to them (a start there, then a stop on A)."""
    import httpx

    from belayer_plugin.events import EventLog
    from belayer_plugin.fleet.manager import FleetManager
    from tests.test_netns_multinode import ev, fleet_cfg, host_of

    for node in ("b", "c"):
        await asyncio.to_thread(cluster.kill_node, node)
    deadline = time.monotonic() + 90
    while {"b", "c"} & set(cluster.node_ids()):  # Ray declares a lost node dead by its health checks: no event
        assert time.monotonic() < deadline, f"Ray still lists {cluster.node_ids()}"
        await asyncio.sleep(0.5)
    cfg = fleet_cfg("belayer.engines.num_engines=1", "belayer.shadow.num_standby=2", "belayer.shadow.placement=spread",
                    "belayer.shadow.rebalance_interval_s=2", "belayer.shadow.freeze_parked=false")
    fm = FleetManager(cfg, run_dir, EventLog(run_dir / "events.jsonl"), model_path=os.environ["BELAYER_TINY"])

    def hosts() -> list[str]:
        return sorted(host_of(sh.info.url) for sh in fm.shadows.ready)

    async def answers(url: str):
        try:
            async with httpx.AsyncClient(trust_env=False) as c:
                return (await c.get(url + "/get_server_info", timeout=10)).status_code
        except httpx.HTTPError:
            return None

    await fm.start()
    fig: dict = {"first": hosts()}
    try:
        t_back = time.time()
        for node in ("b", "c"):
            await asyncio.to_thread(cluster.restart_node, node)
        moved = await fm.events.wait_for(ev("shadow_moved"), 150, since=t_back)
        new = next(sh for sh in fm.shadows.ready if sh.sid == moved.figures["replaced_by"])
        fig["moved"] = {"to": host_of(new.info.url), "after_s": round(moved.t - t_back, 2)}
        fig["final"] = hosts()
        fig["moved_answers"] = await answers(new.info.url)
        deadline = time.monotonic() + 20
        while (code := await answers(moved.figures["url"])) is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.25)  # Ray kills the actor asynchronously and its server follows it: no event
        fig["stopped_answers"] = code
        fig["engine_states"] = fm.states()
    finally:
        await fm.shutdown()
    return fig


async def scenario_acceptance(cluster, run_dir: Path) -> dict:
    import ray

    from belayer_plugin.envs.build import ensure_image
    from belayer_plugin.sandbox.podman import PodmanBackend
    from tests.test_netns_multinode import Load, ev, fleet_cfg, golden_ids, host_of, pin_first

    heal_when = os.environ.get("BELAYER_NETNS_HEAL", "detected")
    full = heal_when == "ray"
    store = run_dir / "sandbox-checkpoints"  # one file system: every node reads it (as `belayer run` proves)
    image = ensure_image(PodmanBackend(state_dir=run_dir / "podman-a"), "busybox", None)

    @ray.remote(num_cpus=0, resources={"netns_node_b": 0.01}, max_restarts=0)
    class Trajectory:
        """A scripted trajectory driven action by action (the driver sees where it is when B is lost)."""

        def start(self, store_root: str, image: str, state_dir: str) -> dict:
            from belayer_plugin.sandbox.base import Sandbox, SandboxSpec
            from belayer_plugin.sandbox.checkpoint import CheckpointStore
            from belayer_plugin.sandbox.scripted import messages, setup_stated, tokens
            from belayer_plugin.sandbox.trajectory import TrajectoryRecorder

            self.sb = Sandbox.create(PodmanBackend(state_dir=state_dir), SandboxSpec(image=image, memory_mb=128),
                                     "traj", 20.0)
            setup_stated(self.sb)
            self.rec = TrajectoryRecorder("traj", self.sb, CheckpointStore(store_root, keep=3),
                                          checkpoint_mode="full")
            self.rec.start(tokens(0), messages(0))
            self.rec.checkpoint()
            return {"node": ray.util.get_node_ip_address(), "container": self.sb.container_id}

        def step(self, i: int) -> list[int]:
            from belayer_plugin.sandbox.scripted import action, messages, tokens

            self.rec.begin_action(action(i))
            assert self.sb.exec(action(i)["command"]).exit_code == 0
            self.rec.commit(tokens(i), messages(i))
            self.rec.checkpoint()
            return self.rec.boundaries[-1].token_ids

    @ray.remote(num_cpus=0, resources={"netns_node_a": 0.01}, max_retries=0)
    def resume_on_a(store_root: str, state_dir: str, n_actions: int) -> dict:
        from belayer_plugin.sandbox.checkpoint import CheckpointStore
        from belayer_plugin.sandbox.scripted import resume_scripted

        return {"node": ray.util.get_node_ip_address(), **resume_scripted(
            "traj", PodmanBackend(state_dir=state_dir), CheckpointStore(store_root, keep=3), n_actions)}

    async def generated_by(url: str):
        """The tokens an engine generated for requests, by its own counter; None when it cannot be reached."""
        import httpx

        from belayer_plugin.generation.sglang_http import GenerateError, get_json

        try:
            async with httpx.AsyncClient(trust_env=False) as c:
                return (await get_json(c, url, "/get_server_info", 5))["belayer_counters"].get("generated_tokens", 0)
        except (GenerateError, httpx.HTTPError, OSError):
            return None

    def remote(ref, timeout: float):
        return asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout)

    from belayer_plugin.events import EventLog
    from belayer_plugin.fleet.manager import FleetManager

    # Node checks bounded for a loaded machine; readiness probes find a cut-off engine (Ray's liveness call on
    # it neither returns nor fails) within probe_timeout_s x failure_threshold.
    cfg = fleet_cfg("belayer.engines.num_engines=3", "belayer.restart.node_check_timeout_s=30",
                    "belayer.monitor.probe_timeout_s=1.5", "belayer.monitor.failure_threshold=2")
    fm = FleetManager(cfg, run_dir, EventLog(run_dir / "events.jsonl"), model_path=os.environ["BELAYER_TINY"])
    fm.actor_options = pin_first({"engine-0": "b", "engine-1": "c", "engine-2": "a"})
    # Every fenced incarnation, by the URL it had when it was deregistered (the event comes before the kill and
    # the replacement: the slot still names the old incarnation then).
    fenced: dict[str, tuple[str, float]] = {}
    fm.events.subscribe(lambda e: fenced.setdefault(fm.slots[e.subject].info.url, (
        host_of(fm.slots[e.subject].info.url), e.t)) if e.kind == "deregistered" else None)
    await fm.start()
    fig: dict = {"first_hosts": {sid: host_of(s.info.url) for sid, s in fm.slots.items()}}
    ids = cluster.node_ids()
    traj = Trajectory.remote()
    try:
        golden = await golden_ids(fm.slots["engine-2"].info.url)  # A's engine, the driver's own node
        load = Load(fm, cfg, golden)
        busy_b, busy_c = load.tokens_on("engine-0"), load.tokens_on("engine-1")
        routed: list[tuple[str, float]] = []

        async def watch_router() -> None:
            while not load.done.is_set():
                urls = await fm.router.worker_urls()
                routed.extend((u, time.time()) for u in urls if u in fenced and time.time() > fenced[u][1])
                await asyncio.sleep(0.2)  # the router's table has no change feed; polled while the load runs

        async def faults() -> None:
            watcher = asyncio.create_task(watch_router())
            b_info = await remote(traj.start.remote(str(store), image, str(run_dir / "podman-b")), 150)
            context = {str(i): await remote(traj.step.remote(i), 60) for i in (1, 2)}
            await asyncio.wait_for(busy_b.wait(), 60)
            # B lost mid-action: the third action's call is in flight when every process of B is SIGKILLed
            third = traj.step.remote(3)
            await asyncio.sleep(0.15)  # into the action's 0.2 s of effects (a position, not a synchronisation)
            t_b = time.time()
            fig["b_killed_processes"] = await asyncio.to_thread(cluster.kill_node, "b")
            be = PodmanBackend(state_dir=run_dir / "podman-a")  # B's container has its own netns: killed too
            be.kill(b_info["container"])
            be.remove(b_info["container"])
            with_b = await asyncio.gather(remote(third, 60), return_exceptions=True)
            if not isinstance(with_b[0], BaseException):
                context["3"] = with_b[0]
            fig["traj_b"] = {**b_info, "context": context}
            det_b = await fm.events.wait_for(ev("detected", "engine-0"), 30, since=t_b)
            resumed = asyncio.ensure_future(remote(resume_on_a.remote(str(store), str(run_dir / "podman-ra"),
                                                                      N_ACTIONS), 200))
            # C cut off while requests run on its engine (B's slot may be starting over meanwhile)
            await asyncio.wait_for(busy_c.wait(), 60)
            t_c = time.time()
            await asyncio.to_thread(cluster.partition, "c")
            det_c = await fm.events.wait_for(ev("detected", "engine-1"), 60, since=t_c)
            fig["detect"] = {"engine-0": [round(det_b.t - t_b, 2), det_b.reason],
                             "engine-1": [round(det_c.t - t_c, 2), det_c.reason]}
            if heal_when == "ray":  # a silent peer fails Ray's health checks by timeout: ~30 s here
                exc = await fm.events.wait_for(ev("node_excluded", ids["c"]), 120, since=t_c)
                fig["exclusion_c"] = exc.reason
            await fm.events.wait_for(ev("deregistered", "engine-1"), 30, since=t_c)  # fenced: out of the router
            old_c = next(u for u, (h, t) in fenced.items() if h == cluster.nodes["c"].ip and t >= t_c)
            await asyncio.to_thread(cluster.heal, "c")
            c_healed = await generated_by(old_c)  # None: the fence killed it; else its own count from here on
            fig["traj_a"] = await resumed
            await fm.wait_all_healthy(180)
            if full:  # more requests with C's old engine back on the bridge
                await asyncio.wait_for(load.tokens_on("engine-1", 1).wait(), 60)
            # requests keep flowing through the recovered fleet with C's link back: the old engine must stay out
            n = len(load.results)
            while len(load.results) < n + 6:
                await asyncio.sleep(0.2)  # results come from the workers' own loop; this bounds on their count
            load.done.set()
            await watcher
            fig["old_c_engine_tokens"] = [c_healed, await generated_by(old_c)]  # at the heal, at the end
            # B excluded on Ray's verdict (its raylet died with it), the only node evidence there is
            exc_b = await fm.events.wait_for(ev("node_excluded", ids["b"]), 90, since=t_b)
            fig["exclusion_b"] = exc_b.reason

        await asyncio.wait_for(load.run(faults), 280 if not full else 500)
        fig.update(load.figures())
        fig["fenced"] = fenced
        fig["routed_after_fence"] = routed
        fig["segments_after_fence"] = sum(1 for ts, url in load.segments if url in fenced and ts > fenced[url][1])
        fig["states"] = fm.states()
        fig["final_hosts"] = {sid: host_of(s.info.url) for sid, s in fm.slots.items()}
    finally:
        await fm.shutdown()
    return fig


if __name__ == "__main__":
    from tests.test_netns_multinode import main

    main(sys.argv[1], {"acceptance": scenario_acceptance, "standbys_join": scenario_standbys_join,
                       "chaos_remote": scenario_chaos_remote})
