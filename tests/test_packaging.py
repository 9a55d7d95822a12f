"""The installed package carries hooks/, envs/ and recipes/ under belayer_plugin, and nothing generic."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAPPED = {"hooks": "belayer_plugin.hooks", "envs": "belayer_plugin.envs", "recipes": "belayer_plugin.recipes"}


SKIP = {"tests", "bench", "build"}


def _tree_packages() -> set[str]:
    # os.walk with pruning, not Path.glob("**"): glob descends into .cache/ before any filter runs, and a
    # sandbox rootfs being built there by a concurrent test has a mounted /proc whose entries vanish mid-walk.
    found = set()
    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel = Path(dirpath).relative_to(ROOT)
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "sglang_standins"
                       and not (rel == Path(".") and d in SKIP)]
        if "__init__.py" not in filenames or rel == Path("."):
            continue
        top = MAPPED.get(rel.parts[0], rel.parts[0])
        found.add(".".join([top, *rel.parts[1:]]))
    return found


def test_every_package_in_the_tree_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert _tree_packages() == listed


def test_wheel_ships_hooks_envs_recipes_inside_belayer_plugin(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True)
    (whl,) = tmp_path.glob("belayer-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops <= {"belayer_plugin", *(n.split("/")[0] for n in names if ".dist-info" in n)}
    assert "belayer_plugin/recipes/belayer/default.yaml" in names
    assert "belayer_plugin/hooks/__init__.py" in names
    assert "belayer_plugin/envs/__init__.py" in names
    assert any(n.startswith("belayer_plugin/engines/sglang_standins/vllm/") for n in names)
    assert "belayer_plugin/fleet/manager.py" in names
