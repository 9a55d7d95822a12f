#!/usr/bin/env bash
# The whole test suite, as two pytest sessions run side by side: the container and chaos-script half spends
# most of its time waiting on container runtimes and engine start-ups, the other half on engines and Ray,
# so together they finish in about half the serial time on 2 cores. Each session has its own Ray cluster
# and private dockerd (tests/conftest.py, tests/sandbox_fixtures.py). Exits non-zero if either half fails.
#   bash .ci/test.sh            both halves (CI's suite)
#   bash .ci/test.sh --full     also the scenarios left out of CI for time (real-SGLang chaos scripts, the
#                               hook chaos scripts, the SGLang drain), each a duplicate of one CI runs
#   bash .ci/test.sh -k expr    extra pytest arguments go to both halves
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --full ]; then export BELAYER_FULL_SUITE=1; shift; fi
PY=.venv/bin/python
out=$(mktemp -d /tmp/belayer-tests-XXXXXX)
echo "[test.sh] logs and per-test times (a.times, b.times) in $out"
# Half A: sandboxes, containers and the chaos scripts (subprocess runs of the main job), fleet recovery.
# Measured in a clean clone on 2026-12-01 (per-test times): A 41 min (its last 4 min alone), B 37.5 min;
# test_fleet_recovery.py (~6.5 min) sits in A for that balance. 2026-12-02: A 39.4 min, B 36.4 min, so
# the engine_kill_refit chaos script (~1.8 min, a duplicate of a fleet-recovery test) moved to --full.
# 2026-12-03 (afternoon): A 41.2 min, B 44.7 min on a slow run of this VM, so test_fleet_launch.py and
# test_fleet_progress.py (~1.8 min together) moved to A. 2026-12-03 (evening, CPU engines without
# transformers): A 29.7 min, B 27.4 min.
# 2026-12-07: A 26 min, B 45 min (with 7 min of SGLang fixtures timing out, fixed since), so the position sweep
# (~3.7 min) and the verl real-replica script (~3.2 min) moved to A. Later that day: A 37 min, B 49 min (with the
# new real-SGLang hold test, ~6 min under load, and the netns tests), so the hold test moved to A. Evening, with
# other runs beside it: A 38.5 min, B 59 min (by per-test sums B ~8 min more), and the new netns sandbox test goes
# to B, so test_hooks_verl.py and its contract tests (~5 min) moved to A.
A=(tests/test_functional.py tests/test_fork_groups.py tests/test_soak.py tests/test_fuzz_checkpoint.py
   $(ls tests/test_sandbox_*.py) tests/test_fleet_recovery.py tests/test_fleet_launch.py tests/test_fleet_progress.py
   tests/test_chaos_positions.py tests/test_verl_real_replicas.py tests/test_verl_v1_transferqueue.py
   tests/test_sglang_hold.py tests/test_hooks_verl.py tests/test_hooks_verl_contracts.py)
B=()
for f in tests/test_*.py; do
  case " ${A[*]} " in *" $f "*) ;; *) B+=("$f") ;; esac
done
BELAYER_TEST_TIMES=$out/a.times "$PY" -m pytest -q -rfE --durations=25 --junitxml="$out/a.xml" "${A[@]}" "$@" > "$out/a.log" 2>&1 &
pa=$!
BELAYER_TEST_TIMES=$out/b.times "$PY" -m pytest -q -rfE --durations=25 --junitxml="$out/b.xml" "${B[@]}" "$@" > "$out/b.log" 2>&1 &
pb=$!
wait $pa; ra=$?
wait $pb; rb=$?
echo "=== half A (containers, chaos scripts): exit $ra ==="; cat "$out/a.log"
echo "=== half B (engines, fleet, hooks): exit $rb ==="; cat "$out/b.log"
"$PY" - "$out/a.xml" "$out/b.xml" <<'EOF'
import sys
import xml.etree.ElementTree as ET

tot = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
skipped = []
for path in sys.argv[1:]:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        print(f"no test report at {path}")
        continue
    for suite in ([root] if root.tag == "testsuite" else root.iter("testsuite")):
        for k in tot:
            tot[k] += int(suite.get(k, 0))
        for case in suite.iter("testcase"):
            sk = case.find("skipped")
            if sk is not None:
                skipped.append(f"{case.get('classname')}::{case.get('name')}: {sk.get('message', '')}")
# Every skip by name: under CI=true tests/skip_guard.py has already failed any not on tests/skip_allowlist.txt
for line in skipped:
    print(f"skipped {line}")
passed = tot["tests"] - tot["failures"] - tot["errors"] - tot["skipped"]
print(f"{passed} passed, {tot['failures'] + tot['errors']} failed, {tot['skipped']} skipped")
EOF
# pytest exits 5 when a half collected nothing: that is a failure of the suite too
[ $ra -eq 0 ] && [ $rb -eq 0 ]
