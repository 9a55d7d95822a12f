"""The plain client (the fault-tolerance-off baseline): through the real sglang-router, no retry."""

from __future__ import annotations

import asyncio
import signal

import httpx
import pytest

from tests.conftest import belayer_cfg

PROMPT = [1, 5, 9, 14, 3]
SP = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


async def test_plain_client_through_the_router_gives_the_engine_s_ids_and_loses_a_killed_request(
        start_cpu_server, tmp_path):
    from belayer_plugin.fleet.router import Router
    from belayer_plugin.generation.plain import PlainGenerator
    from belayer_plugin.generation.resumable import RequestFailedError

    fast = start_cpu_server()
    async with httpx.AsyncClient() as c:
        direct = (await c.post(f"{fast.url}/generate", json={"input_ids": PROMPT, "sampling_params": SP},
                               timeout=60)).json()["output_ids"]
    router = Router(belayer_cfg().router, tmp_path)
    gen = None
    try:
        await router.start()
        await router.add(fast.url)
        gen = PlainGenerator(router.url, 60)
        log, resp = await gen.generate("r1", PROMPT, SP)
        assert resp["output_ids"] == direct and log.output_ids == direct and len(direct) == 24
        assert len(log.segments) == 1 and log.segments[0].end == 24
        # Only a slow engine behind the router now: killed mid-request, the plain client loses the request
        # (no resume, no retry: the baseline fault tolerance is measured against).
        slow = start_cpu_server("--step-delay-ms", "200")
        await router.add(slow.url)
        await router.remove(fast.url)
        task = asyncio.create_task(gen.generate("r2", PROMPT, {**SP, "max_new_tokens": 200}))
        async with httpx.AsyncClient() as c:
            for _ in range(100):  # bounded: 10 s for the request to reach the engine (no event to await there)
                info = (await c.get(f"{slow.url}/server_info", timeout=5)).json()
                if task.done() or info["num_running"] + info["num_pending"] > 0:
                    break
                await asyncio.sleep(0.1)
        assert not task.done(), "the request finished before the kill: the test proved nothing"
        slow.kill(signal.SIGKILL)
        with pytest.raises(RequestFailedError, match="plain client, no retry"):
            await asyncio.wait_for(task, 60)
    finally:
        if gen is not None:
            await gen.aclose()
        await router.aclose()
