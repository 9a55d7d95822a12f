#!/usr/bin/env bash
# Runs one chaos recipe with the main job and asserts on its JSON report.
#   run_scenario.sh RECIPE [hydra overrides...]      with EXPECT=survival|bounded_failure|loses_work
# survival compares with a fault-free golden run of the same recipe (chaos off), made once and cached in
# $BELAYER_GOLDEN_DIR (default: a per-user temp dir keyed by the recipes' content).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${BELAYER_PY:-$ROOT/.venv/bin/python}
recipe=$1; shift
: "${EXPECT:?set EXPECT=survival|bounded_failure|loses_work}"
out=$(mktemp -d /tmp/belayer-chaos-XXXXXX)
"$PY" -m belayer_plugin.cli run "$recipe" "belayer.run_dir=$out" "$@" || true   # the check below decides
args=(--report "$out/report.json" --expect "$EXPECT")
if [ "$EXPECT" = survival ]; then
  # keyed by the recipes, the overrides AND the code: a golden run made otherwise is never compared against.
  # Chaos overrides are left out of the key (the golden run has chaos off), so scenarios that differ only in
  # their fault share one golden run.
  plain=()
  for a in "$@"; do case "$a" in belayer.chaos.*|+belayer.chaos.*) ;; *) plain+=("$a") ;; esac; done
  key=$( (echo "${plain[*]}"; cat "$ROOT"/recipes/demo.yaml "$ROOT"/recipes/belayer/default.yaml \
        $(find "$ROOT/belayer_plugin" "$ROOT/envs" -name '*.py' | sort)) | sha1sum | cut -c1-12)
  gdir=${BELAYER_GOLDEN_DIR:-/tmp/belayer-golden-$key}${GOLDEN_TAG:+-$GOLDEN_TAG}
  if [ ! -f "$gdir/report.json" ]; then
    rm -rf "$gdir.tmp"   # an interrupted earlier attempt: its checkpoints must not be resumed
    "$PY" -m belayer_plugin.cli run "$recipe" "belayer.run_dir=$gdir.tmp" belayer.chaos.enabled=false "${plain[@]}"
    rm -rf "$gdir"; mv "$gdir.tmp" "$gdir"
  fi
  args+=(--golden "$gdir/report.json")
fi
[ -n "${ERROR_TYPE:-}" ] && args+=(--error-type "$ERROR_TYPE")
[ -n "${MAX_DURATION:-}" ] && args+=(--max-duration "$MAX_DURATION")
exec "$PY" -m belayer_plugin.chaos.check "${args[@]}"
