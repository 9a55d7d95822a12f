"""Beyond one machine, for real: a Ray head in the root namespace and worker nodes B and C, each in its own
network namespace with its own address on a bridge (tests/netns_cluster.py). Engines bind to and advertise
their own node's address; the router and the driver (in the root namespace, on the head's node) reach them
across the bridge; requests survive the loss of an engine, of a whole node, and of a node's link; a sandbox
trajectory of a lost node is restored on another from the shared checkpoint store; `belayer run` joins the
cluster.

Each scenario runs as a subprocess (this file as a script): the cluster needs its own Ray driver, so the
session's shared Ray cluster is untouched. The module shares one cluster (~20 s to build on 2 cores);
`revive()` brings back a node a scenario lost before the next one.

What one machine cannot show: the nodes share its PID namespace and filesystem. The fleet's own fence
(`FleetManager._kill`: `os.killpg` on the engine's pid, from the driver) reaches a server on B here, cut
off or not; across machines that pid names a process on the driver's machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

if __name__ == "__main__":  # run as the scenario's driver: the repository's root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.netns_cluster import _comm, netns_cluster, run_driver  # noqa: E402

PROMPTS = [[54, 280, 487, 423, 442], [60, 61, 62], [100, 200, 300, 400]]
GREEDY = {"max_new_tokens": 150, "temperature": 0.0, "ignore_eos": True}
TAG = "NETNS"


@pytest.fixture(scope="module")
def netns():
    """One cluster for the module (building one costs ~20 s on 2 cores), torn down after its last test."""
    with netns_cluster(workers=("b", "c")) as c:
        yield c


@pytest.fixture
def cluster(netns):
    """The module's cluster with every worker node up (a scenario may have lost or cut one off)."""
    netns.revive()
    yield netns


@pytest.mark.timeout(240)
def test_engines_serve_from_their_own_nodes_and_a_stream_killed_on_b_resumes_on_c(cluster, tmp_path):
    fig = run_driver(__file__, cluster, tmp_path, TAG, 200, BELAYER_NETNS_SCENARIO="resume")
    b, c = cluster.nodes["b"].ip, cluster.nodes["c"].ip
    assert fig["urls"] == {"engine-0": b, "engine-1": c}
    assert fig["listen"] == {"engine-0": [b], "engine-1": [c]}  # its node's address only, no wildcard
    # router.host "": the driver node's own address, which a process on node B reaches across the bridge
    assert fig["router_host"] == cluster.nodes["a"].ip and fig["router_ok"] == 2
    assert fig["router_from_b"] == {"node": b, "status": 200}
    assert fig["router_tokens_per_node"] == [GREEDY["max_new_tokens"]] * 2  # the router reached B and C
    assert fig["killed_seg_hosts"][0] == b and fig["killed_seg_hosts"][-1] == c
    assert fig["lost"] == 0 and fig["requests"] == len(PROMPTS)


@pytest.mark.timeout(300)
@pytest.mark.skipif(os.environ.get("BELAYER_FULL_SUITE", "") != "1",
                    reason="full suite: CI runs both faults at once in tests/test_netns_acceptance.py")
def test_a_node_lost_under_load_is_detected_excluded_and_its_slot_moves_with_no_request_lost(cluster, tmp_path):
    fig = run_driver(__file__, cluster, tmp_path, TAG, 260, BELAYER_NETNS_SCENARIO="node_loss")
    assert fig["killed_processes"] > 0 and fig["requests"] > 0 and fig["lost"] == 0
    assert fig["moved_to"] != "b" and fig["states"] == {"engine-0": "HEALTHY", "engine-1": "HEALTHY"}
    assert fig["exclusion"].startswith("Ray reports node"), fig["exclusion"]


@pytest.mark.timeout(300)
@pytest.mark.skipif(os.environ.get("BELAYER_FULL_SUITE", "") != "1",
                    reason="full suite: CI runs both faults at once in tests/test_netns_acceptance.py")
