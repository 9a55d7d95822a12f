"""`belayer soak`: a short seeded run of both campaigns through the command (the full-size figures in README
come from the same command with its default sizes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.containers
@pytest.mark.functional
@pytest.mark.timeout(420)
def test_short_seeded_soak_of_sandboxes_and_engines_loses_nothing_and_hits_every_fault_kind(tmp_path):
    from tests.sandbox_fixtures import criu_verdict
    from belayer_plugin.sandbox.criu import criu_problem
    import os

    verdict, why = criu_verdict(criu_problem(""), os.environ.get("CI", "").lower() in ("1", "true", "yes"))
    if verdict != "ok":
        (pytest.fail if verdict == "fail" else pytest.skip)(why)
    p = subprocess.run([sys.executable, "-m", "belayer_plugin.cli", "soak", "all", "--trials", "3", "--seed", "7",
                        "--backend", "podman", "--actions", "3", "--concurrency", "4", "--tokens", "32",
                        "--no-progress", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=400, cwd=ROOT)
    tail = (p.stdout + p.stderr)[-3000:]
    assert p.returncode == 0, tail
    s = json.loads((tmp_path / "soak.json").read_text())
    env, eng = s["envs"], s["engines"]
    assert env["trials"] == 3 and env["violations"] == 0, env
    assert env["stats"]["kills_delivered"] >= 1, env
    assert eng["faults"] == 3 and eng["stats"].get("faults_missed", 0) == 0, eng
    assert {k.split("@")[0] for k in eng["stats"] if "@" in k} == {"server_kill", "hang", "actor_kill"}
    assert eng["requests"] == eng["completed"] == 3 * 4, eng
    assert (eng["lost"], eng["inconsistent"], eng["regenerated_tokens"]) == (0, 0, 0), eng
    assert (tmp_path / "soak.png").stat().st_size > 1000
    assert "RESULT engines faults=3" in p.stdout
