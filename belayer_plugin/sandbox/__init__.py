"""Sandboxes: containers with full checkpoint/restore and prefix-consistent recovery.

- base.py          Sandbox (exec, files, close), SandboxSpec, errors
- podman.py        Podman backend (default; runc; CLI)
- docker_backend.py Docker backend (SDK) and a private `dockerd --experimental`
- checkpoint.py    full_checkpoint / full_restore, CheckpointStore (manifest, atomic publish, verification)
- trajectory.py    TrajectoryRecorder: boundaries <-> LLM context <-> checkpoints; rollback
- policy.py        adaptive, asynchronous checkpoint policy
- config.py        SandboxConfig (defaults in recipes/belayer/default.yaml)
- factory.py       objects from a SandboxConfig
- miniswe.py       mini-swe-agent environment adapter
- scripted.py      scripted trajectory + fail-stop fault injection (tests, soak, bench)

Owns: the package's public names. Must not: import backends eagerly (Docker's SDK is optional).
"""

from belayer_plugin.sandbox.base import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointTimeout,
    CriuUnavailable,
    ExecResult,
    ExecTimeout,
    ImageMissing,
    RestoreError,
    Sandbox,
    SandboxDead,
    SandboxError,
    SandboxSpec,
)
from belayer_plugin.sandbox.checkpoint import Checkpoint, CheckpointStore, full_checkpoint, full_restore
from belayer_plugin.sandbox.config import SandboxConfig, SandboxPolicyConfig
from belayer_plugin.sandbox.policy import CheckpointPolicy, decide
from belayer_plugin.sandbox.trajectory import Rollback, TrajectoryRecorder

__all__ = [
    "Checkpoint", "CheckpointCorrupt", "CheckpointError", "CheckpointPolicy", "CheckpointStore", "CheckpointTimeout",
    "CriuUnavailable", "ExecResult", "ExecTimeout", "ImageMissing", "RestoreError", "Rollback", "Sandbox",
    "SandboxConfig", "SandboxDead", "SandboxError", "SandboxPolicyConfig", "SandboxSpec", "TrajectoryRecorder",
    "decide", "full_checkpoint", "full_restore",
]
