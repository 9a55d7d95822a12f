#!/usr/bin/env bash
# Chaos scenario: engine_kill_refit. SIGKILL an engine just before the refit: the replacement is brought to the new version before it serves.
EXPECT=survival exec "$(dirname "$0")/run_scenario.sh" chaos/engine_kill_refit "$@"
