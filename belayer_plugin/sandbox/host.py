"""The host signature of a checkpoint: what the restoring host must share with the one that took it.

A CRIU image restores only where the process state it captured makes sense: the same CRIU (its image format
and the kernel features it dumped with), the same kernel (CRIU restores kernel objects as that kernel left
them), the same CPU architecture, the same cgroup layout (v1 controllers or the v2 hierarchy the container's
cgroup is recreated in) and the same container image (the writable layer is replayed on top of it). A
file-system-only checkpoint needs only the image and the architecture. The signature is recorded in the
checkpoint's manifest when it is taken and compared at restore time (`mismatches`): a checkpoint from an
incompatible host is refused (`CheckpointIncompatible`), never restored.

Owns: the host signature (CRIU, kernel, architecture, cgroup layout, image id) and comparing two. Must not:
take, publish or restore checkpoints (sandbox/checkpoint.py does).
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import weakref
from typing import Any, Optional

from belayer_plugin.sandbox import criu as criu_mod

# What a restore of each mode depends on (the keys of host_signature()).
NEEDS = {"full": ("criu", "kernel", "arch", "cgroup", "image"), "fs_only": ("arch", "image")}
_IMAGE_IDS: "weakref.WeakKeyDictionary[Any, dict[str, str]]" = weakref.WeakKeyDictionary()


@functools.lru_cache(maxsize=8)
def criu_version(criu_path: str = "") -> str:
    """The installed CRIU's version ("4.2.1"), or "none" when it is absent or does not answer."""
    path = criu_path or (criu_mod.DEFAULT_CRIU if os.path.exists(criu_mod.DEFAULT_CRIU) else "criu")
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "none"
    m = re.search(r"Version:\s*([0-9][0-9.]*)", out)
    return m.group(1) if m else "none"


@functools.lru_cache(maxsize=1)
def cgroup_layout() -> str:
    """"v2:<enabled controllers>" or "v1:<mounted hierarchies>", as /sys/fs/cgroup shows them here."""
    root = "/sys/fs/cgroup"
    try:
        with open(os.path.join(root, "cgroup.controllers")) as f:
            return "v2:" + ",".join(sorted(f.read().split()))
    except OSError:
        pass
    try:
        return "v1:" + ",".join(sorted(d for d in os.listdir(root) if not os.path.islink(os.path.join(root, d))))
    except OSError:
        return "none"


def image_id(backend: Any, ref: str) -> str:
    """The image's content id as the backend reports it (cached per backend and ref), else the ref itself."""
    try:
        known = _IMAGE_IDS.setdefault(backend, {})
    except TypeError:  # not weakly referable: ask every time
        known = {}
    if ref not in known:
        get = getattr(backend, "image_id", None)
        found: Optional[str] = None
        if get is not None:
            try:
                found = get(ref)
            except Exception:  # an unanswered inspect must not fail the checkpoint: the ref still identifies it
                found = None
        if not found:
            return ref
        known[ref] = found
    return known[ref]


def host_signature(backend: Any, image: str) -> dict[str, str]:
    """This host's signature for a sandbox of `image` on `backend` (what NEEDS compares)."""
    u = os.uname()
    return {"criu": criu_version(getattr(backend, "criu_path", "") or ""), "kernel": u.release, "arch": u.machine,
            "cgroup": cgroup_layout(), "image": image_id(backend, image), "node": u.nodename}


def mismatches(recorded: Optional[dict], here: dict, mode: str) -> list[str]:
    """What differs between the host that took a checkpoint of `mode` and this one ("criu: 4.1.0 in the
    checkpoint, 4.2.1 here"); [] when it can be restored here. A full checkpoint without a signature is
    refused: nothing says where its process state came from."""
    if not recorded:
        return [] if mode != "full" else ["host: the checkpoint records no host signature"]
    return [f"{k}: {recorded.get(k, '(not recorded)')} in the checkpoint (taken on {recorded.get('node', '?')}), "
            f"{here.get(k)} here" for k in NEEDS.get(mode, NEEDS["full"]) if recorded.get(k) != here.get(k)]
