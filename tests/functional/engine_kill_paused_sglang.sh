#!/usr/bin/env bash
# engine_kill_paused against real SGLang 0.5.23 on CPU (greedy, cold restart: no standby), EXPECT=survival.
here=$(dirname "$0")
EXPECT=survival GOLDEN_TAG=sglang exec "$here/run_scenario.sh" chaos/engine_kill_paused $(cat "$here/sglang.overrides") "$@"
