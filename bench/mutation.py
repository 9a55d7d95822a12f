"""Mutation score of the pure recovery modules under their fast tests (issue 44 item 9).

Runs mutmut (pinned in pyproject.toml's `test` extra) on six modules that hold recovery decisions with no
I/O: the engine health machine, the restart policy, the progress tracker, the resume policy, the context
log and the sandbox checkpoint policy. Each module is checked against its fast unit tests only (no Ray, no
engines, no containers), so a surviving mutant is a decision no fast test pins.

mutmut works on a copy: this script copies the package and the tests into a fresh temporary directory and
runs mutmut there (mutmut writes its mutated copy under that directory's mutants/), so the working tree is
never mutated, even if the run crashes; the script still checks `git diff belayer_plugin/` at the end.

Usage:
    .venv/bin/python bench/mutation.py            # all six modules (about 10-20 min on 2 loaded cores)
    .venv/bin/python bench/mutation.py --quick    # one module (generation/resume_policy.py)
    .venv/bin/python bench/mutation.py --module fleet/health.py --show   # one module, survivors' diffs

Prints per module killed / survived / other / total and a last line
`RESULT mutation_score=X killed=K total=N survived=S other=O modules=M met=yes|no` (met: score >= 0.90).
The score is killed / total; a mutant that timed out counts as killed (the tests noticed it), one no
selected test reaches counts as survived ("no tests"), and so does anything mutmut calls suspicious.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = "belayer_plugin"
GOAL = 0.90

# Each module, and the fast tests that pin it (pytest node ids, relative to the repository root).
MODULES: dict[str, list[str]] = {
    "fleet/health.py": ["tests/test_fleet_health.py", "tests/test_health_machine.py"],
    "fleet/policy.py": ["tests/test_fleet_health.py", "tests/test_restart_policy.py"],
    "fleet/progress.py": [
        "tests/test_fleet_progress.py::" + t for t in (
            "test_silence_past_the_floor_is_a_stall_reported_once_and_cleared_by_a_token",
            "test_threshold_follows_the_engines_own_gaps_as_they_grow_under_load",
            "test_not_armed_before_warm_up_idle_or_while_suspended_and_resume_counts_from_then",
            "test_prompt_awaiting_its_first_token_extends_the_threshold_by_its_length",
            "test_a_saturated_batch_keeps_its_step_time_as_the_gap_though_its_tokens_arrive_together",
            "test_a_coalesced_read_of_several_chunks_counts_as_that_many_gaps",
            "test_an_answered_probe_doubles_the_threshold_and_other_incarnations_are_ignored",
            "test_an_observer_stall_is_excused",
            "test_recent_tokens_answer_readiness_only_until_the_silence_is_overdue_or_reported",
            "test_tokens_streamed_before_a_reported_fault_do_not_answer_readiness",
        )] + ["tests/test_progress_tracker.py"],
    "generation/resume_policy.py": [
        "tests/test_resume_sampling.py::test_a_resumed_segment_seed_follows_the_engines_seeding_scheme",
        "tests/test_resume_policy.py"],
    "generation/context_log.py": ["tests/test_token_recovery.py::test_context_log_commits_cumulative_chunks_once",
                                  "tests/test_context_log.py"],
    "sandbox/policy.py": ["tests/test_sandbox_policy.py", "tests/test_checkpoint_policy_accounting.py"],
}
QUICK = "generation/resume_policy.py"

# Lines never mutated, each with its reason (docs/reliability.md lists them with the score).
DO_NOT_MUTATE = [
    # the text and arguments of a log call: what an operator reads, not a recovery decision; the events the
    # policy emits (on_event) are mutated and tested
    r"^\s*log\.(debug|info|warning|error|exception)\(",
]

KILLED = {1, 3, 36, 24, -24, 152, 255, 37}  # a failing test, a pytest error, a timeout (the tests noticed)
SURVIVED = {0}


def _copy_tree(work: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis")
    shutil.copytree(ROOT / PKG, work / PKG, ignore=ignore)
    # hooks/, envs/ and recipes/ ship inside the package (pyproject's package-dir): config loads recipes from it
    for sub in ("hooks", "envs", "recipes"):
        shutil.copytree(ROOT / sub, work / PKG / sub, ignore=ignore)
    shutil.copytree(ROOT / "tests", work / "tests", ignore=ignore)


def _pyproject(modules: list[str]) -> str:
    """The repository's pyproject.toml (pytest's settings) plus mutmut's section for these modules."""
    tests: list[str] = []
    for m in modules:
        # a test file not written yet (the "before" figure) is left out rather than failing the collection
        tests += [t for t in MODULES[m] if t not in tests and (ROOT / t.split("::")[0]).exists()]
    text = (ROOT / "pyproject.toml").read_text()
    return text + "\n[tool.mutmut]\n" + "\n".join([
        f'source_paths = ["{PKG}"]',
        "only_mutate = [" + ", ".join(f'"{PKG}/{m}"' for m in modules) + "]",
        "pytest_add_cli_args_test_selection = [" + ", ".join(f'"{t}"' for t in tests) + "]",
        # -p no:cacheprovider: no .pytest_cache churn; the skip guard is the suite's, left on
        'pytest_add_cli_args = ["-q", "-p", "no:cacheprovider"]',
        "do_not_mutate_patterns = [" + ", ".join(json.dumps(p) for p in DO_NOT_MUTATE) + "]",
        "use_git_change_detection = false",
        "track_dependencies = false",
    ]) + "\n"


