"""Fencing an engine on another machine: the driver never signals a PID it read from another node (there it
names some other process of the driver's host); the engine's own actor kills its server, and a hung actor's
server dies with it when Ray kills the actor (PR_SET_PDEATHSIG)."""

from __future__ import annotations

import dataclasses
import os
import signal

import psutil
import pytest

from belayer_plugin.fleet import recovery as recovery_mod  # where the fleet fences (FleetManager._kill)
from tests.test_fleet_recovery import running_fleet

pytestmark = pytest.mark.asyncio


async def _gone(pid: int, timeout: float = 30) -> bool:
    try:
        psutil.Process(pid).wait(timeout)  # the server's own exit, bounded
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        return False
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.parametrize("hung", [False, True], ids=["answering", "hung"])
async def test_an_engine_on_another_node_is_killed_through_its_actor_never_by_a_local_signal(
        tmp_path, tiny_model, monkeypatch, hung):
    async with running_fleet(tmp_path, tiny_model, "belayer.engines.num_engines=1") as fm:
        s = fm.slots["engine-0"]
        server, actor_pid = s.info.pid, s.info.actor_pid
        assert fm.on_driver_node(s.info.node_id)
        s.info = dataclasses.replace(s.info, node_id="0" * 56)  # as Ray would report a node on another machine
        assert not fm.on_driver_node(s.info.node_id)
        local_signals = []
        if hung:  # the actor cannot answer: only its death can take the server
            os.kill(actor_pid, signal.SIGSTOP)
        try:
            with monkeypatch.context() as m:  # os.killpg is the process's own: undone before the fleet stops
                m.setattr(recovery_mod.os, "killpg", lambda pid, sig: local_signals.append((pid, sig)))
                await fm._kill(s)
            assert local_signals == [], "the driver signalled a PID read from another node"
            assert await _gone(server), "the engine's server outlived the fence"
        finally:
            if hung and psutil.pid_exists(actor_pid):
                os.kill(actor_pid, signal.SIGKILL)
