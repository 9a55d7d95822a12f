"""Fixtures for the sandbox tests: real Podman, a private dockerd, locally built env images.

Import the fixtures a test module needs: `from tests.sandbox_fixtures import podman, docker, backend, ...`.
Container tests skip (with the reason) only when the container tooling is not installed at all; run
`bash .ci/setup_containers.sh` to install it. A CRIU that is installed but broken fails the tests that need
it when CI=true (elsewhere they skip, saying it is broken).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Iterator, Optional

import pytest

from belayer_plugin.sandbox.criu import criu_problem


def _need(tool: str) -> None:
    if not shutil.which(tool):
        pytest.skip(f"{tool} not installed (run: bash .ci/setup_containers.sh)")


def criu_verdict(problem: Optional[str], ci: bool) -> tuple[str, str]:
    """("ok" | "skip" | "fail", why): skip only where CRIU is absent; a present but broken CRIU fails in CI."""
    if not problem:
        return "ok", ""
    if problem.startswith("criu not found"):
        return "skip", f"CRIU not installed: {problem}"
    if ci:
        return "fail", f"CRIU is installed but broken (CI=true): {problem}"
    return "skip", f"CRIU is installed but BROKEN (would fail in CI): {problem}"


@pytest.fixture(scope="session")
def criu_ok() -> None:
    verdict, why = criu_verdict(criu_problem(""), os.environ.get("CI", "").lower() in ("1", "true", "yes"))
    if verdict == "fail":
        pytest.fail(why, pytrace=False)
    if verdict == "skip":
        pytest.skip(why)


@pytest.fixture(scope="session")
def podman(tmp_path_factory) -> "object":
    """The Podman backend on the machine's default storage (images persist between runs)."""
    _need("podman")
    from belayer_plugin.sandbox.podman import PodmanBackend

    return PodmanBackend(state_dir=tmp_path_factory.mktemp("podman-state"))


@pytest.fixture(scope="session")
def dockerd() -> Iterator["object"]:
    """A private `dockerd --experimental` (own data-root, exec-root and socket) for this session."""
    _need("dockerd")
    from belayer_plugin.sandbox.docker_backend import DockerDaemon

    d = DockerDaemon().start(timeout_s=60)
    try:
        yield d
    finally:
        d.stop()
        shutil.rmtree(d.base, ignore_errors=True)


@pytest.fixture(scope="session")
def docker(dockerd) -> "object":
    from belayer_plugin.sandbox.docker_backend import DockerBackend

    return DockerBackend(dockerd.url)


@pytest.fixture(scope="session", params=["podman", "docker"])
def backend(request) -> "object":
    """Each test using it runs on both backends."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="session")
def env_cache(tmp_path_factory) -> Path:
    import os

    base = os.environ.get("BELAYER_CACHE_DIR")
    return Path(base) / "envs" if base else tmp_path_factory.mktemp("envs")


def busybox_image_for(backend, env_cache: Path) -> str:
    from belayer_plugin.envs.build import ensure_image

    return ensure_image(backend, "busybox", env_cache)


@pytest.fixture(scope="session")
def busybox_image(backend, env_cache) -> str:
    return busybox_image_for(backend, env_cache)
