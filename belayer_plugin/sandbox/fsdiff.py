"""The writable layer as a tarball: the overlay upper dir, whiteouts and opaque dirs included.

Owns: the layer tarball format. Must not: decide when to checkpoint or publish one (sandbox/checkpoint.py does).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from belayer_plugin.sandbox.base import SandboxError, run_cmd

# Whiteouts are 0/0 char devices and opaque dirs carry trusted.overlay.opaque: keep both, numerically.
_TAR_FLAGS = ["--xattrs", "--xattrs-include=trusted.*", "--xattrs-include=security.*", "--numeric-owner"]


def tar_upper(upper: Path, dest: Path, timeout_s: float = 120.0) -> None:
    """Writes the upper dir `upper` to the tarball `dest` (call while the container is frozen or stopped)."""
    if not upper.is_dir():
        raise SandboxError(f"upper dir {upper} does not exist")
    try:
        run_cmd(["tar", *_TAR_FLAGS, "-C", str(upper), "-cf", str(dest), "."], timeout_s)
    except subprocess.CalledProcessError as e:
        raise SandboxError(f"tar of {upper} failed: {e.stderr.decode(errors='replace')[-300:]}") from None


def untar_upper(src: Path, upper: Path, timeout_s: float = 120.0) -> None:
    """Unpacks a tarball from `tar_upper` into a created-but-not-started container's upper dir."""
    if not upper.is_dir():
        raise SandboxError(f"upper dir {upper} does not exist")
    try:
        run_cmd(["tar", *_TAR_FLAGS, "-C", str(upper), "-xpf", str(src)], timeout_s)
    except subprocess.CalledProcessError as e:
        raise SandboxError(f"untar into {upper} failed: {e.stderr.decode(errors='replace')[-300:]}") from None