def test_a_partitioned_node_is_detected_its_slot_moves_and_its_engine_is_never_routed_again(cluster, tmp_path):
    fig = run_driver(__file__, cluster, tmp_path, TAG, 260, BELAYER_NETNS_SCENARIO="partition")
    # B's link returned (at Belayer's detection, ~3 s) long before Ray declares a silent node dead (10 health
    # checks timing out, ~30 s): B's old engine came back to a fleet that had moved on.
    assert fig["b_alive_after_heal"], fig
    assert fig["requests"] > 0 and fig["lost"] == 0
    assert fig["new_incarnation"] and not fig["old_url_in_router"]
    assert fig["old_routed_after_detection"] == [] and fig["old_segments_after_detection"] == 0
    assert fig["states"] == {"engine-0": "HEALTHY", "engine-1": "HEALTHY"}


@pytest.mark.timeout(300)
@pytest.mark.skipif(os.environ.get("BELAYER_FULL_SUITE", "") != "1",
                    reason="long variant (~1.5 min): BELAYER_FULL_SUITE=1")
def test_a_node_cut_off_until_ray_declares_it_dead_is_excluded_and_leaves_when_its_link_returns(cluster, tmp_path):
    fig = run_driver(__file__, cluster, tmp_path, TAG, 260, BELAYER_NETNS_SCENARIO="partition",
                     BELAYER_NETNS_HEAL="ray")
    assert fig["requests"] > 0 and fig["lost"] == 0 and fig["new_incarnation"] and not fig["old_url_in_router"]
    assert fig["old_routed_after_detection"] == [] and fig["old_segments_after_detection"] == 0
    assert not fig["b_alive_after_heal"] and fig["exclusion"].startswith("Ray reports node"), fig


def belayer_run(cluster, run_dir: Path, timeout: float, *overrides: str) -> tuple[int, dict, str]:
    """`belayer run demo` as the cluster's driver, joining it with ray.address=auto (RAY_ADDRESS names the head,
    as `ray start --head` leaves it for a shell on that node); returns its exit code, report and output."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), **cluster.env(), "RAY_ADDRESS": cluster.address}
    p = subprocess.run([str(Path(sys.executable).with_name("belayer")), "run", "demo", "belayer.ray.address=auto",
                        f"belayer.run_dir={run_dir}", *overrides], cwd=root, env=env, capture_output=True,
                       text=True, timeout=timeout)
    report = json.loads((run_dir / "report.json").read_text()) if (run_dir / "report.json").exists() else {}
    return p.returncode, report, (p.stdout + p.stderr)[-6000:]


@contextlib.contextmanager
def hidden_on(cluster, node: str, path: Path):
    """`path` covered, in `node`'s mount namespace only, by an empty tmpfs: a directory of that name that is
    the node's own, as a local path is on another machine."""
    import subprocess

    raylet = next(p for p in cluster.node_pids(node) if _comm(p) == "raylet")
    subprocess.run(["nsenter", "-t", str(raylet), "-m", "mount", "-t", "tmpfs", "-o", "size=1m", "belayer-hidden",
                    str(path)], check=True, timeout=30)
    try:
        yield
    finally:
        subprocess.run(["nsenter", "-t", str(raylet), "-m", "umount", str(path)], timeout=30)


