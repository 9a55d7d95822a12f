"""Environment definitions: how each sandbox root file system is built (no registry here: built locally)."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

# PID 1 of every sandbox: a shell that idles and exits on SIGTERM. Commands run beside it through exec;
# background processes they leave behind are reparented to it and are dumped with it by CRIU.
IDLE_COMMAND = ["sh", "-c", "trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done"]


@dataclass(frozen=True)
class EnvDefinition:
    """One buildable environment."""

    name: str
    version: str  # bump to force a rebuild of cached root file systems and images
    description: str
    build_rootfs: Callable[[Path], None]
    command: list[str] = field(default_factory=lambda: list(IDLE_COMMAND))
    # Deterministic environments allow exact replay of logged actions after a restore.
    deterministic: bool = False

    @property
    def image_ref(self) -> str:
        return f"belayer-env-{self.name}:{self.version}"


def _find_static_busybox() -> str:
    for p in ("/bin/busybox", "/usr/bin/busybox"):
        if os.path.exists(p):
            out = subprocess.run(["file", "-L", p], capture_output=True, text=True).stdout if shutil.which("file") else ""
            if not out or "statically linked" in out or "static-pie" in out:
                return p
    raise RuntimeError("static busybox not found: apt-get install busybox-static (or run .ci/setup_containers.sh)")


def build_busybox(root: Path) -> None:
    """A ~2 MB rootfs: static busybox and one symlink per applet (instant to build and to start)."""
    bb = _find_static_busybox()
    for d in ("bin", "sbin", "usr/bin", "usr/sbin", "etc", "root", "tmp", "proc", "sys", "dev", "work", "var/tmp"):
        (root / d).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "tmp", 0o1777)
    os.chmod(root / "var/tmp", 0o1777)
    shutil.copy2(bb, root / "bin/busybox")
    applets = subprocess.run([bb, "--list"], capture_output=True, text=True, check=True).stdout.split()
    for a in applets:
        if a == "busybox":
            continue  # a link named busybox would replace the binary with a self-loop
        link = root / "bin" / a
        if not link.exists():
            os.symlink("busybox", link)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n")
    (root / "etc/group").write_text("root:x:0:\nnogroup:x:65534:\n")
    (root / "etc/hostname").write_text("sandbox\n")


def system_mirror() -> str:
    """The Debian mirror this machine's apt already uses (deb822 .sources or one-line .list files)."""
    import glob
    import re

    for f in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
        for line in Path(f).read_text().splitlines():
            if line.startswith("URIs:"):
                uri = line.split(None, 1)[1].split()[0]
                if "-security" not in uri:
                    return uri
    for f in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.list"))]:
        try:
            lines = Path(f).read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            m = re.match(r"deb\s+(?:\[[^\]]*\]\s+)?(\S+)", line)
            if m and "-security" not in m.group(1):
                return m.group(1)
    return ""


def build_python(root: Path) -> None:
    """Debian bookworm minbase with python3-minimal (~235 MB, ~30 s with a nearby mirror)."""
    if not shutil.which("debootstrap"):
        raise RuntimeError("debootstrap not found: apt-get install debootstrap (or run .ci/setup_containers.sh)")
    mirror = os.environ.get("BELAYER_DEBIAN_MIRROR") or system_mirror()
    if not mirror:
        raise RuntimeError("no Debian mirror in this machine's apt sources: set BELAYER_DEBIAN_MIRROR")
    cp = subprocess.run(["debootstrap", "--variant=minbase", "--include=python3-minimal", "bookworm", str(root),
                         mirror], capture_output=True, text=True, timeout=1800)
    if cp.returncode != 0:
        raise RuntimeError(f"debootstrap failed ({cp.returncode}): {(cp.stderr or cp.stdout)[-1500:]}")
    # Package caches are dead weight in every checkpoint base.
    for d in ("var/cache/apt/archives", "var/lib/apt/lists"):
        p = root / d
        if p.is_dir():
            for child in p.iterdir():
                if child.is_file() and child.name != "lock":
                    child.unlink()
    (root / "work").mkdir(exist_ok=True)


ENVS: dict[str, EnvDefinition] = {
    "busybox": EnvDefinition("busybox", "1", "static busybox shell: fast, for tests and many-seed soaks",
                             build_busybox, deterministic=True),
    "python": EnvDefinition("python", "1", "Debian bookworm minbase + python3-minimal", build_python,
                            deterministic=True),
}


def get_env(name: str) -> EnvDefinition:
    """The definition called `name`; ValueError naming the known ones otherwise."""
    try:
        return ENVS[name]
    except KeyError:
        raise ValueError(f"unknown environment {name!r}; known: {', '.join(sorted(ENVS))}") from None
