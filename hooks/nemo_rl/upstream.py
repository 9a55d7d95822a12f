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
    """Makes `nemo_rl` importable: its source on sys.path unless it already imports, and below Python 3.12
    typing.TypedDict aliased to typing_extensions' (the same class from 3.12 on), because pydantic refuses
    typing.TypedDict there and NeMo-RL's configs are TypedDicts inside pydantic models. Raises ImportError
    naming the folder."""
    # The alias comes first, always: a TypedDict class is built when its module is first imported, so one
    # import of any nemo_rl config module before the alias breaks every later pydantic model using it.
    _alias_typed_dict()
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


def _alias_typed_dict() -> None:
    if sys.version_info < (3, 12):
        import typing

        import typing_extensions

        typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]


def import_grpo() -> ModuleType:
    """nemo_rl.algorithms.grpo (NeMo-RL targets Python >= 3.13; see ensure_importable for below 3.12)."""
    ensure_importable()
    import nemo_rl.algorithms.grpo as grpo  # noqa: PLC0415

    return grpo


def cpu_nvtx_markers() -> None:
    """NeMo-RL wraps generate() in NVTX ranges (torch.cuda.nvtx), which a CPU build of torch refuses: make them
    no-ops there (profiler markers only; nothing else changes). For CPU tests and the CPU functional script."""
    import torch

    if not torch.cuda.is_available():
        torch.cuda.nvtx.range_push = lambda *a, **k: None  # type: ignore[assignment]
        torch.cuda.nvtx.range_pop = lambda *a, **k: None  # type: ignore[assignment]
