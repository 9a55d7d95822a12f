"""Where NeMo-RL's own source comes from when it is not installed (it is not on PyPI): a source checkout on
sys.path, e.g. ../shared/upstream/nemo-rl beside the repository (BELAYER_NEMO_RL overrides).

Owns: locating NeMo-RL's source. Must not: install or change NeMo-RL.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Optional


def nemo_rl_source(repo_root: Optional[Path] = None) -> Path:
    """The NeMo-RL source folder Belayer looks for (it may not exist)."""
    if os.environ.get("BELAYER_NEMO_RL"):
        return Path(os.environ["BELAYER_NEMO_RL"]).resolve()
    root = repo_root or Path(__file__).resolve().parents[2]
    return (root.parent / "shared" / "upstream" / "nemo-rl").resolve()


def ensure_importable(repo_root: Optional[Path] = None) -> Path:
    """Puts NeMo-RL's source on sys.path unless `nemo_rl` already imports; raises ImportError naming the folder."""
    try:
        import nemo_rl  # noqa: F401

        return Path(nemo_rl.__file__).resolve().parents[1]
    except ImportError:
        pass
    src = nemo_rl_source(repo_root)
    if not (src / "nemo_rl" / "__init__.py").exists():
        raise ImportError(f"NeMo-RL source not found at {src} (set BELAYER_NEMO_RL or put it there)")
    sys.path.insert(0, str(src))
    return src


def ensure_importable_configs() -> None:
    """ensure_importable, and NeMo-RL's pydantic configs importable below Python 3.12: pydantic refuses
    typing.TypedDict there, so it is aliased to typing_extensions' (the same class from 3.12 on)."""
    ensure_importable()
    if sys.version_info < (3, 12):
        import typing

        import typing_extensions

        typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]


def import_grpo() -> ModuleType:
    """nemo_rl.algorithms.grpo. NeMo-RL targets Python >= 3.13; below 3.12 pydantic refuses typing.TypedDict in
    its configs, so typing.TypedDict is aliased to typing_extensions' (the same class from 3.12 on)."""
    ensure_importable_configs()
    import nemo_rl.algorithms.grpo as grpo  # noqa: PLC0415

    return grpo


def cpu_nvtx_markers() -> None:
    """NeMo-RL wraps generate() in NVTX ranges (torch.cuda.nvtx), which a CPU build of torch refuses: make them
    no-ops there (profiler markers only; nothing else changes). For CPU tests and the CPU functional script."""
    import torch

    if not torch.cuda.is_available():
        torch.cuda.nvtx.range_push = lambda *a, **k: None  # type: ignore[assignment]
        torch.cuda.nvtx.range_pop = lambda *a, **k: None  # type: ignore[assignment]
