"""Finding a usable CRIU (>= 4.2: older ones fail on this kernel; see shared/notes/containers.md).

Owns: locating and checking CRIU. Must not: checkpoint anything itself.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from typing import Optional

MIN_VERSION = (4, 2)
# runc and podman call `criu` from PATH: the one the set-up builds lives here and must come first.
DEFAULT_CRIU = "/usr/local/sbin/criu"


def criu_dir(criu_path: str = "") -> str:
    """The directory to put first on PATH so runtimes find the right criu."""
    path = criu_path or (DEFAULT_CRIU if os.path.exists(DEFAULT_CRIU) else (shutil.which("criu") or DEFAULT_CRIU))
    return os.path.dirname(path)


def runtime_env(criu_path: str = "", extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """os.environ with criu's directory first on PATH (plus `extra`)."""
    env = dict(os.environ)
    d = criu_dir(criu_path)
    parts = [p for p in env.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin").split(":") if p and p != d]
    env["PATH"] = ":".join([d, *parts])
    if extra:
        env.update(extra)
    return env


@functools.lru_cache(maxsize=8)
def criu_problem(criu_path: str = "") -> Optional[str]:
    """None when a CRIU >= 4.2 is installed and `criu check` passes; otherwise why not (human-readable)."""
    path = criu_path or (DEFAULT_CRIU if os.path.exists(DEFAULT_CRIU) else shutil.which("criu"))
    if not path or not os.path.exists(path):
        return "criu not found (run .ci/setup_containers.sh to build CRIU >= 4.2)"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{path} --version failed: {e}"
    m = re.search(r"Version:\s*(\d+)\.(\d+)", out)
    if not m:
        return f"cannot parse `{path} --version`: {out.strip()[:100]!r}"
    ver = (int(m.group(1)), int(m.group(2)))
    if ver < MIN_VERSION:
        return f"{path} is CRIU {ver[0]}.{ver[1]}; need >= {MIN_VERSION[0]}.{MIN_VERSION[1]} on this kernel"
    try:
        chk = subprocess.run([path, "check"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`{path} check` failed: {e}"
    if chk.returncode != 0:
        return f"`{path} check` failed: {(chk.stderr or chk.stdout).strip()[-300:]}"
    return None