@pytest.mark.timeout(200)
def test_belayer_run_on_a_cluster_whose_checkpoint_store_is_not_shared_stops_before_starting_naming_the_node(
        cluster, tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    with hidden_on(cluster, "c", store):
        rc, report, out = belayer_run(cluster, tmp_path / "run", 150, f"belayer.sandbox.checkpoint_dir={store}",
                                      "belayer.chaos.enabled=false")
    assert rc == 1 and report["status"] == "failed", out
    err = report["error"]
    print("NETNS_RUN_REFUSED", json.dumps({"error": err["message"], "wall_s": report.get("wall_s")}))
    assert err["type"] == "ConfigError" and "sandbox.checkpoint_dir" in err["message"], err
    c, others = cluster.nodes["c"].ip, [cluster.nodes[n].ip for n in ("a", "b")]
    assert f"node {c} " in err["message"] and not any(f"node {ip} " in err["message"] for ip in others), err
    assert report["steps"] == []  # nothing ran


@pytest.mark.timeout(400)
def test_belayer_run_joins_an_existing_cluster_spreads_its_engines_and_sandboxes_over_the_nodes_and_finishes(
        cluster, tmp_path):
    # With the demo's own chaos: an engine's server SIGKILLed at a request's 6th token, wherever it runs
    rc, report, out = belayer_run(cluster, tmp_path / "run", 360, "belayer.sandbox.placement=spread")
    assert rc == 0 and report["status"] == "ok", out
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    injects = [e["figures"] for e in events if e["kind"] == "inject"]
    assert len(injects) == 1 and injects[0]["delivered"], injects
    hit = {**injects[0], "t": next(e["t"] for e in events if e["kind"] == "inject")}
    # where the victim ran: the address in its server's start line before the fault ("pid N at http://ip:port")
    started = [e for e in events if e["subject"] == hit["target"] and e["t"] < hit["t"] and " at http://" in
               e.get("reason", "")]
    victim_ip = host_of(started[-1]["reason"].split(" at ", 1)[1].split()[0])
    print("NETNS_RUN_CHAOS", json.dumps({"victim_ip": victim_ip, "via": hit.get("via")}))
    assert hit["via"] == ("here" if victim_ip == cluster.nodes["a"].ip else "a task on its node"), (victim_ip, hit)
    ips = {n.ip for n in cluster.nodes.values()}
    # every node proved the shared store (the run directory, on this one machine's file system)
    assert report["sandbox_evidence"]["store_shared_by"] == sorted(ips), report["sandbox_evidence"]
    # where each engine's first incarnation listened (its start line): spread over the nodes (the chaos victim's
    # replacement is Ray's to place, possibly beside the other engine)
    first: dict[str, str] = {}
    for e in events:
        if e["subject"].startswith("engine-") and " at http://" in e.get("reason", ""):
            first.setdefault(e["subject"], host_of(e["reason"].split(" at ", 1)[1].split()[0]))
    ev = report["engine_evidence"]  # the engines' own answers at the end: where they listen, what they generated
    print("NETNS_RUN", json.dumps({"nodes": {k: n.ip for k, n in cluster.nodes.items()}, "engines": first,
                                   "store_shared_by": report["sandbox_evidence"]["store_shared_by"],
                                   "steps": [s["step_s"] for s in report["steps"]]}))
    assert set(first) == set(ev) and set(first.values()) <= ips and len(set(first.values())) == len(first) >= 2, first
    assert set(first.values()) - {cluster.nodes["a"].ip}, first  # at least one engine on another node than the driver
    assert {host_of(e["url"]) for e in ev.values()} <= ips, ev
    assert all(e["counters"]["generated_tokens"] > 0 for e in ev.values()), ev
    assert len(report["steps"]) == 2 and all(s["trajectories"] > 0 for s in report["steps"])
    # each trajectory's sandbox on the node of its host actor (the address Ray gives that actor): several nodes
    placed = {e["subject"]: e["figures"]["node"] for e in events if e["kind"] == "placed"}
    assert len(placed) == sum(s["trajectories"] for s in report["steps"]) and set(placed.values()) <= ips, placed
    assert len(set(placed.values())) >= 2, placed


@pytest.mark.timeout(300)
@pytest.mark.skipif(os.environ.get("BELAYER_FULL_SUITE", "") != "1",
                    reason="full suite: CI restores a lost node's sandbox in tests/test_netns_acceptance.py")
def test_a_sandbox_whose_node_is_lost_is_restored_on_another_node_with_the_context_of_the_same_boundary(
        cluster, tmp_path):
    from belayer_plugin.sandbox.scripted import golden_state

    fig = run_driver(__file__, cluster, tmp_path, TAG, 260, BELAYER_NETNS_SCENARIO="sandbox_moves")
    b, c = cluster.nodes["b"].ip, cluster.nodes["c"].ip
    assert fig["on_b"]["node"] == b and fig["killed_processes"] > 0
    got = fig["on_c"]
    assert got["node"] == c  # restored by a process of node C, from the store B published to
    # the newest checkpoint (boundary 2); action 3 was committed after it and died with B
    assert got["boundary"] == 2 and got["checkpoint"] and got["failed_boundary"] == 2
    assert got["token_ids"] == fig["on_b"]["context"]["2"]  # B's own context at that boundary
    assert got["context"] == [fig["on_b"]["context"][str(i)] for i in range(3)]
    assert got["state_restored"] == golden_state(2)  # its in-memory state too: CRIU, on C
    assert got["state_final"] == golden_state(4)  # as a fault-free run ends
    assert got["restored_events"] == 1 and got["runtime_restored_id"]


# -- the scenarios (in the driver subprocess) ------------------------------------------------------------------


def ev(kind, subject=None):
    return lambda e: e.kind == kind and (subject is None or e.subject == subject)


def host_of(url: str) -> str:
    return urlsplit(url).hostname or ""


def listen_addrs(pid: int, port: int) -> list[str]:
    """The local addresses of the TCP listeners on `port` in process `pid`'s network namespace."""
    from belayer_plugin.ports import _parse_addr

    out = []
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            addr, _, p = f[1].partition(":")
            if f[3] == "0A" and int(p, 16) == port:
                out.append(str(_parse_addr(addr)))
    return out


def fleet_cfg(*extra: str):
    from tests.conftest import belayer_cfg
    from tests.test_fleet_recovery import FAST

    # 2 ms per decode step: a kill from the client side lands mid-generation. Probe budgets tolerate 2 loaded
    # cores (the cluster's three raylets share them with the engines).
    return belayer_cfg(*FAST, "belayer.engines.cpu_step_delay_ms=2", "belayer.recovery.stall_timeout_s=5",
                       "belayer.monitor.probe_timeout_s=3", "belayer.monitor.failure_threshold=3",
                       "belayer.monitor.progress.floor_s=5", *extra)


def pin_first(nodes: dict[str, str]):
    """actor_options: the first incarnation of each slot in `nodes` ({slot: node name}) on that node (its
    custom resource); later incarnations are Belayer's to place."""
    used: set[str] = set()

    def opts(sid: str) -> dict:
        if sid in nodes and sid not in used:
            used.add(sid)
            return {"resources": {f"netns_node_{nodes[sid]}": 0.01}}
        return {}

    return opts


async def get_from_node(url: str, node: str) -> dict:
    """GET `url` from a Ray task on `node` (its custom resource): its own address and the status it got."""
    import ray

    @ray.remote(num_cpus=0, resources={f"netns_node_{node}": 0.01}, max_retries=0)
    def get(u: str) -> dict:
        import urllib.request

        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(u, timeout=10) as r:
            return {"node": ray.util.get_node_ip_address(), "status": r.status}

    return await asyncio.wait_for(asyncio.wrap_future(get.remote(url).future()), 60)


async def golden_ids(url: str) -> list[list[int]]:
    import httpx

    from belayer_plugin.generation.sglang_http import generate

    async with httpx.AsyncClient(trust_env=False) as c:
        return [(await generate(c, url, {"input_ids": p, "sampling_params": GREEDY}, 60))["output_ids"]
                for p in PROMPTS]


async def scenario_resume(cluster, run_dir: Path) -> dict:
    """Engines on B and C; the router in the driver serves from both; a greedy stream on B's engine, whose
    server is SIGKILLed (through its actor, on B) mid-generation, resumes on C with the fault-free ids."""
    import httpx

    from belayer_plugin.events import EventLog
    from belayer_plugin.fleet.manager import FleetManager
    from belayer_plugin.generation.resumable import FleetSelector, ResumableGenerator
    from belayer_plugin.generation.sglang_http import generate, get_json

    ids = cluster.node_ids()
    cfg = fleet_cfg()
    fm = FleetManager(cfg, run_dir, EventLog(run_dir / "events.jsonl"), model_path=os.environ["BELAYER_TINY"])
    fm.actor_options = pin_first({"engine-0": "b", "engine-1": "c"})
    await fm.start()
    fig: dict = {}
    try:
        e0, e1 = fm.slots["engine-0"].info, fm.slots["engine-1"].info
        assert (e0.node_id, e1.node_id) == (ids["b"], ids["c"]), (e0, e1, ids)
        fig["urls"] = {"engine-0": host_of(e0.url), "engine-1": host_of(e1.url)}
        fig["listen"] = {sid: listen_addrs(fm.slots[sid].info.pid, urlsplit(fm.slots[sid].info.url).port)
                         for sid in ("engine-0", "engine-1")}
        golden = await golden_ids(e1.url)  # the driver reaches C's engine directly
        # The router: its bind address is the driver's choice (router.host), and it reaches both nodes.
        fig["router_host"] = host_of(fm.router.url)
        assert await fm.router.worker_urls() == {e0.url, e1.url}
        fig["router_from_b"] = await get_from_node(fm.router.url + "/workers", "b")
        async with httpx.AsyncClient(trust_env=False) as c:
            async def generated() -> list[int]:  # tokens each engine generated for requests (not probes)
                return [(await get_json(c, u, "/get_server_info", 10))["belayer_counters"].get("generated_tokens", 0)
                        for u in (e0.url, e1.url)]

            before = await generated()
            outs = [await generate(c, fm.router.url, {"input_ids": PROMPTS[0], "sampling_params": GREEDY}, 60)
                    for _ in range(2)]  # round robin: one from each engine
            fig["router_tokens_per_node"] = [a - b for a, b in zip(await generated(), before)]
        fig["router_ok"] = sum(o["output_ids"] == golden[0] for o in outs)

        gen = ResumableGenerator(FleetSelector(fm), cfg.recovery, fm.events)
        killed: dict = {}

        def kill(clog, seg):  # B's engine, at its 20th token of a request: SIGKILL sent on node B by its actor
            if seg.engine == "engine-0" and not killed and clog.committed >= 20:
                killed.update(rid=clog.rid, t=time.time())
                fm.slots["engine-0"].actor.kill.remote(signal.SIGKILL)

        gen.observers.append(kill)
        try:
            res = await asyncio.gather(*(gen.generate(f"r{k}", PROMPTS[k], GREEDY) for k in range(len(PROMPTS))))
        finally:
            await gen.aclose()
        assert killed, "no request ran on B's engine"
        fig["requests"] = len(res)
        fig["lost"] = sum(resp["output_ids"] != golden[k] for k, (_, resp) in enumerate(res))
        clog = next(cl for cl, _ in res if cl.rid == killed["rid"])
        fig["killed_seg_hosts"] = [host_of(s.url) for s in clog.segments]
        det = await fm.events.wait_for(ev("detected", "engine-0"), 30, since=killed["t"])
        fig["detect_s"] = round(det.t - killed["t"], 2)
    finally:
        await fm.shutdown()
    return fig


class Load:
    """Greedy requests streaming through Belayer's fleet from `n` workers until stopped; every request's
    ids are checked against the fault-free run, and the URLs its segments ran on are kept."""

    def __init__(self, fm, cfg, golden: list[list[int]], n: int = 3):
        from belayer_plugin.generation.resumable import FleetSelector, ResumableGenerator

        self.gen = ResumableGenerator(FleetSelector(fm), cfg.recovery, fm.events)
        self.golden, self.n = golden, n
        self.done = asyncio.Event()
        self.results: list[tuple[int, list[int]]] = []
        self.segments: list[tuple[float, str]] = []  # (start time, url) of every segment of every request

    async def _worker(self, i: int) -> None:
        n = 0
        while not self.done.is_set() or n == 0:
            k = (i + n) % len(PROMPTS)
            clog, resp = await self.gen.generate(f"w{i}-{n}", PROMPTS[k], GREEDY)
            self.results.append((k, resp["output_ids"]))
            self.segments += [(seg.t_start, seg.url) for seg in clog.segments]
            n += 1

    async def run(self, fault) -> None:
        try:
            await asyncio.gather(fault(), *(self._worker(i) for i in range(self.n)))
        finally:
            await self.gen.aclose()

    def tokens_on(self, engine: str, n: int = 10) -> asyncio.Event:
        busy = asyncio.Event()
        self.gen.observers.append(
            lambda clog, seg: busy.set() if seg.engine == engine and clog.committed >= n else None)
        return busy

    def figures(self) -> dict:
        lost = sum(1 for k, ids in self.results if ids != self.golden[k])
        return {"requests": len(self.results), "lost": lost}


async def two_node_fleet(cluster, run_dir: Path, *extra: str):
    from belayer_plugin.events import EventLog
    from belayer_plugin.fleet.manager import FleetManager

    cfg = fleet_cfg(*extra)
    fm = FleetManager(cfg, run_dir, EventLog(run_dir / "events.jsonl"), model_path=os.environ["BELAYER_TINY"])
    fm.actor_options = pin_first({"engine-0": "b", "engine-1": "c"})
    await fm.start()
    ids = cluster.node_ids()
    assert (fm.slots["engine-0"].info.node_id, fm.slots["engine-1"].info.node_id) == (ids["b"], ids["c"])
    return fm, cfg, ids


async def scenario_node_loss(cluster, run_dir: Path) -> dict:
    """Every process in B's namespace SIGKILLed (its raylet, the engine's actor and server) while requests
    stream: the engine's death is detected, its slot moves off B, B is excluded once Ray reports it dead,
    and every request ends with the fault-free ids."""
    fm, cfg, ids = await two_node_fleet(cluster, run_dir, "belayer.restart.node_check_timeout_s=30")
    fig: dict = {}
    try:
        golden = await golden_ids(fm.slots["engine-1"].info.url)
        load = Load(fm, cfg, golden)
        busy = load.tokens_on("engine-0")

        async def lose_b() -> None:
            await asyncio.wait_for(busy.wait(), 60)
            t = time.time()
            fig["killed_processes"] = await asyncio.to_thread(cluster.kill_node, "b")
            det = await fm.events.wait_for(ev("detected", "engine-0"), 30, since=t)
            reg = await fm.events.wait_for(ev("registered", "engine-0"), 120, since=t)
            exc = await fm.events.wait_for(ev("node_excluded", ids["b"]), 90, since=t)
            fig.update(detect_s=round(det.t - t, 2), detect_reason=det.reason, replaced_s=round(reg.t - t, 2),
                       excluded_s=round(exc.t - t, 2), exclusion=exc.reason)
            load.done.set()

        await load.run(lose_b)
        fig.update(load.figures())
        s0 = fm.slots["engine-0"]
        fig["moved_to"] = next(k for k, v in cluster.node_ids().items() if v == s0.info.node_id)
        fig["states"] = fm.states()
    finally:
        await fm.shutdown()
    return fig


async def scenario_partition(cluster, run_dir: Path) -> dict:
    """B's link on the bridge taken down while requests stream (B's processes live on, cut off): the engine
    is detected, its requests resume on C, its slot moves to a new incarnation; when the link returns, B's
    old engine is never routed to again."""
    # When B's link returns: at Belayer's detection (the default), or once Ray has declared B dead ("ray").
    heal_when = os.environ.get("BELAYER_NETNS_HEAL", "detected")
    # A cut-off engine answers nothing and Ray's liveness call on it neither returns nor fails: readiness
    # probes find it (probe_timeout_s x failure_threshold).
    fm, cfg, ids = await two_node_fleet(cluster, run_dir, "belayer.restart.node_check_timeout_s=30",
                                        "belayer.monitor.probe_timeout_s=1.5", "belayer.monitor.failure_threshold=2")
    fig: dict = {}
    try:
        old = fm.slots["engine-0"]
        old_url, old_inc, old_pid = old.info.url, old.health.incarnation, old.info.pid
        golden = await golden_ids(fm.slots["engine-1"].info.url)
        load = Load(fm, cfg, golden)
        busy = load.tokens_on("engine-0")
        routed_old: list[float] = []  # times the router listed B's old engine after its detection

        async def watch_router(since: float) -> None:
            while not load.done.is_set():
                if old_url in await fm.router.worker_urls():
                    routed_old.append(time.time() - since)
                await asyncio.sleep(0.2)  # the router's table has no change feed; polled while the load runs

        async def cut_b() -> None:
            await asyncio.wait_for(busy.wait(), 60)
            t = time.time()
            await asyncio.to_thread(cluster.partition, "b")
            det = await fm.events.wait_for(ev("detected", "engine-0"), 60, since=t)
            dereg = await fm.events.wait_for(ev("deregistered", "engine-0"), 30, since=t)
            fig.update(detect_s=round(det.t - t, 2), detect_reason=det.reason, deregistered_s=round(dereg.t - t, 2))
            watcher = asyncio.create_task(watch_router(dereg.t))
            if heal_when == "ray":  # a silent peer fails Ray's health checks by timeout: ~30 s here
                await fm.events.wait_for(ev("node_excluded", ids["b"]), 120, since=t)
            th = time.time()
            await asyncio.to_thread(cluster.heal, "b")
            fig["healed_after_s"] = round(th - t, 2)
            reg = await fm.events.wait_for(ev("registered", "engine-0"), 120, since=t)
            fig["replaced_s"] = round(reg.t - t, 2)
            await asyncio.sleep(3)  # requests keep flowing with B back on the bridge
            fig["b_alive_after_heal"] = "b" in cluster.node_ids()
            fig["old_server_alive_after_heal"] = _alive(old_pid)
            exc = fm.events.find(ev("node_excluded", ids["b"]))
            if exc:
                fig.update(exclusion=exc[0].reason, excluded_s=round(exc[0].t - t, 2))
            load.done.set()
            await watcher
            fig["old_routed_after_detection"] = routed_old
            fig["old_segments_after_detection"] = sum(1 for ts, url in load.segments if url == old_url and ts > dereg.t)

        await load.run(cut_b)
        fig.update(load.figures())
        s0 = fm.slots["engine-0"]
        fig["moved_to"] = next((k for k, v in cluster.node_ids().items() if v == s0.info.node_id), "?")
        fig["new_incarnation"] = s0.health.incarnation > old_inc and s0.info.url != old_url
        fig["old_url_in_router"] = old_url in await fm.router.worker_urls()
        fig["states"] = fm.states()
    finally:
        await fm.shutdown()
    if not fig.get("b_alive_after_heal", True):  # Ray declared B dead: its raylet exits, then revive() restarts it
        deadline = time.monotonic() + 60
        while any(_comm(p) == "raylet" for p in cluster.node_pids("b")) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)  # its exit is no event here; the deadline bounds this
    return fig


