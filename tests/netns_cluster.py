"""A real multi-node Ray cluster on one machine: each worker node in its own Linux network namespace.

`ray.cluster_utils.Cluster` puts every raylet on one address, so nothing it runs can show what breaks
between machines (an engine that advertises 127.0.0.1, a router that cannot reach another node). Here each
worker node is a `ray start --address <head> --node-ip-address <its address> --block` run through
`ip netns exec` in a namespace of its own, joined by a veth pair to a Linux bridge that this module creates
in the root namespace. The head (GCS and its raylet) and the test's driver run in the root namespace, bound
to the bridge's address. A node has only its link on the bridge and its loopback, and no default route: its
traffic cannot leave the bridge.

Addresses: 198.18.0.0/24, part of 198.18.0.0/15, which RFC 2544 reserves for network benchmark tests (never
routed on the Internet, not used by any network here). Each cluster takes one free /28 of it (the bridge,
which is the head's address, then one address per worker node), allocated under a lock file, so that
concurrent test sessions on one machine get disjoint subnets.

Auth: Ray 2.60 enables token auth by default. Each cluster has its own random token, passed as
RAY_AUTH_MODE=token and RAY_AUTH_TOKEN to the head, every node and the driver (`env()`); ~/.ray/auth_token
is neither read for it nor written.

Names: everything a cluster creates carries `bln<owner pid>`: the bridge `bln<pid>br`, host-side veth ends
`bln<pid>v<i>`, namespaces `bln<pid>-<node>`, the temp dir /tmp/bln<pid>/ (Ray's socket paths must stay
short), and the environment marker BELAYER_NETNS_RUN=bln<pid> on every process started for it (Ray passes
its environment on to its workers and engines). Teardown kills every process inside each namespace and
every marked process, deletes the namespaces and links and the temp dir; it is idempotent and runs even
when the test failed. A cluster whose owner died without teardown (a SIGKILLed pytest) is removed by the
next cluster's start: names whose pid is no longer alive are leftovers.

A machine where namespaces cannot be made (no root, no CAP_NET_ADMIN) fails the test with the reason: a
skip would let CI pass without ever testing across nodes.

Containers: `ip netns exec` gives each node a fresh /sys, without the cgroup hierarchies mounted under
/sys/fs/cgroup, so runc cannot create a container there ("no cgroup mount found in mountinfo"). Each worker
node mounts them again (the same hierarchies as the root namespace's, as its mountinfo lists them) in its own
mount namespace before `ray start`: Podman, runc and CRIU then work on every node (`_cgroup_mounts`).

Fault injection (from the driver, which runs in the root namespace): `kill_node` SIGKILLs every process in a
node's namespace (a lost machine), `partition`/`heal` take the node's veth end on the bridge down and up
(its processes live on, cut off).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Optional

# RFC 2544 (benchmarking methodology for network interconnect devices) reserves 198.18.0.0/15 for network
# tests; a cluster only ever uses a /28 of this /24, on a bridge it created.
NETWORK = ipaddress.ip_network("198.18.0.0/24")
SUBNET_PREFIX = 28
PREFIX = "bln"  # every name this module creates starts with it, then the owner's pid
LOCK = Path("/tmp/belayer-netns.lock")
ENV_VAR = "BELAYER_NETNS_CLUSTER"  # the cluster's description, for the driver process
MARKER = "BELAYER_NETNS_RUN"
WORKER_PORTS = [52365, 52366, 52367, 52368]  # a worker node's agent ports (see _ray_argv)
_NAME = re.compile(rf"^{PREFIX}(\d+)(?:br|[vp]\d+|-[a-z]+)$")


class NetnsError(RuntimeError):
    """The cluster could not be built (namespaces unavailable, a node that never joined)."""


def _run(*argv: str, check: bool = True, netns: Optional[str] = None, timeout: float = 30) -> str:
    if netns:
        argv = ("ip", "netns", "exec", netns, *argv)
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed ({p.returncode}): {(p.stderr or p.stdout).strip()}")
    return p.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Node:
    name: str  # "a" is the head (root namespace); "b", "c", ... are worker nodes
    ip: str
    resource: str  # a custom Ray resource only this node has (for pinning actors to it)
    temp_dir: str
    netns: str = ""  # "" for the head
    host_if: str = ""  # the veth end on the bridge (root namespace)
    node_if: str = ""  # the veth end inside the namespace
    log: str = ""


@dataclass
class NetnsCluster:
    """One head and `workers` worker nodes; `start()` builds it, `teardown()` removes all of it."""

    workers: tuple[str, ...] = ("b", "c")
    num_cpus: int = 1
    # The head's Ray system config. Node health checks a little faster than Ray's defaults (a lost node is
    # declared dead in ~10-20 s), as tests/test_fleet_multinode.py does for the same reason.
    system_config: dict = field(default_factory=lambda: {
        "health_check_period_ms": 1000, "health_check_failure_threshold": 10, "health_check_timeout_ms": 2000})
    run_id: str = ""
    bridge: str = ""
    subnet: str = ""
    gcs_port: int = 0
    token: str = ""
    root: str = ""
    nodes: dict[str, Node] = field(default_factory=dict)

    # -- building ------------------------------------------------------------------------------------------

    def start(self) -> "NetnsCluster":
        preflight()
        owner = os.getpid()
        self.run_id = f"{PREFIX}{owner}"
        cleanup_leftovers()
        teardown_run(self.run_id)  # a cluster this process did not tear down (a test that crashed before it)
        self.bridge = f"{self.run_id}br"
        self.token = secrets.token_hex(32)
        self.root = f"/tmp/{self.run_id}"
        shutil.rmtree(self.root, ignore_errors=True)
        os.makedirs(self.root)
        try:
            with _lock():
                net = _free_subnet()
                hosts = list(net.hosts())
                self.subnet = str(net)
                _run("ip", "link", "add", "name", self.bridge, "type", "bridge")
                _run("ip", "addr", "add", f"{hosts[0]}/{SUBNET_PREFIX}", "dev", self.bridge)
                _run("ip", "link", "set", self.bridge, "up")
            head = Node("a", str(hosts[0]), "netns_node_a", f"{self.root}/a", log=f"{self.root}/a.log")
            self.nodes["a"] = head
            for i, name in enumerate(self.workers):
                self.nodes[name] = self._make_node(i, name, str(hosts[i + 1]))
            self._start_head()
            started = [(self.nodes[name], *self._start_worker(self.nodes[name])) for name in self.workers]
            for n, proc, since in started:
                _wait_started(n, proc, since)
        except BaseException:
            self.teardown()
            raise
        return self

    def _make_node(self, i: int, name: str, ip: str) -> Node:
        n = Node(name, ip, f"netns_node_{name}", f"{self.root}/{name}", netns=f"{self.run_id}-{name}",
                 host_if=f"{self.run_id}v{i}", node_if=f"{self.run_id}p{i}", log=f"{self.root}/{name}.log")
        _run("ip", "netns", "add", n.netns)
        _run("ip", "link", "add", n.host_if, "type", "veth", "peer", "name", n.node_if)
        _run("ip", "link", "set", n.node_if, "netns", n.netns)
        _run("ip", "link", "set", n.host_if, "master", self.bridge, "up")
        _run("ip", "addr", "add", f"{ip}/{SUBNET_PREFIX}", "dev", n.node_if, netns=n.netns)
        _run("ip", "link", "set", n.node_if, "up", netns=n.netns)
        _run("ip", "link", "set", "lo", "up", netns=n.netns)
        return n

    def env(self) -> dict[str, str]:
        """The environment every process of the cluster needs (and the driver: `connect()` reads it)."""
        # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1: the test session's own loopback Ray (belayer_plugin.ray_cluster)
        # sets it to 0 in os.environ, and a `ray start` that inherits 0 refuses to join as a worker node.
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token, MARKER: self.run_id,
                "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
                ENV_VAR: json.dumps(self.describe())}

    def _ray_argv(self, n: Node, ports: list[int]) -> list[str]:
        # Every agent port given: with none, the raylet waits for the agents to write theirs to files, and
        # on 2 loaded cores that wait timed out and took the head down (Ray 2.60).
        ray = Path(sys.executable).with_name("ray")
        return [str(ray), "start", "--block", "--disable-usage-stats", f"--node-ip-address={n.ip}",
                f"--temp-dir={n.temp_dir}", f"--num-cpus={self.num_cpus}", "--object-store-memory=100000000",
                f"--resources={json.dumps({n.resource: 1})}", f"--dashboard-agent-listen-port={ports[0]}",
                f"--dashboard-agent-grpc-port={ports[1]}", f"--metrics-export-port={ports[2]}",
                f"--runtime-env-agent-port={ports[3]}"]

    def _popen(self, argv: list[str], n: Node) -> tuple[subprocess.Popen, int]:
        env = {**os.environ, **self.env()}
        env.pop("RAY_ADDRESS", None)
        os.makedirs(n.temp_dir, exist_ok=True)
        since = Path(n.log).stat().st_size if Path(n.log).exists() else 0
        with open(n.log, "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True, cwd=self.root)
        return proc, since

    def _start_head(self) -> None:
        head = self.nodes["a"]
        # The head shares the root namespace (and its ports) with whatever else runs here: every port of
        # its own, not Ray's fixed defaults.
        ports = _free_ports(head.ip, 7)
        self.gcs_port = ports[4]
        argv = self._ray_argv(head, ports) + [
            "--head", "--include-dashboard=false", f"--dashboard-host={head.ip}", f"--port={ports[4]}",
            f"--ray-client-server-port={ports[5]}", f"--dashboard-port={ports[6]}",
            f"--system-config={json.dumps(self.system_config)}"]
        _wait_started(head, *self._popen(argv, head))

    def _start_worker(self, n: Node) -> tuple[subprocess.Popen, int]:
        # Ports inside the node's own namespace: nothing else listens there. The cgroup hierarchies first (in
        # the node's own mount namespace, which `ip netns exec` made a slave: nothing propagates back).
        argv = ["ip", "netns", "exec", n.netns, "sh", "-c", f'set -e; {_cgroup_mounts()} exec "$@"', "sh",
                *self._ray_argv(n, WORKER_PORTS), f"--address={self.address}"]
        return self._popen(argv, n)

    @property
    def address(self) -> str:
        return f"{self.nodes['a'].ip}:{self.gcs_port}"

    def describe(self) -> dict:
        return asdict(self)

    @classmethod
    def from_description(cls, d: dict) -> "NetnsCluster":
        d = dict(d)
        nodes = {k: Node(**v) for k, v in d.pop("nodes").items()}
        d["workers"] = tuple(d["workers"])
        return cls(**d, nodes=nodes)

    # -- faults --------------------------------------------------------------------------------------------

    def node_pids(self, name: str) -> list[int]:
        n = self.nodes[name]
        return [int(p) for p in _run("ip", "netns", "pids", n.netns, check=False).split()]

    def kill_node(self, name: str) -> int:
        """SIGKILLs every process in the node's namespace (its raylet, workers, engines): a lost machine.
        Returns how many processes were killed."""
        return _kill_netns(self.nodes[name].netns)

    def partition(self, name: str) -> None:
        """Cuts the node off the bridge; its processes live on."""
        _run("ip", "link", "set", self.nodes[name].host_if, "down")

    def heal(self, name: str) -> None:
        _run("ip", "link", "set", self.nodes[name].host_if, "up")

    def restart_node(self, name: str) -> None:
        """A fresh raylet in the node's namespace (after `kill_node`): a new Ray node on the same address."""
        n = self.nodes[name]
        _kill_netns(n.netns)
        _wait_started(n, *self._start_worker(n))

    def revive(self) -> list[str]:
        """Brings every worker node back for the next scenario of a shared cluster: its link up, and a fresh
        raylet where its raylet is gone (a lost node). Returns the nodes restarted."""
        out = []
        for name in self.workers:
            self.heal(name)
            if not any(_comm(p) == "raylet" for p in self.node_pids(name)):
                self.restart_node(name)
                out.append(name)
        return out

    # -- driver side (Ray connected) ------------------------------------------------------------------------

    def node_ids(self) -> dict[str, str]:
        """The Ray node id of each of the cluster's nodes that is alive now, by name."""
        by_ip = _alive_nodes()
        return {name: by_ip[n.ip] for name, n in self.nodes.items() if n.ip in by_ip}

    def wait_nodes(self, timeout: float = 120.0, names: Optional[list[str]] = None) -> dict[str, str]:
        """Waits until the nodes `names` (all by default) are alive in Ray; returns node_ids()."""
        deadline = time.monotonic() + timeout
        want = set(names or self.nodes)
        while True:
            ids = self.node_ids()
            if want <= set(ids):
                return ids
            dead = [k for k in want - set(ids) if k != "a" and not self.node_pids(k)]  # its `ray start` exited
            if dead or time.monotonic() > deadline:
                tails = {k: _tail(self.nodes[k].log) for k in sorted(want - set(ids))}
                raise NetnsError(f"nodes {sorted(want - set(ids))} not alive (within {timeout} s); logs: {tails}")
            time.sleep(0.5)  # a joining raylet offers the driver no event; the deadline bounds this

    # -- teardown ------------------------------------------------------------------------------------------

    def teardown(self) -> None:
        if self.run_id:
            teardown_run(self.run_id)


