"""Typed sandbox configuration (placeholder written by the lead; the sandbox owner extends it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


def _req() -> Any:
    return field(default=MISSING)


@dataclass
class SandboxConfig:
    backend: str = field(default=MISSING, metadata={"choices": ("podman", "docker")})
    env: str = _req()
    network: str = _req()  # "none" unless a recipe asks for one

    def problems(self) -> list[str]:
        return []
