"""Environment definitions and the build command (rootfs built locally, cached, imported as an image)."""

from __future__ import annotations

import os
import shutil
import tarfile

import subprocess

import pytest

from belayer_plugin.envs.build import _mounts_under, main, rootfs_tarball
from belayer_plugin.envs.definitions import ENVS, EnvDefinition, get_env


def test_build_command_lists_environments_and_rejects_unknown_ones(capsys, tmp_path):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "busybox" in out and "python" in out
    assert main(["nope", "--backend", "none", "--cache-dir", str(tmp_path)]) == 1
    assert "unknown environment 'nope'" in capsys.readouterr().err


@pytest.mark.skipif(not os.path.exists("/bin/busybox"), reason="busybox-static not installed")
def test_busybox_rootfs_has_a_real_binary_and_applet_links_and_is_cached(tmp_path):
    tar = rootfs_tarball("busybox", tmp_path)
    with tarfile.open(tar) as tf:
        members = {m.name.lstrip("./"): m for m in tf.getmembers()}
    assert members["bin/busybox"].isfile() and members["bin/busybox"].size > 500_000
    assert members["bin/sh"].issym() and members["bin/sh"].linkname == "busybox"
    assert members["tmp"].mode & 0o1777 == 0o1777
    mtime = tar.stat().st_mtime_ns
    assert rootfs_tarball("busybox", tmp_path) == tar and tar.stat().st_mtime_ns == mtime  # cached, not rebuilt
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".build-")]  # no half-built leftovers


@pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need root")
def test_a_failed_build_unmounts_what_it_left_mounted_before_removing_its_dir(tmp_path, monkeypatch):
    # debootstrap killed by its timeout leaves /proc, /sys (and maybe a /dev bind) mounted in the target;
    # removing the build dir through such a mount would delete the host's files behind it.
    host = tmp_path / "host"
    host.mkdir()
    (host / "precious").write_text("keep")

    def build(root):
        (root / "dev").mkdir()
        subprocess.run(["mount", "--bind", str(host), str(root / "dev")], check=True)
        (root / "space dir").mkdir()  # mountinfo escapes the space: the unmount must still find it
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(root / "space dir")], check=True)
        raise RuntimeError("builder killed")

    monkeypatch.setitem(ENVS, "leaky", EnvDefinition("leaky", "1", "mounts and dies", build))
    cache = tmp_path / "cache"
    try:
        with pytest.raises(RuntimeError, match="builder killed"):
            rootfs_tarball("leaky", cache)
        assert (host / "precious").read_text() == "keep"
        assert not [p for p in cache.iterdir() if p.name.startswith(".build-")]
        assert not _mounts_under(cache)
    finally:  # a broken implementation must not leave this machine with mounts under /tmp
        for mp in _mounts_under(cache):
            subprocess.run(["umount", "-l", mp], check=False)


def test_every_env_has_an_idle_entry_command_and_a_versioned_image_ref():
    for name, env in ENVS.items():
        assert env.image_ref == f"belayer-env-{name}:{env.version}"
        assert env.command and env.command[0] == "sh"
    with pytest.raises(ValueError, match="known"):
        get_env("nope")


@pytest.mark.containers
@pytest.mark.skipif(not shutil.which("podman"), reason="podman not installed")
def test_ensure_image_imports_once_into_podman(tmp_path):
    from belayer_plugin.envs.build import ensure_image
    from belayer_plugin.sandbox.podman import PodmanBackend

    be = PodmanBackend(state_dir=tmp_path / "st")
    ref = ensure_image(be, "busybox", tmp_path / "cache")
    assert be.image_exists(ref)
    assert ensure_image(be, "busybox", tmp_path / "cache") == ref