# -- driver side -----------------------------------------------------------------------------------------------


def connect(timeout: float = 120.0) -> NetnsCluster:
    """In the driver process (started with `cluster.env()`): joins the cluster as a driver on the head's
    address and waits until every node is alive; returns the cluster's handle."""
    import ray

    c = NetnsCluster.from_description(json.loads(os.environ[ENV_VAR]))
    ray.init(address=c.address, _node_ip_address=c.nodes["a"].ip, namespace="belayer", log_to_driver=False,
             logging_level="warning")
    c.wait_nodes(timeout)
    return c


def _alive_nodes() -> dict[str, str]:
    import ray

    return {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}


# -- pytest side -----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def netns_cluster(**kwargs) -> Iterator[NetnsCluster]:
    """A started cluster, torn down on exit whatever happened."""
    c = NetnsCluster(**kwargs)
    try:
        yield c.start()
    finally:
        c.teardown()


def run_driver(script: str, cluster: NetnsCluster, run_dir: Path, tag: str, timeout: float, **env: str) -> dict:
    """Runs `script` as the cluster's driver (tests.conftest.run_scenario_script with the cluster's env);
    returns the JSON it printed after `tag`."""
    from tests.conftest import run_scenario_script

    return run_scenario_script(script, run_dir, tag, timeout, **cluster.env(), **env)


