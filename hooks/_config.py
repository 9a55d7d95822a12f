"""Reads a trainer recipe's `belayer` section over Belayer's defaults and validates it (every problem at once).

Owns: reading a trainer recipe's belayer section. Must not: hold defaults (recipes/belayer/default.yaml does).
"""

from __future__ import annotations

from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from belayer_plugin.config import BelayerConfig, recipes_dir, validate


def belayer_section(raw: Any = None, use_fault_tolerance: Optional[bool] = None,
                    path: str = "belayer") -> BelayerConfig:
    """`raw` (dict, DictConfig or None) merged over recipes/belayer/default.yaml; `use_fault_tolerance`, when
    given, is the trainer's own toggle and wins. Raises ConfigError naming every missing or bad key."""
    base = OmegaConf.load(recipes_dir() / "belayer" / "default.yaml")
    if raw is not None:
        user = raw if isinstance(raw, DictConfig) else OmegaConf.create(raw)
        base = OmegaConf.merge(base, user)
    if use_fault_tolerance is not None:
        base.use_fault_tolerance = bool(use_fault_tolerance)
    return validate(base, path)
