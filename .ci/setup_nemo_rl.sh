#!/usr/bin/env bash
# What importing NeMo-RL's real modules needs in Belayer's venv (.venv), for the NeMo-RL hook's tests and
# functional script. NeMo-RL itself is NOT installed: its source snapshot (../shared/upstream/nemo-rl, see its
# SNAPSHOT.md) goes on sys.path; its own pins (Python >= 3.13, torch 2.11) are not ours.
# Idempotent: a stamp makes reruns a few-second import check. Exits non-zero on any failure.
#
# - SGLangGeneration, register_env, fleet_health: pyzmq, nvidia-ml-py (imported at module level).
# - nemo_rl.algorithms.grpo (setup, refit_policy_generation): torchdata, mlflow, swanlab, wandb, tensorboard,
#   soundfile (imported at module level only; nothing logs), datasets and tensordict (nemo_rl.data*, as verl
#   needs them too) and pybase64 (NeMo-RL's SGLang weight-bucket helpers).
# Everything under the torch constraint (torch stays 2.13.0+cpu).
set -euo pipefail
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$SELF")/.."
ROOT=$PWD
VENV=$ROOT/.venv
STAMP=$VENV/.belayer-nemo-rl-installed
NEMO_RL=${BELAYER_NEMO_RL:-$(dirname "$ROOT")/shared/upstream/nemo-rl}
log() { printf '[setup_nemo_rl] %s\n' "$*"; }
. "$ROOT/.ci/lib.sh"
pip_q() { pip_in "$VENV" "$@"; }
t0=$(date +%s)

if [ ! -x "$VENV/bin/python" ]; then
  log "no $VENV: run .ci/setup.sh first" >&2
  exit 1
fi
if needs_install "$STAMP" "$SELF" .ci/constraints.txt; then
  log "installing what NeMo-RL's imports need into $VENV"
  pip_q install -q --disable-pip-version-check -c .ci/constraints.txt "torch==2.13.0" \
    pyzmq nvidia-ml-py pybase64 torchdata mlflow swanlab wandb tensorboard soundfile datasets \
    "tensordict>=0.8.0,<=0.10.0,!=0.9.0"
  touch "$STAMP"
fi
if [ ! -d "$NEMO_RL/nemo_rl" ]; then
  log "no NeMo-RL source at $NEMO_RL: the NeMo-RL tests will skip"
  exit 0
fi
PYTHONPATH="$NEMO_RL" "$VENV/bin/python" - <<'PYEOF'
import torch
assert torch.__version__ == "2.13.0+cpu", torch.__version__
from belayer_plugin.hooks.nemo_rl.upstream import import_grpo
grpo = import_grpo()  # first: it aliases typing.TypedDict for NeMo-RL's pydantic configs below Python 3.12
from nemo_rl.models.generation.sglang.sglang_generation import SGLangGeneration  # noqa: F401
from nemo_rl.environments.utils import register_env  # noqa: F401
from nemo_rl.models.generation.fleet_health import GenerationFleetHealth  # noqa: F401
print(f"[setup_nemo_rl] ok: NeMo-RL's SGLangGeneration and grpo.{grpo.refit_policy_generation.__name__} import")
PYEOF
log "done in $(( $(date +%s) - t0 )) s"
