"""`belayer nemo-rl SCRIPT ARGS...`: a NeMo-RL run script runs unchanged with Belayer's hook installed; the recipe
keys alone switch Belayer on (the class NeMo-RL builds is NeMo-RL's own unless use_fault_tolerance is true)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NEMO_RL = ROOT.parent / "shared" / "upstream" / "nemo-rl"
BELAYER = Path(sys.executable).parent / "belayer"


def _launch(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    if not (NEMO_RL / "nemo_rl").is_dir():
        pytest.fail(f"NeMo-RL source not found at {NEMO_RL} (see .ci/setup_nemo_rl.sh)")
    env = {**os.environ, "BELAYER_NEMO_RL": str(NEMO_RL)}
    return subprocess.run([str(BELAYER), "nemo-rl", *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)


def test_a_run_script_launched_through_belayer_builds_the_hooked_class_with_its_own_arguments(tmp_path):
    script = tmp_path / "run_user.py"
    script.write_text(
        "import sys\n"
        "import nemo_rl.algorithms.grpo as grpo\n"  # what run_grpo.py imports, after the launcher's patch
        "from nemo_rl.environments.utils import ENV_REGISTRY\n"
        "print('ARGV', sys.argv)\n"
        "print('CLASS', grpo.SGLangGeneration.__name__, grpo.SGLangGeneration.__mro__[1].__name__)\n"
        "print('ENV', 'belayer_sandbox' in ENV_REGISTRY)\n"
        "sys.exit(3)\n")
    p = _launch(str(script), "--config", "cfg.yaml", "policy.generation.sglang_cfg.use_fault_tolerance=true")
    assert p.returncode == 3, p.stderr[-3000:]  # the script's own exit status
    out = p.stdout
    assert f"ARGV ['{script}', '--config', 'cfg.yaml', 'policy.generation.sglang_cfg.use_fault_tolerance=true']" in out
    assert "CLASS BelayerSGLangGeneration BelayerSGLangMixin" in out, out
    assert "ENV True" in out, out


def test_nemo_rls_own_run_grpo_script_runs_unchanged_under_the_launcher():
    p = _launch(str(NEMO_RL / "examples" / "run_grpo.py"), "--help")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "usage: run_grpo.py" in p.stdout and "--config CONFIG" in p.stdout


def test_the_launcher_names_a_missing_script(tmp_path):
    p = _launch(str(tmp_path / "nope.py"))
    assert p.returncode != 0 and "no such script" in (p.stdout + p.stderr)