# -- preflight, allocation, cleanup ----------------------------------------------------------------------------


def preflight() -> None:
    """Fails (never skips) with the reason when this machine cannot make namespaces and bridges."""
    if shutil.which("ip") is None:
        raise NetnsError("the `ip` command (iproute2) is missing: multi-node tests need network namespaces")
    probe = f"{PREFIX}{os.getpid()}-probe"
    p = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if p.returncode != 0:
        raise NetnsError(f"cannot create a network namespace (`ip netns add` as uid {os.getuid()}: "
                         f"{p.stderr.strip()}); multi-node tests need root or CAP_SYS_ADMIN and CAP_NET_ADMIN")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)


@contextlib.contextmanager
def _lock() -> Iterator[None]:
    with open(LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _free_subnet() -> ipaddress.IPv4Network:
    """The first /28 of NETWORK that no address in the root namespace falls in (called under the lock)."""
    used = set()
    for iface in json.loads(_run("ip", "-j", "-4", "addr") or "[]"):
        for a in iface.get("addr_info", []):
            used.add(ipaddress.ip_address(a["local"]))
    for net in NETWORK.subnets(new_prefix=SUBNET_PREFIX):
        if not any(a in net for a in used):
            return net
    raise NetnsError(f"every /{SUBNET_PREFIX} of {NETWORK} is in use here (leftover clusters of live processes?)")


def _free_ports(host: str, n: int) -> list[int]:
    socks, out = [], []
    try:
        for _ in range(n):  # all held at once: distinct
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
            out.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return out


def _wait_started(n: Node, proc: subprocess.Popen, since: int, timeout: float = 180) -> None:
    """Returns once `ray start --block` says the node runs; NetnsError with its log if it exits first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(n.log, "rb") as f:
                f.seek(since)
                if b"Ray runtime started." in f.read():
                    return
        except OSError:
            pass
        if proc.poll() is not None:
            raise NetnsError(f"node {n.name} ({n.ip}): `ray start` exited with {proc.returncode}; log: "
                             f"{_tail(n.log)}")
        if time.monotonic() > deadline:
            raise NetnsError(f"node {n.name} ({n.ip}) not started after {timeout} s; log: {_tail(n.log)}")
        time.sleep(0.2)  # `ray start` offers no event but its log; the deadline bounds this


def _cgroup_mounts() -> str:
    """Shell commands mounting, under a fresh /sys, the cgroup hierarchies this (root) namespace has mounted
    under /sys/fs/cgroup (v1 controllers, named hierarchies, or the v2 hierarchy), with the same options."""
    cmds = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        pre, _, post = line.partition(" - ")
        point = pre.split()[4]
        fstype, _, opts = post.split()[:3]
        if point != "/sys/fs/cgroup" and not point.startswith("/sys/fs/cgroup/"):
            continue
        keep = [o for o in opts.split(",") if o not in ("rw", "ro")]
        if fstype == "cgroup" and all(o.startswith("name=") for o in keep):
            keep = ["none", *keep]  # a named hierarchy without controllers
        o = ",".join(keep) or "defaults"
        cmds.append(f"mkdir -p {point}; mount -t {fstype} -o {o} {fstype} {point};")
    return " ".join(cmds)


def _tail(path: str, n: int = 2000) -> str:
    try:
        return Path(path).read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return "(no log)"


def _kill_netns(netns: str) -> int:
    """SIGKILLs every process in `netns` until none is left (bounded); returns how many were killed."""
    killed: set[int] = set()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        pids = [int(p) for p in _run("ip", "netns", "pids", netns, check=False).split()]
        pids = [p for p in pids if p != os.getpid()]
        if not pids:
            break
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
                killed.add(p)
        time.sleep(0.05)
    return len(killed)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _marked_pids(run_id: str) -> list[int]:
    """Processes whose environment carries MARKER=run_id (the head's processes and their descendants)."""
    needle = f"{MARKER}={run_id}\0".encode()
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if needle in f.read() + b"\0":
                    out.append(int(d))
        except OSError:
            continue
    return out


def teardown_run(run_id: str) -> None:
    """Removes everything of cluster `run_id`: its processes, namespaces, links and temp dir (idempotent)."""
    netns = [n.split()[0] for n in _run("ip", "netns", "list", check=False).splitlines() if n.strip()]
    mine = [n for n in netns if n.startswith(f"{run_id}-")]
    for _ in range(3):  # the head's processes first would let nodes outlive it briefly; kill all, twice over
        for n in mine:
            _kill_netns(n)
        for p in _marked_pids(run_id):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        time.sleep(0.1)
    for n in mine:
        _run("ip", "netns", "del", n, check=False)
    for link in json.loads(_run("ip", "-j", "link", check=False) or "[]"):
        name = link.get("ifname", "")
        m = _NAME.match(name)
        if m and f"{PREFIX}{m.group(1)}" == run_id:
            _run("ip", "link", "del", name, check=False)
    shutil.rmtree(f"/tmp/{run_id}", ignore_errors=True)


def cleanup_leftovers() -> list[str]:
    """Tears down every cluster whose owning process is gone (a crashed run); returns their run ids."""
    owners: set[int] = set()
    for n in _run("ip", "netns", "list", check=False).splitlines():
        m = _NAME.match(n.split()[0]) if n.strip() else None
        if m:
            owners.add(int(m.group(1)))
    for link in json.loads(_run("ip", "-j", "link", check=False) or "[]"):
        m = _NAME.match(link.get("ifname", ""))
        if m:
            owners.add(int(m.group(1)))
    for d in Path("/tmp").glob(f"{PREFIX}[0-9]*"):
        if d.name[len(PREFIX):].isdigit():
            owners.add(int(d.name[len(PREFIX):]))
    gone = [f"{PREFIX}{p}" for p in sorted(owners) if p != os.getpid() and not _pid_alive(p)]
    for run_id in gone:
        teardown_run(run_id)
    return gone
