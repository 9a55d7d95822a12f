#!/usr/bin/env bash
# Chaos scenario: sandbox_kill with sandboxes on every node's sandbox host (sandbox.placement=spread): the kill is
# delivered through the host, which restores the latest checkpoint; the context rolls back, the agent regenerates.
EXPECT=survival exec "$(dirname "$0")/run_scenario.sh" chaos/sandbox_kill belayer.sandbox.placement=spread "$@"
