#!/usr/bin/env bash
# Chaos scenario: engine_server_kill. SIGKILL the serving engine's server process at token 6 of a request: handover + token-level resume.
EXPECT=survival exec "$(dirname "$0")/run_scenario.sh" chaos/engine_server_kill "$@"
