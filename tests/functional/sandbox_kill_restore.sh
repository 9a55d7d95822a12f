#!/usr/bin/env bash
# Chaos scenario: sandbox_kill_restore. Kill a sandbox container, then kill the container being restored: the restore is retried.
EXPECT=survival exec "$(dirname "$0")/run_scenario.sh" chaos/sandbox_kill_restore "$@"
