#!/usr/bin/env bash
# Chaos scenario: sandbox_kill. Kill a sandbox container at an action boundary: restore the latest checkpoint, roll the context back, regenerate.
EXPECT=survival exec "$(dirname "$0")/run_scenario.sh" chaos/sandbox_kill "$@"
