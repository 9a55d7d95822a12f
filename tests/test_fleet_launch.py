"""Engines as Ray actors behind the real sglang-router: start, serve, report, die loudly."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import psutil
import pytest
import pytest_asyncio
import ray

from belayer_plugin.fleet.launch import Fleet
from belayer_plugin.generation.sglang_http import generate, get_json
from tests.conftest import belayer_cfg

PROMPT = [54, 280, 487, 423, 442]
GREEDY = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(ray_cluster, tmp_path_factory, tiny_model):
    cfg = belayer_cfg("belayer.engines.num_engines=2")
    f = Fleet(cfg, tmp_path_factory.mktemp("fleet"), model_path=tiny_model)
    await f.start()
    yield f
    await f.shutdown()


pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_fleet_engines_report_url_pid_and_version_and_are_registered(fleet):
    assert len(fleet.engines) == 2
    table = await fleet.router.workers()
    assert {w["url"] for w in table} == {h.info.url for h in fleet.engines.values()}
    for h in fleet.engines.values():
        info = await h.actor.info.remote()
        assert info.url.startswith("http://127.0.0.1:")
        assert psutil.pid_exists(info.pid) and info.pid != info.actor_pid
        assert info.weight_version == "default"
        assert info.started_s > 0


async def test_router_serves_the_same_greedy_ids_as_each_engine_and_keeps_request_ids(fleet):
    async with httpx.AsyncClient() as c:
        direct = [await generate(c, h.info.url, {"input_ids": PROMPT, "sampling_params": GREEDY}, 60)
                  for h in fleet.engines.values()]
        assert direct[0]["output_ids"] == direct[1]["output_ids"]
        via = await asyncio.gather(*(generate(c, fleet.url, {"input_ids": PROMPT, "sampling_params": GREEDY,
                                                             "rid": f"r{i}"}, 60) for i in range(6)))
    assert all(v["output_ids"] == direct[0]["output_ids"] for v in via)
    assert [v["meta_info"]["id"] for v in via] == [f"r{i}" for i in range(6)]


async def test_router_membership_changes_are_confirmed_and_take_effect(fleet):
    h0, h1 = list(fleet.engines.values())
    async with httpx.AsyncClient() as c:
        await fleet.router.remove(h0.info.url)
        assert await fleet.router.worker_urls() == {h1.info.url}
        before = (await get_json(c, h0.info.url, "/get_server_info", 5))["belayer_counters"]["requests"]
        for _ in range(4):
            await generate(c, fleet.url, {"input_ids": PROMPT, "sampling_params": GREEDY}, 60)
        after = (await get_json(c, h0.info.url, "/get_server_info", 5))["belayer_counters"]["requests"]
        assert after == before, "a deregistered engine still received traffic"
        await fleet.router.add(h0.info.url)
        assert await fleet.router.worker_urls() == {h0.info.url, h1.info.url}


async def test_sigkill_of_server_process_returns_pending_wait_exit_within_a_second(fleet):
    h = await fleet.start_engine("victim-server")
    pending = h.actor.wait_exit.remote()
    t0 = time.monotonic()
    os.kill(h.info.pid, signal.SIGKILL)
    code = await asyncio.wait_for(pending, 10)
    assert code == -signal.SIGKILL
    assert time.monotonic() - t0 < 1.0
    assert await h.actor.ping.remote() == "victim-server"  # the actor outlives its server
    ray.kill(h.actor)
    del fleet.engines["victim-server"]


async def test_sigkill_of_actor_raises_actor_died_at_once_and_takes_its_server_down(fleet):
    h = await fleet.start_engine("victim-actor")
    pending = h.actor.wait_exit.remote()
    t0 = time.monotonic()
    os.kill(h.info.actor_pid, signal.SIGKILL)
    with pytest.raises(ray.exceptions.RayActorError):
        await asyncio.wait_for(pending, 10)
    assert time.monotonic() - t0 < 1.0
    # PR_SET_PDEATHSIG: the orphaned server must not keep serving stale weights.
    psutil.wait_procs([psutil.Process(h.info.pid)], timeout=5) if psutil.pid_exists(h.info.pid) else None
    assert not psutil.pid_exists(h.info.pid) or psutil.Process(h.info.pid).status() == psutil.STATUS_ZOMBIE
    del fleet.engines["victim-actor"]


async def test_start_failure_is_a_typed_error_with_the_log_tail(ray_cluster, tmp_path):
    from belayer_plugin.engines.actor import EngineStartError

    # The bound on a start, not its expected time: the engine exits as soon as its imports (torch) are done and
    # it finds no model, which took past 30 s on 2 loaded cores; a timeout would be another error than this one.
    cfg = belayer_cfg("belayer.engines.startup_timeout_s=120")
    f = Fleet(cfg, tmp_path, model_path=str(tmp_path / "no-model-here"))
    with pytest.raises(EngineStartError, match="exited with"):
        try:
            await f.start_engine("bad")
        except ray.exceptions.RayTaskError as e:
            raise e.as_instanceof_cause()
    await f.shutdown()


def test_an_engine_names_the_address_ray_registered_its_node_under(ray_cluster):
    """engines.host "": the node's address in Ray's control store (127.0.0.1 on the loopback test cluster), not
    whatever interface routes outward (ray.util.get_node_ip_address() answered eth0's address in CI)."""
    @ray.remote(num_cpus=0)
    def host() -> tuple[str, str]:
        from belayer_plugin.engines.launch import engine_host

        return ray.get_runtime_context().get_node_id(), engine_host("")

    node_id, addr = ray.get(host.remote(), timeout=60)
    registered = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    assert addr == registered[node_id]
