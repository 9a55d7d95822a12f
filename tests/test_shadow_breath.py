"""A stopped standby (shadow.freeze_parked) must still answer Ray's gRPC keepalive pings, or Ray fails its
pending calls with ActorUnavailableError and the pool loses a healthy standby (after 300 s + 120 s with
Ray's defaults). Here Ray runs with a 1 s keepalive and a 1 s keepalive timeout, so the same thing happens
in ~2.5 s: without the pool's periodic wake ("breath") the standby is lost; with it, it stays.

Ray's keepalive is read when its processes start, so the scenario runs as a subprocess with its own local
cluster (this file as a script); the session's shared cluster is untouched.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import run_scenario_script

ROOT = Path(__file__).resolve().parents[1]
KEEPALIVE = {"RAY_grpc_client_keepalive_time_ms": "1000", "RAY_grpc_client_keepalive_timeout_ms": "1000"}


@pytest.mark.timeout(600)
def test_a_stopped_standby_is_woken_often_enough_for_rays_keepalive_and_is_not_lost(tmp_path):
    fig = run_scenario_script(__file__, tmp_path, "BREATH", 540, **KEEPALIVE)
    # The control: the hazard is real here (else the second half would prove nothing).
    assert "ActorUnavailableError" in fig["control_lost_reason"], fig
    # With the breath: never lost, and it still takes over a dead engine's slot.
    assert fig["breath_s"] == 0.5 and fig["lost"] == [] and fig["breath_failed"] == []
    assert fig["stopped_samples"] >= 0.8 * fig["samples"], fig
    assert fig["handover_s"] <= 2.0 and fig["served_by_standby"]


def ev(kind, subject=None):
    return lambda e: e.kind == kind and (subject is None or e.subject == subject)


async def scenario(run_dir: Path, tiny_model: str) -> dict:
    from belayer_plugin.events import EventLog
    from belayer_plugin.fleet.manager import FleetManager
    from belayer_plugin.fleet.shadow import ShadowPool
    from tests.conftest import belayer_cfg
    from tests.test_fleet_recovery import FAST
    from tests.test_shadow import proc_state

    cfg = belayer_cfg(*FAST, "belayer.shadow.num_standby=1")
    fig: dict = {}

    # Control: the breath pushed out of reach. The stopped standby's pending watch call fails on the
    # unanswered keepalive, and the pool loses it.
    real = ShadowPool.breath_s
    ShadowPool.breath_s = lambda self: 3600.0
    fm = FleetManager(cfg, run_dir / "control", EventLog(run_dir / "control-events.jsonl"), model_path=tiny_model)
    try:
        await fm.start()
        sh = fm.shadows.ready[0]
        assert sh.frozen
        lost = await fm.events.wait_for(ev("shadow_lost", sh.sid), 30)
        fig["control_lost_reason"] = lost.reason
    finally:
        await fm.shutdown()
        ShadowPool.breath_s = real

    fm = FleetManager(cfg, run_dir / "breath", EventLog(run_dir / "breath-events.jsonl"), model_path=tiny_model)
    try:
        await fm.start()
        sh = fm.shadows.ready[0]
        fig["breath_s"] = fm.shadows.breath_s()  # the configured 30 s, capped at half of Ray's 1 s timeout
        t0 = time.time()
        samples = stopped = 0
        while time.time() - t0 < 8.0:  # more than three times the ~2.5 s the control needed
            await asyncio.sleep(0.1)  # sampling the actor's state, not a synchronisation
            samples += 1
            stopped += proc_state(sh.info.actor_pid) == "T"
        fig.update(samples=samples, stopped_samples=stopped)
        fig["lost"] = [e.reason for e in fm.events.find(ev("shadow_lost"))]
        fig["breath_failed"] = [e.reason for e in fm.events.find(ev("shadow_breath_failed"))]
        t1 = time.time()
        os.kill(fm.slots["engine-0"].info.pid, signal.SIGKILL)
        ho = await fm.events.wait_for(ev("handover", "engine-0"), 30, since=t1)
        fig["handover_s"] = ho.figures["took_s"]
        fig["served_by_standby"] = fm.slots["engine-0"].info.url == sh.info.url
    finally:
        await fm.shutdown()
    return fig


def main(run_dir: str) -> None:
    os.environ.setdefault("BELAYER_CACHE_DIR", str(ROOT / ".cache" / "belayer"))
    import ray

    from belayer_plugin.engines.tiny_model import ensure_tiny
    from belayer_plugin.ray_cluster import init_ray
    from tests.conftest import belayer_cfg

    tiny = str(ensure_tiny(Path(os.environ["BELAYER_CACHE_DIR"]) / "tiny-qwen2"))
    init_ray(belayer_cfg().ray)
    try:
        fig = asyncio.run(scenario(Path(run_dir), tiny))
        print("BREATH " + json.dumps(fig), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
