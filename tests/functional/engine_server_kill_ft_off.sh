#!/usr/bin/env bash
# Chaos scenario: engine_server_kill_ft_off. The engine_server_kill scenario with fault tolerance OFF: the run fails or loses work.
EXPECT=loses_work exec "$(dirname "$0")/run_scenario.sh" chaos/engine_server_kill_ft_off "$@"
