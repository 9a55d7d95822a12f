"""Sandboxes through a node's sandbox host (`sandbox.placement: spread`, sandbox/remote.py) on the session's
loopback Ray: a container killed under its trajectory is recovered by its own host, as the recorder would
locally; recipe keys that cannot work with spread placement are named at start-up. A lost node (its host
gone) is tests/test_netns_sandboxes.py, on a real multi-node cluster."""

from __future__ import annotations

import pytest

from tests.conftest import belayer_cfg


def test_a_container_killed_under_a_remote_trajectory_is_restored_by_its_host_at_the_last_boundary(tmp_path):
    import ray

    from belayer_plugin.sandbox.base import SandboxError, SandboxSpec
    from belayer_plugin.sandbox.podman import PodmanBackend
    from belayer_plugin.sandbox.remote import SandboxHosts
    from belayer_plugin.sandbox.shared_store import alive_nodes

    cfg = belayer_cfg("belayer.sandbox.placement=spread", "belayer.sandbox.checkpoint_mode=fs_only",
                      "belayer.sandbox.host_timeout_s=20")
    events: list[dict] = []
    hosts = SandboxHosts(cfg.sandbox, tmp_path / "store", events.append)
    try:
        image = next(iter(hosts.start(alive_nodes()).values()))
        rec = hosts.recorder("traj", SandboxSpec(image=image, memory_mb=128), events.append)
        assert rec.host.node == ray.util.get_node_ip_address()
        rec.start([1, 2, 3], [], checkpoint=False)
        for i in (1, 2):
            rec.begin_action(f"echo v{i} >> /work/log")
            r = rec.sandbox.exec(f"mkdir -p /work && echo v{i} >> /work/log", 20)
            assert r.exit_code == 0, r
            assert rec.commit([1, 2, 3] + [i] * i, [], r) == i
        assert rec.checkpoint(2).boundary == 2
        first = rec.container_id
        be = PodmanBackend(state_dir=tmp_path / "podman")
        be.kill(first)  # the runtime's own kill: the host learns it from its next exec
        assert not be.is_running(first)
        rec.begin_action("echo v3 >> /work/log")
        with pytest.raises(SandboxError):
            rec.sandbox.exec("echo v3 >> /work/log", 20)
        rb = rec.recover("container killed")
        assert rb.boundary == 2 and rb.token_ids == [1, 2, 3, 2, 2] and rb.checkpoint_id
        assert rec.container_id != first and be.is_running(rec.container_id)  # a new container, by podman
        assert rec.sandbox.exec("cat /work/log", 20).stdout == "v1\nv2\n"  # the restored file system
        kinds = [e["kind"] for e in events]
        assert "rollback" in kinds and "moved" not in kinds and "sandbox_host_lost" not in kinds, kinds
        rec.close()
        assert not be.is_running(rec.container_id)
    finally:
        hosts.shutdown()


def test_spread_placement_names_the_recipe_keys_it_cannot_work_with_at_once(capsys):
    from belayer_plugin.cli import main

    assert main(["config", "check", "chaos/sandbox_kill_restore", "belayer.sandbox.placement=spread",
                 "loop.shared_prefix_turns=1"]) == 2
    err = capsys.readouterr().err
    assert "loop.shared_prefix_turns: > 0 needs belayer.sandbox.placement=driver" in err, err
    assert "belayer.chaos.kind: sandbox_kill_restore needs belayer.sandbox.placement=driver" in err, err
