"""Runs every functional chaos script (tests/functional/*.sh): real faults injected into the main job,
asserted on its JSON report (survival identical to the golden run, a bounded typed failure, or lost work
with fault tolerance off)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent / "functional"
SCRIPTS = sorted(p for p in HERE.glob("*.sh") if p.name != "run_scenario.sh")


@pytest.mark.functional
@pytest.mark.containers
@pytest.mark.timeout(900)
@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_chaos_scenario(script):
    if script.stem.endswith("_sglang"):
        from belayer_plugin.engines.sglang import sglang_available
        from tests.conftest import belayer_cfg

        if not sglang_available(belayer_cfg("belayer.engines.kind=sglang").engines):
            pytest.skip(".venv-sglang not built (bash .ci/setup.sh --sglang)")
    p = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=850)
    tail = (p.stdout + p.stderr)[-4000:]
    assert p.returncode == 0, f"{script.name} failed:\n{tail}"
    assert "-> PASS" in p.stdout, tail
