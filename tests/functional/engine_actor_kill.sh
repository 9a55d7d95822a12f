#!/usr/bin/env bash
# Chaos scenario: engine_actor_kill. SIGKILL an engine's Ray actor mid-generation: its server dies with it (PDEATHSIG); handover + resume.
EXPECT=survival exec "$(dirname "$0")/run_scenario.sh" chaos/engine_actor_kill "$@"