def _tally(work: Path, module: str) -> dict:
    meta = work / "mutants" / PKG / (module + ".meta")
    codes: dict[str, int | None] = json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}
    killed = sorted(k for k, c in codes.items() if c in KILLED)
    survived = sorted(k for k, c in codes.items() if c in SURVIVED)
    other = sorted(k for k, c in codes.items() if c not in KILLED and c not in SURVIVED)
    return {"killed": killed, "survived": survived, "other": other,
            "other_codes": {k: codes[k] for k in other}, "total": len(codes)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"one module only ({QUICK})")
    ap.add_argument("--module", action="append", choices=sorted(MODULES), help="only these modules")
    ap.add_argument("--show", action="store_true", help="print each survivor's diff")
    ap.add_argument("--keep", action="store_true", help="keep the temporary work directory")
    ap.add_argument("--workers", type=int, default=1, help="mutmut --max-children (default 1: shared cores)")
    args = ap.parse_args()
    modules = [QUICK] if args.quick else (args.module or list(MODULES))
    mutmut = Path(sys.executable).with_name("mutmut")
    if not mutmut.exists():
        sys.exit(f"{mutmut} missing: install the test extra (.venv/bin/pip install -e '.[test]')")

    work = Path(tempfile.mkdtemp(prefix="belayer-mutation-"))
    t0 = time.monotonic()
    try:
        _copy_tree(work)
        (work / "pyproject.toml").write_text(_pyproject(modules))
        env = {**os.environ, "BELAYER_CACHE_DIR": os.environ.get("BELAYER_CACHE_DIR", str(ROOT / ".cache" / "belayer")),
               "CI": "", "PYTHONDONTWRITEBYTECODE": "1"}
        env.pop("PYTHONPATH", None)
        proc = subprocess.run([str(mutmut), "run", "--max-children", str(args.workers)], cwd=work, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-6000:])
            print(f"mutmut run failed with exit code {proc.returncode} (work dir {work})")
            args.keep = True
            return 2
        rows = {m: _tally(work, m) for m in modules}
        print(f"{'module':32} {'killed':>7} {'survived':>9} {'other':>6} {'total':>6} {'score':>6}")
        for m, r in rows.items():
            score = len(r["killed"]) / r["total"] if r["total"] else 0.0
            print(f"{m:32} {len(r['killed']):7d} {len(r['survived']):9d} {len(r['other']):6d} {r['total']:6d} "
                  f"{score:6.3f}")
        for m, r in rows.items():
            for k in r["survived"] + r["other"]:
                code = r["other_codes"].get(k, 0)
                print(f"survivor {k} (exit code {code})")
                if args.show:
                    show = subprocess.run([str(mutmut), "show", k], cwd=work, env=env, capture_output=True,
                                          text=True)
                    print(show.stdout.rstrip())
        killed = sum(len(r["killed"]) for r in rows.values())
        survived = sum(len(r["survived"]) for r in rows.values())
        other = sum(len(r["other"]) for r in rows.values())
        total = sum(r["total"] for r in rows.values())
        score = killed / total if total else 0.0
    finally:
        if args.keep:
            print(f"work dir kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    paths = [f"{PKG}/{m}" for m in MODULES]
    dirty = subprocess.run(["git", "diff", "--stat", "--", *paths], cwd=ROOT, capture_output=True, text=True).stdout
    if dirty.strip():  # mutmut never writes here; a diff means someone edited a module meanwhile
        print(f"note: the modules differ from git (not written by this run, which works in {work}):\n{dirty}")
    print(f"elapsed {time.monotonic() - t0:.0f} s, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"RESULT mutation_score={score:.3f} killed={killed} total={total} survived={survived} other={other} "
          f"modules={len(modules)} met={'yes' if total and score >= GOAL else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
