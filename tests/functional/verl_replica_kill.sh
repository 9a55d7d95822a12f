#!/usr/bin/env bash
# Chaos scenario: verl_replica_kill. verl 0.9.1's own replica class (rollout.name=vllm: verl's vLLMReplica and
# its launch_servers / sleep / abort code) under verl's composed ppo_trainer config plus recipes/verl/belayer.yaml,
# in hybrid mode as the v1 sync trainer runs it: verl's LLMServerManager, the recipe's agent loop manager, and
# the v1 trainer's own CheckpointEngineManager (rollout -> sleep -> weight sync, whose push wakes the server).
# Faults: a replica's server actor SIGKILLed mid-rollout, and one SIGKILLed between the rollout and the trainer's
# sleep; then the legacy trainer's checkpoint manager restarting verl's replica. Only the server process layer is
# a stand-in (hooks/verl/standins.py: vLLM cannot share a process with verl here).
# Survival: every step's batch identical to the fault-free run, verl's replica holding one new live server that
# got the trainer's sleep and then the current weights before it was routed, and both replicas serving the last step.
#   KIND=belayer  runs the older scenario on Belayer's own replica kind (rollout.name=belayer) instead.
#   KIND=vllm-tq  verl's v1 trainer as main_ppo runs it: TransferQueue, the recipe's BelayerAgentLoopManager
#                 (verl's AgentLoopManagerTQ) and BelayerReplayBuffer, a server SIGKILLed mid-rollout; the
#                 trajectories read back from TransferQueue equal the fault-free step's (tests/test_verl_v1_transferqueue.py).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${BELAYER_PY:-$ROOT/.venv/bin/python}
: "${EXPECT:=survival}"
: "${KIND:=vllm}"
[ "$EXPECT" = survival ] || { echo "verl_replica_kill: only EXPECT=survival is defined" >&2; exit 2; }
out=$(mktemp -d /tmp/belayer-verl-chaos-XXXXXX)
cd "$ROOT"
case "$KIND" in
  vllm) exec "$PY" -m tests.test_verl_real_replicas --report "$out/report.json" "$@" ;;
  belayer) exec "$PY" -m tests.test_hooks_verl_replicas --report "$out/report.json" "$@" ;;
  vllm-tq) exec "$PY" -m tests.test_verl_v1_transferqueue --report "$out/report.json" "$@" ;;
  *) echo "verl_replica_kill: KIND is vllm (verl's replica class), vllm-tq (v1 with TransferQueue) or belayer" >&2
     exit 2 ;;
esac
