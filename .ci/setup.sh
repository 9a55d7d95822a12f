#!/usr/bin/env bash
# All set-up for Belayer on a fresh Debian machine of this kind. Idempotent: re-running only checks.
#   bash .ci/setup.sh             the Belayer venv (.venv): torch CPU, Ray, sglang-router, transformers, mkdocs ...
#   bash .ci/setup.sh --sglang    also the real SGLang venv (.venv-sglang) and its stand-ins
#   bash .ci/setup.sh --containers  also Podman, Docker, runc and CRIU >= 4.2
#   bash .ci/setup.sh --verl      also verl 0.9.1 (into .venv) for the verl hook
#   bash .ci/setup.sh --nemo-rl   also what NeMo-RL's modules need to import (source: ../shared/upstream/nemo-rl)
#   bash .ci/setup.sh --all       everything the test suite needs
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
want_sglang=0; want_containers=0; want_verl=0; want_nemo_rl=0
for a in "$@"; do
  case "$a" in
    --sglang) want_sglang=1 ;;
    --containers) want_containers=1 ;;
    --verl) want_verl=1 ;;
    --nemo-rl) want_nemo_rl=1 ;;
    --all) want_sglang=1; want_containers=1; want_verl=1; want_nemo_rl=1 ;;
    *) echo "setup.sh: unknown option $a" >&2; exit 2 ;;
  esac
done
PY=${BELAYER_PYTHON:-python3}
log() { printf '[setup] %s\n' "$*"; }
. .ci/lib.sh
pip_q() { pip_in .venv "$@"; }

# The SGLang venv and the container runtimes share nothing with .venv: they install beside it (a clean
# clone's set-up was ~5 of CI's minutes, one after another). verl and NeMo-RL install into .venv: after it.
side_logs=$(mktemp -d /tmp/belayer-setup-XXXXXX)
side_pids=()
side() {  # side NAME SCRIPT: runs a set-up script in the background, its output kept for the end
  bash "$2" > "$side_logs/$1.log" 2>&1 &
  side_pids+=("$!:$1")
}
if [ $want_sglang = 1 ]; then side sglang .ci/setup_sglang.sh; fi
if [ $want_containers = 1 ]; then side containers .ci/setup_containers.sh; fi

if [ ! -x .venv/bin/python ]; then
  log "creating .venv with $($PY --version)"
  $PY -m venv .venv
fi
stamp=.venv/.belayer-installed
if needs_install "$stamp" pyproject.toml .ci/constraints.txt; then
  log "installing Belayer and its dependencies into .venv"
  pip_q install -q --disable-pip-version-check --upgrade pip
  pip_q install -q --disable-pip-version-check -c .ci/constraints.txt "torch==2.13.0"
  pip_q install -q --disable-pip-version-check -c .ci/constraints.txt -e ".[test,docs]"
  touch "$stamp"
fi
.venv/bin/python -c "import torch, ray, transformers, sglang_router, hydra, mkdocs; print('[setup] .venv ok: torch', torch.__version__, 'ray', ray.__version__, 'transformers', transformers.__version__, 'mkdocs', mkdocs.__version__)"

if [ $want_verl = 1 ]; then bash .ci/setup_verl.sh; fi
if [ $want_nemo_rl = 1 ]; then bash .ci/setup_nemo_rl.sh; fi
side_failed=0
for entry in "${side_pids[@]}"; do
  pid=${entry%%:*}; name=${entry#*:}
  if wait "$pid"; then cat "$side_logs/$name.log"; else
    cat "$side_logs/$name.log"; log "FAILED: setup_$name.sh (its output above)"; side_failed=1
  fi
done
rm -rf "$side_logs"
[ $side_failed = 0 ] || exit 1
log "done"