async def scenario_sandbox_moves(cluster, run_dir: Path) -> dict:
    """A sandbox trajectory on node B (checkpoints at boundaries 0-2 in a store every node reads, action 3
    committed after the last one); node B lost (every process in its namespace SIGKILLed, its container
    killed); node C resumes the trajectory from the store."""
    import ray

    from belayer_plugin.envs.build import ensure_image
    from belayer_plugin.sandbox.podman import PodmanBackend

    store = run_dir / "sandbox-checkpoints"  # one file system: shared by every node (as the run's check proves)
    image = ensure_image(PodmanBackend(state_dir=run_dir / "podman-a"), "busybox", None)

    @ray.remote(num_cpus=0, resources={"netns_node_b": 0.01}, max_restarts=0)
    class TrajectoryOnB:
        def run(self, store_root: str, image: str, state_dir: str) -> dict:
            from belayer_plugin.sandbox.base import Sandbox, SandboxSpec
            from belayer_plugin.sandbox.checkpoint import CheckpointStore
            from belayer_plugin.sandbox.scripted import action, messages, setup_stated, tokens
            from belayer_plugin.sandbox.trajectory import TrajectoryRecorder

            sb = Sandbox.create(PodmanBackend(state_dir=state_dir), SandboxSpec(image=image, memory_mb=128), "traj",
                                20.0)
            setup_stated(sb)
            self.rec = TrajectoryRecorder("traj", sb, CheckpointStore(store_root, keep=3), checkpoint_mode="full")
            self.rec.start(tokens(0), messages(0))
            for i in (1, 2, 3):
                self.rec.begin_action(action(i))
                assert sb.exec(action(i)["command"]).exit_code == 0
                self.rec.commit(tokens(i), messages(i))
                if i < 3:
                    self.rec.checkpoint()
            return {"node": ray.util.get_node_ip_address(), "container": sb.container_id,
                    "context": {r.index: r.token_ids for r in self.rec.boundaries}}

    @ray.remote(num_cpus=0, resources={"netns_node_c": 0.01}, max_retries=0)
    def resume_on_c(store_root: str, state_dir: str) -> dict:
        from belayer_plugin.sandbox.checkpoint import CheckpointStore
        from belayer_plugin.sandbox.scripted import resume_scripted

        return {"node": ray.util.get_node_ip_address(), **resume_scripted(
            "traj", PodmanBackend(state_dir=state_dir), CheckpointStore(store_root, keep=3), 4)}

    on_b = TrajectoryOnB.remote()
    fig: dict = {"on_b": await asyncio.wait_for(asyncio.wrap_future(
        on_b.run.remote(str(store), image, str(run_dir / "podman-b")).future()), 150)}
    t0 = time.monotonic()
    fig["killed_processes"] = cluster.kill_node("b")
    be = PodmanBackend(state_dir=run_dir / "podman-a")  # B's container dies with it (its own netns: not in B's)
    be.kill(fig["on_b"]["container"])
    be.remove(fig["on_b"]["container"])
    fig["on_c"] = await asyncio.wait_for(asyncio.wrap_future(
        resume_on_c.remote(str(store), str(run_dir / "podman-c")).future()), 150)
    fig["resume_s"] = round(time.monotonic() - t0, 2)
    return fig


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


SCENARIOS = {"resume": scenario_resume, "node_loss": scenario_node_loss, "partition": scenario_partition,
             "sandbox_moves": scenario_sandbox_moves}


def main(run_dir: str, scenarios: dict | None = None) -> None:
    """The driver subprocess: joins the cluster, runs the scenario BELAYER_NETNS_SCENARIO names (from
    `scenarios`, this module's by default) and prints its figures on one line tagged NETNS."""
    os.environ.setdefault("BELAYER_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "belayer"))
    from belayer_plugin.engines.tiny_model import ensure_tiny
    from tests.netns_cluster import connect

    os.environ["BELAYER_TINY"] = str(ensure_tiny(Path(os.environ["BELAYER_CACHE_DIR"]) / "tiny-qwen2"))
    import ray

    t0 = time.monotonic()
    cluster = connect()
    join_s = round(time.monotonic() - t0, 1)
    try:
        fig = asyncio.run((scenarios or SCENARIOS)[os.environ["BELAYER_NETNS_SCENARIO"]](cluster, Path(run_dir)))
        fig["cluster_join_s"] = join_s
        print(f"{TAG} " + json.dumps(fig), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
