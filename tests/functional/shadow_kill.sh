#!/usr/bin/env bash
# Chaos scenario: shadow_kill. SIGKILL the standby engine: it is replaced in the background; serving is not affected.
EXPECT=survival exec "$(dirname "$0")/run_scenario.sh" chaos/shadow_kill "$@"
