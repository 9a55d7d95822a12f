"""The python environment (debootstrap minbase + python3): a Python process's memory survives a full restore.

The env's rootfs is built once (~30 s) and cached under $BELAYER_CACHE_DIR/envs.
"""

from __future__ import annotations

import dataclasses

import pytest

from belayer_plugin.envs.build import ensure_image
from belayer_plugin.envs.definitions import get_env
from belayer_plugin.sandbox.base import Sandbox, SandboxSpec
from belayer_plugin.sandbox.checkpoint import CheckpointStore, full_checkpoint, full_restore
from tests.sandbox_fixtures import backend, criu_ok, docker, dockerd, env_cache, podman  # noqa: F401

pytestmark = pytest.mark.containers

# Holds a counter and 16 MB of random bytes only in memory; answers `get` with both (n, sha256).
HOLDER = r'''
import hashlib, os
buf = os.urandom(16 << 20)
n = 0
os.mkfifo("/tmp/pyctl"); os.mkfifo("/tmp/pyreply")
ctl = os.fdopen(os.open("/tmp/pyctl", os.O_RDWR), "r")  # read-write: no message lost between readers
open("/tmp/pyready", "w").write("1")
for line in ctl:
    if line.strip() == "inc":
        n += 1
    elif line.strip() == "get":
        with open("/tmp/pyreply", "w") as r:
            r.write(f"{n} {hashlib.sha256(buf).hexdigest()}\n")
'''


def ask(sb: Sandbox, *cmds: str) -> str:
    script = "".join(f"echo {c} > /tmp/pyctl; " for c in cmds) + "echo get > /tmp/pyctl; cat /tmp/pyreply"
    r = sb.exec(script, timeout=30)
    assert r.exit_code == 0, r
    return r.stdout.strip()


def test_python_process_memory_continues_after_restore_into_fresh_container(backend, env_cache, tmp_path, criu_ok):
    image = ensure_image(backend, "python", env_cache)
    sb = Sandbox.create(backend, SandboxSpec(image=image, memory_mb=512, command=get_env("python").command))
    try:
        sb.write_file("/opt/holder.py", HOLDER)
        r = sb.exec("(python3 /opt/holder.py </dev/null >/dev/null 2>&1 &); "
                    "i=0; while [ ! -f /tmp/pyready ] && [ $i -lt 300 ]; do sleep 0.05; i=$((i+1)); done; "
                    "[ -f /tmp/pyready ]", timeout=30)
        assert r.exit_code == 0, r
        n_sha = ask(sb, "inc", "inc", "inc")
        assert n_sha.startswith("3 ")
        store = CheckpointStore(tmp_path)
        ck = full_checkpoint(sb, 1, store, "py", mode="full", timeout_s=120)
        assert ask(sb, "inc").startswith("4 ")  # moves on after the checkpoint
        restored = full_restore(ck, backend, store, timeout_s=120)
        try:
            assert ask(restored) == n_sha  # same counter, same 16 MB of random bytes
            assert ask(restored, "inc") == n_sha.replace("3 ", "4 ", 1)
        finally:
            restored.close()
    finally:
        sb.close()


def test_sandbox_from_recipe_config_is_offline_and_limited():
    from belayer_plugin.config import load_belayer_config
    from belayer_plugin.sandbox.factory import make_spec

    cfg, _ = load_belayer_config("fleet_demo")
    spec = make_spec(dataclasses.replace(cfg.sandbox, memory_mb=300), "img:1")
    assert spec.network == "none" and spec.memory_mb == 300 and spec.command == get_env(cfg.sandbox.env).command
