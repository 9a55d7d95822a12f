#!/usr/bin/env bash
# Installs verl 0.9.1 into Belayer's own venv (.venv) for the verl hook (hooks/verl) and its tests.
# Idempotent: a stamp makes reruns a few-second import check. Exits non-zero on any failure.
#
# verl itself goes in with --no-deps (every verl extra pins torch 2.11 and CUDA packages); then only the
# base dependencies that the imported classes need, under the torch constraint (torch stays 2.13.0+cpu)
# and transformers < 5.11 (verl 0.9.1's own bound, which Belayer's pyproject already keeps).
# Left out on purpose (verl base dependencies not imported by verl.experimental.agent_loop,
# verl.workers.rollout.replica, verl.trainer.ppo.ray_trainer): wandb, tensorboard, pylatexenc, pybind11.
# They are imported lazily by trainers/loggers we do not run. peft, accelerate and torchdata are in: verl's
# v1 trainer package (its default trainer, and AgentLoopManagerTQ's package) imports them at module level.
set -euo pipefail
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$SELF")/.."
ROOT=$PWD
VENV=$ROOT/.venv
STAMP=$VENV/.belayer-verl-installed
log() { printf '[setup_verl] %s\n' "$*"; }
. "$ROOT/.ci/lib.sh"
pip_q() { pip_in "$VENV" "$@"; }
t0=$(date +%s)

if [ ! -x "$VENV/bin/python" ]; then
  log "no $VENV: run .ci/setup.sh first" >&2
  exit 1
fi
if needs_install "$STAMP" "$SELF" .ci/constraints.txt; then
  log "installing verl 0.9.1 (--no-deps) and its base dependencies into $VENV"
  pip_q install -q --disable-pip-version-check -c .ci/constraints.txt --no-deps "verl==0.9.1"
  pip_q install -q --disable-pip-version-check -c .ci/constraints.txt \
    "torch==2.13.0" "transformers>=5.5.3,<5.11,!=5.6.0" "ray[default]==2.60.0" \
    "tensordict>=0.8.0,<=0.10.0,!=0.9.0" "numpy>=2.0.0" "pyarrow>=19.0.0" \
    hydra-core codetiming datasets dill pandas packaging cachetools \
    peft accelerate torchdata "transferqueue==0.1.11" pyzmq msgspec  # v1 trainer: TransferQueue agent loop
  touch "$STAMP"
fi
"$VENV/bin/python" - <<'EOF'
import torch, transformers
from packaging.version import Version
assert torch.__version__ == "2.13.0+cpu", torch.__version__
assert Version(transformers.__version__) < Version("5.11"), transformers.__version__
import verl
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, DictConfigWrap, register  # noqa: F401
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop  # noqa: F401
from verl.workers.rollout.llm_server import LLMServerClient  # noqa: F401
from verl.workers.rollout.router import get_router_handle  # noqa: F401
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry  # noqa: F401
from verl.trainer.ppo.v1 import AgentLoopManagerTQ  # noqa: F401  (the v1 trainer's manager, TransferQueue)
print(f"[setup_verl] ok: verl {verl.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
EOF
log "done in $(( $(date +%s) - t0 )) s"
