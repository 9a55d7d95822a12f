#!/usr/bin/env bash
# Chaos scenario: sandbox_kill_checkpoint. Kill a sandbox container while it is being checkpointed: the partial checkpoint is discarded, never used.
EXPECT=survival exec "$(dirname "$0")/run_scenario.sh" chaos/sandbox_kill_checkpoint "$@"
