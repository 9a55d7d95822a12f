"""Under CI=true a skip not on the allowlist fails the run (issue 44; tests/skip_guard.py): a tiny pytest
session in a subprocess on a test file that skips, with and without CI, with and without an allowlist entry."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.skip_guard import ALLOWLIST, load_allowlist

ROOT = Path(__file__).resolve().parents[1]

TESTS = '''
import pytest

def test_skips():
    pytest.skip("podman not installed")

@pytest.fixture
def needs_tool():
    pytest.skip("criu not found")

def test_skips_in_setup(needs_tool):
    pass

@pytest.mark.skipif(True, reason="no SGLang venv")
def test_skipif():
    pass

@pytest.mark.xfail(reason="known", strict=False)
def test_xfail():
    assert False

def test_passes():
    pass
'''
MODULE_SKIP = 'import pytest\npytest.importorskip("no_such_module_belayer", reason="verl not installed")\n' \
              'def test_never():\n    pass\n'


def _run(tmp_path: Path, ci: bool, allow: str | None, source: str = TESTS) -> subprocess.CompletedProcess:
    (tmp_path / "test_tiny.py").write_text(source)
    (tmp_path / "allow.txt").write_text(allow or "")
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS", "BELAYER_TEST_TIMES")}
    env.update(BELAYER_SKIP_ALLOWLIST=str(tmp_path / "allow.txt"), PYTHONPATH=str(ROOT))
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.skip_guard", "-p", "no:cacheprovider",
                           "-q", "-rA", "--rootdir", str(tmp_path), "-c", os.devnull, "test_tiny.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_under_ci_a_skip_not_on_the_allowlist_fails_and_names_the_test_and_the_allowlist(tmp_path):
    p = _run(tmp_path, ci=True, allow=None)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "1 failed, 1 passed, 1 xfailed, 2 errors" in p.stdout, p.stdout
    for name in ("test_skips", "test_skips_in_setup", "test_skipif"):
        assert f"skipped under CI=true and not on the skip allowlist: test_tiny.py::{name}" in p.stdout, p.stdout
    assert str(tmp_path / "allow.txt") in p.stdout and "podman not installed" in p.stdout


def test_under_ci_allowlisted_skips_pass(tmp_path):
    allow = ("# comment\ntest_tiny.py::test_skips  full suite only\n"
             "test_tiny.py::test_skip*  pattern: the setup skip and the skipif\n")
    p = _run(tmp_path, ci=True, allow=allow)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "1 passed, 3 skipped, 1 xfailed" in p.stdout, p.stdout


def test_under_ci_an_allowlist_naming_another_test_still_fails_the_skip(tmp_path):
    p = _run(tmp_path, ci=True, allow="test_tiny.py::test_skips  only this one\n")
    assert p.returncode == 1 and "1 passed, 1 skipped, 1 xfailed, 2 errors" in p.stdout, p.stdout


def test_without_ci_skips_pass(tmp_path):
    p = _run(tmp_path, ci=False, allow=None)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "1 passed, 3 skipped, 1 xfailed" in p.stdout, p.stdout


def test_under_ci_a_module_skipped_at_import_fails_unless_allowlisted(tmp_path):
    p = _run(tmp_path, ci=True, allow=None, source=MODULE_SKIP)
    assert p.returncode != 0 and "skipped under CI=true and not on the skip allowlist: test_tiny.py" in p.stdout, \
        p.stdout + p.stderr
    p = _run(tmp_path, ci=True, allow="test_tiny.py  verl module, full suite only\n", source=MODULE_SKIP)
    assert p.returncode in (0, 5) and "1 skipped" in p.stdout, p.stdout + p.stderr
    p = _run(tmp_path, ci=False, allow=None, source=MODULE_SKIP)
    assert p.returncode in (0, 5) and "1 skipped" in p.stdout, p.stdout + p.stderr


def test_an_allowlist_entry_without_its_reason_is_an_error(tmp_path):
    (tmp_path / "a.txt").write_text("tests/test_x.py::test_y\n")
    with pytest.raises(ValueError, match="without a reason"):
        load_allowlist(tmp_path / "a.txt")


def test_the_repo_allowlist_gives_every_entry_its_reason_and_names_no_missing_tool():
    entries = load_allowlist(ALLOWLIST)
    assert entries and all(len(reason) > 10 for _, reason in entries)
    for pat, reason in entries:
        low = reason.lower()
        assert not any(w in low for w in ("not installed", "not found", "not built")), (pat, reason)


def test_every_full_suite_only_chaos_script_is_allowlisted_with_its_reason():
    from tests.skip_guard import allowed
    from tests.test_functional import FULL_ONLY

    missing = [s for s in FULL_ONLY if not allowed(f"tests/test_functional.py::test_chaos_scenario[{s}]")]
    assert not missing, f"FULL_ONLY scripts not on {ALLOWLIST}: {missing}"


def test_every_allowlist_pattern_matches_the_ids_it_is_written_for():
    """fnmatch reads `[...]` as a character class: a pattern for parametrized ids must escape the bracket
    (`name[[]*`), or CI fails on the very skips the entry was written to allow (it happened)."""
    from tests.skip_guard import allowed

    for nodeid in ("tests/test_chaos_positions.py::test_sweep_every_position[engine_hang]",
                   "tests/test_chaos_positions.py::test_sweep_every_position[sandbox_kill_restore]",
                   "tests/test_sglang_drain.py::test_anything",
                   "tests/test_functional.py::test_chaos_scenario[engine_kill_refit]"):
        assert allowed(nodeid), nodeid
    assert not allowed("tests/test_functional.py::test_chaos_scenario[engine_server_kill]")  # CI runs it
