#!/usr/bin/env bash
# Chaos scenario: engine_hang. SIGSTOP the serving engine: the stall timeout resumes its requests, probes declare it dead, it is killed and replaced.
EXPECT=survival exec "$(dirname "$0")/run_scenario.sh" chaos/engine_hang "$@"
