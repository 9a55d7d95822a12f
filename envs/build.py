"""Builds environment root file systems once (cached) and imports them as images: `belayer envs build NAME`."""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from belayer_plugin.envs.definitions import ENVS, EnvDefinition, get_env

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """$BELAYER_ENV_CACHE, else $BELAYER_CACHE_DIR/envs, else ~/.cache/belayer/envs."""
    if os.environ.get("BELAYER_ENV_CACHE"):
        return Path(os.environ["BELAYER_ENV_CACHE"])
    base = os.environ.get("BELAYER_CACHE_DIR") or os.path.expanduser("~/.cache/belayer")
    return Path(base) / "envs"


def _mounts_under(path: Path) -> list[str]:
    """Mount points at or below `path`, deepest first (from /proc/self/mountinfo)."""
    base = os.path.realpath(path)
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            # the kernel writes space, tab, newline and backslash as octal escapes (\040 ...)
            mp = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
            if mp == base or mp.startswith(base + "/"):
                found.append(mp)
    return sorted(found, key=len, reverse=True)


def _remove_build_dir(work: Path) -> None:
    """Removes a build directory, first unmounting what a builder left mounted in it.

    debootstrap mounts /proc and /sys (and may bind /dev) inside the target while it runs; a build killed by
    its timeout leaves them mounted, and rmtree would then walk into the host's /sys or /dev. Anything that
    will not unmount is left in place, with the directory, and logged.
    """
    for mp in _mounts_under(work):
        subprocess.run(["umount", "-l", mp], capture_output=True, timeout=60)
    left = _mounts_under(work)
    if left:
        log.error("build dir %s kept: still mounted %s", work, left)
        return
    shutil.rmtree(work, ignore_errors=True)


def rootfs_tarball(name: str, cache_dir: Optional[str | Path] = None, force: bool = False) -> Path:
    """The cached rootfs tarball of environment `name`, building it first if absent (one builder at a time)."""
    env = get_env(name)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / f"{env.name}-{env.version}.tar"
    with open(cache / f"{env.name}.lock", "w") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)  # concurrent builders wait for the first one
        if out.exists() and not force:
            return out
        t0 = time.monotonic()
        work = Path(tempfile.mkdtemp(prefix=f".build-{env.name}-", dir=cache))
        try:
            root = work / "rootfs"
            root.mkdir()
            env.build_rootfs(root)
            tmp = work / "rootfs.tar"
            subprocess.run(["tar", "--numeric-owner", "--xattrs", "-C", str(root), "-cf", str(tmp), "."],
                           check=True, capture_output=True, timeout=1800)
            os.replace(tmp, out)  # atomic: a half-written tarball never carries the final name
        finally:
            _remove_build_dir(work)
        log.info("built env %s rootfs %s (%.1f MB) in %.1fs", name, out, out.stat().st_size / 1e6,
                 time.monotonic() - t0)
        return out


def ensure_image(backend, name: str, cache_dir: Optional[str | Path] = None, force: bool = False) -> str:
    """The image reference of environment `name` in `backend`, building and importing it once."""
    env: EnvDefinition = get_env(name)
    ref = env.image_ref
    if not force and backend.image_exists(ref):
        return ref
    tar = rootfs_tarball(name, cache_dir, force=force)
    backend.import_image(tar, ref)
    return ref


def _backend(kind: str, docker_host: Optional[str]):
    if kind == "podman":
        from belayer_plugin.sandbox.podman import PodmanBackend

        return PodmanBackend()
    if kind == "docker":
        from belayer_plugin.sandbox.docker_backend import DockerBackend

        return DockerBackend(docker_host)
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI: build NAME... [--backend podman|docker|none] [--cache-dir D] [--force]."""
    ap = argparse.ArgumentParser(prog="belayer envs build", description="Build sandbox environments (local rootfs -> image).")
    ap.add_argument("names", nargs="*", help=f"environments ({', '.join(sorted(ENVS))}); none: list them")
    ap.add_argument("--backend", default="podman", choices=["podman", "docker", "none"],
                    help="import into this engine ('none': only build the cached rootfs tarball)")
    ap.add_argument("--docker-host", default=None, help="dockerd socket URL (default $DOCKER_HOST)")
    ap.add_argument("--cache-dir", default=None, help=f"rootfs cache (default {default_cache_dir()})")
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = ap.parse_args(argv)
    if not args.names:
        for e in ENVS.values():
            print(f"{e.name:10s} {e.image_ref:28s} {e.description}")
        return 0
    try:
        be = _backend(args.backend, args.docker_host)
        for n in args.names:
            t0 = time.monotonic()
            if be is None:
                print(f"{n}: {rootfs_tarball(n, args.cache_dir, args.force)} ({time.monotonic() - t0:.1f}s)")
            else:
                print(f"{n}: {ensure_image(be, n, args.cache_dir, args.force)} in {be.name} ({time.monotonic() - t0:.1f}s)")
    except Exception as e:  # one clear line, not a traceback
        print(f"belayer envs build: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
