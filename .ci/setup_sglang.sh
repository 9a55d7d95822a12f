#!/usr/bin/env bash
# Builds SGLang 0.5.23's own venv (.venv-sglang) for CPU-only machines. Idempotent: a stamp makes reruns
# a few-second import check. Called by `.ci/setup.sh --sglang`; runs on its own too.
#
# Why a separate venv: SGLang pins transformers==5.19 while verl 0.9.1 (Belayer's .venv) needs <5.11; the
# server is a separate process anyway.
# Why --no-deps from a freeze: `pip install sglang` cannot resolve without CUDA (it pins a CUDA torch,
# flashinfer and sglang-kernel). The freeze is the package set measured to serve a text model on CPU;
# torch comes first, from the local CPU wheel, and is not in the freeze.
# Two modules SGLang imports but does not use on CPU for text models (torchvision, vllm) are replaced by
# Belayer's import stand-ins (belayer_plugin/engines/sglang_standins), put on PYTHONPATH by the launcher.
set -euo pipefail
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$SELF")/.."
ROOT=$PWD
PY=${BELAYER_PYTHON:-python3}
VENV=$ROOT/.venv-sglang
FREEZE=$ROOT/.ci/sglang-cpu-freeze.txt
STANDINS=$ROOT/belayer_plugin/engines/sglang_standins
STAMP=$VENV/.belayer-sglang-installed
log() { printf '[setup_sglang] %s\n' "$*"; }
. "$ROOT/.ci/lib.sh"
pip_q() { pip_in "$VENV" "$@"; }
t0=$(date +%s)

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
if needs_install "$STAMP" "$FREEZE" "$SELF"; then
  log "installing torch 2.13.0+cpu and the SGLang CPU package set (--no-deps) into $VENV"
  pip_q install -q --disable-pip-version-check --upgrade pip
  # The constraint keeps the CPU build (the +cpu local version) whatever pip's index offers.
  pip_q install -q --disable-pip-version-check -c .ci/constraints.txt "torch==2.13.0"
  pip_q install -q --disable-pip-version-check --no-deps -r "$FREEZE"
  # Real packages would shadow nothing (the stand-ins come first on PYTHONPATH) but PyPI's torchvision
  # links libtorch_cuda and would crash anything else that imports it: keep them out of this venv.
  pip_q uninstall -q -y torchvision vllm >/dev/null || true
  touch "$STAMP"
  installed=1
fi

if [ "${installed:-0}" = 1 ] || [ "${BELAYER_SGLANG_SMOKE:-0}" = 1 ]; then
  # Smoke check after an install (~7 s): the server's entry module and its arguments import with the
  # stand-ins on path, on the CPU build of torch.
  PYTHONPATH="$STANDINS" "$VENV/bin/python" - <<'EOF2'
import torch, sglang, transformers
import sglang.launch_server  # noqa: F401  (imports the HTTP server, scheduler and model runner modules)
from sglang.srt.server_args import ServerArgs  # noqa: F401
assert torch.__version__.endswith("+cpu"), torch.__version__
print(f"[setup_sglang] .venv-sglang ok: sglang {sglang.__version__}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}")
EOF2
else
  # Already installed: a cheap check that the packages are still there (BELAYER_SGLANG_SMOKE=1 imports).
  "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('sglang') and u.find_spec('torch') else 1)" \
    || { echo "[setup_sglang] $VENV is stamped but lacks sglang or torch: rm -r $VENV and rerun" >&2; exit 1; }
  log ".venv-sglang already installed (stamp $STAMP)"
fi
log "took $(( $(date +%s) - t0 )) s"
