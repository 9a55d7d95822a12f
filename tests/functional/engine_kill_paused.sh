#!/usr/bin/env bash
# Chaos scenario: engine_kill_paused. SIGKILL an engine while the fleet is paused with memory released (training phase): Ray liveness sees it.
EXPECT=survival exec "$(dirname "$0")/run_scenario.sh" chaos/engine_kill_paused "$@"
