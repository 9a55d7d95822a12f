"""Shared fixtures: the tiny model, CPU engine server processes, one local Ray cluster per session."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

# Under CI=true a skip not on tests/skip_allowlist.txt fails the run (issue 44; tests/skip_guard.py).
from tests.skip_guard import pytest_make_collect_report, pytest_runtest_makereport  # noqa: E402,F401

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("BELAYER_CACHE_DIR", str(ROOT / ".cache" / "belayer"))


def wait_http_ok(url: str, proc: subprocess.Popen | None = None, timeout: float = 60.0) -> None:
    """Waits until GET `url` answers 200, failing fast if `proc` exits; bounded by `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)  # a starting server offers no event to await; the deadline bounds this
    raise TimeoutError(f"{url} not ready within {timeout} s")


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from belayer_plugin.engines.tiny_model import ensure_tiny

    return str(ensure_tiny(Path(os.environ["BELAYER_CACHE_DIR"]) / "tiny-qwen2"))


class ServerProc:
    """A CPU engine server process started by a test."""

    def __init__(self, model: str, log_dir: Path, extra: list[str] | None = None):
        from belayer_plugin.engines.launch import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_dir / f"cpu-engine-{self.port}.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "belayer_plugin.engines.cpu_server", "--model-path", model,
             "--port", str(self.port), *(extra or [])],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        wait_http_ok(f"{self.url}/health", self.proc)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def cpu_server(tiny_model, tmp_path_factory):
    """One CPU engine server per test module."""
    s = ServerProc(tiny_model, tmp_path_factory.mktemp("engine"))
    yield s
    s.kill(signal.SIGTERM)


@pytest.fixture
def start_cpu_server(tiny_model, tmp_path):
    """A factory for extra CPU engine servers, killed at the end of the test."""
    servers: list[ServerProc] = []

    def start(*extra: str) -> ServerProc:
        s = ServerProc(tiny_model, tmp_path, list(extra))
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.kill()


def run_scenario_script(script: str, run_dir: Path, tag: str, timeout: float, **env: str) -> dict:
    """Runs a test file as a script in its own process (its own Ray driver: the session's cluster stays
    untouched), fails with its output's tail if it fails, and returns the JSON it printed after `tag`."""
    import json

    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    full_env.pop("RAY_ADDRESS", None)
    p = subprocess.run([sys.executable, script, str(run_dir)], cwd=ROOT, env=full_env, capture_output=True,
                       text=True, timeout=timeout)
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    fig = json.loads(next(line for line in p.stdout.splitlines() if line.startswith(f"{tag} "))[len(tag) + 1:])
    print(tag, json.dumps(fig))
    return fig


def belayer_cfg(*overrides: str):
    """The default recipe's typed config with Hydra overrides."""
    from belayer_plugin.config import load_belayer_config

    cfg, _ = load_belayer_config("fleet_demo", list(overrides))
    return cfg


@pytest.fixture(scope="session", autouse=True)
def ray_cluster():
    """One local Ray cluster on loopback for the whole session (start-up costs ~3 s). Autouse: a test that
    reaches Ray without asking for it (a FleetManager started by a helper) would otherwise make Ray start itself
    with its defaults, on the address of the interface that routes outward (eth0 here), and every later test of
    the session would get that cluster from init_ray (CI saw engines advertise eth0's address)."""
    import ray

    from belayer_plugin.ray_cluster import init_ray

    init_ray(belayer_cfg().ray)
    yield
    ray.shutdown()


_TIMES = os.environ.get("BELAYER_TEST_TIMES")  # .ci/test.sh: one line per test as it ends (a run cut short
# by CI's time limit still says where the time went)


def pytest_runtest_logreport(report):
    if _TIMES and (report.when == "call" or report.duration > 1 or report.outcome != "passed"):
        with open(_TIMES, "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} {report.duration:8.1f}s {report.when:8} {report.outcome:7} "
                    f"{report.nodeid}\n")
