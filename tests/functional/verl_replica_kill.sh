#!/usr/bin/env bash
# Chaos scenario: verl_replica_kill. verl 0.9.1's own trainer objects on CPU (its composed ppo_trainer config
# plus recipes/verl/belayer.yaml, LLMServerManager with two replicas of Belayer's replica kind, the recipe's
# agent loop manager, BelayerCheckpointEngineManager) run 3 steps of the legacy trainer's sequence; at step 2
# one replica's server actor is SIGKILLed mid-rollout. Survival: every step's batch (ids, masks, logprobs,
# global steps) identical to the fault-free run, and every step started on both replicas.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${BELAYER_PY:-$ROOT/.venv/bin/python}
: "${EXPECT:=survival}"
[ "$EXPECT" = survival ] || { echo "verl_replica_kill: only EXPECT=survival is defined" >&2; exit 2; }
out=$(mktemp -d /tmp/belayer-verl-chaos-XXXXXX)
cd "$ROOT"
exec "$PY" -m tests.test_hooks_verl_replicas --report "$out/report.json" "$@"
